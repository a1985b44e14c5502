"""The prompt and module lists behind ``--data`` and the evaluation (split from training/data.py):
the stdlib modules for training and held-out text, the prompts whose answers the base model writes
(``self``, ``chat``, ``vocab``, ``names``), the held-out prompts and the fixed evaluation questions, and
:func:`check_disjoint`, which asserts that no training prompt is an evaluation one."""
from __future__ import annotations

STDLIB_TRAIN = [
    "abc", "argparse", "array", "ast", "asyncio", "base64", "binascii", "bz2", "cmath", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "dis", "email", "enum", "filecmp", "fnmatch", "ftplib", "functools", "getopt",
    "gettext", "glob", "gzip", "hashlib", "hmac", "html", "http.client", "imaplib", "inspect", "io",
    "ipaddress", "itertools", "json", "keyword", "locale", "logging", "lzma", "mailbox", "math",
    "mimetypes", "numbers", "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform",
    "plistlib", "pprint", "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors",
    "shelve", "shlex", "shutil", "signal", "smtplib", "socket", "sqlite3", "ssl", "stat", "statistics",
    "string", "struct", "subprocess", "sys", "tarfile", "tempfile", "threading", "time", "timeit",
    "token", "tokenize", "trace", "traceback", "types", "typing", "unicodedata", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "wave", "weakref", "xml.dom", "zipfile", "zlib",
]
# Never used for training by any built-in source.
STDLIB_HELDOUT = ["textwrap", "fractions", "heapq", "bisect", "calendar", "graphlib"]

_TOPICS = [
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the French Revolution",
    "machine learning", "the immune system", "climate change", "the stock market", "democracy",
    "the Roman Empire", "electricity", "gravity", "DNA", "the internet", "vaccines", "earthquakes",
    "the moon", "bees", "coffee", "chess", "the Renaissance", "recycling", "inflation", "music theory",
    "the human heart", "rainbows", "solar panels", "the printing press", "ocean tides",
    "antibiotics", "cloud computing", "the Olympic Games", "dinosaurs", "sleep", "meditation",
    "the Great Wall of China", "electric cars", "sound waves", "friendship",
]
_TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}?", "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.", "Why is {t} important?",
]
_TASKS = [
    "Write a haiku about autumn.", "Write a short poem about the sea.", "Tell me a short joke.",
    "Give me three tips for studying effectively.", "How do I make a cup of tea?",
    "Suggest a name for a pet cat.", "What should I pack for a beach holiday?",
    "Write a polite email declining a meeting invitation.", "How can I improve my handwriting?",
    "Give me a simple recipe for pancakes.", "What are the benefits of regular exercise?",
    "How do I start learning to play the guitar?", "Summarize the story of Cinderella.",
    "Write a Python function that returns the square of a number.",
    "Write a Python function that reverses a string.", "What is a list comprehension in Python?",
    "Explain what a for loop does.", "What is the difference between a list and a tuple in Python?",
    "How do I read a file in Python?", "What is 12 times 7?", "What is 15 plus 27?",
    "Is 17 a prime number?", "Convert 5 kilometers to meters.", "What is the boiling point of water?",
    "How many days are in a leap year?", "Who wrote Romeo and Juliet?", "What is the largest planet?",
    "What language is spoken in Brazil?", "What is the chemical symbol for gold?",
    "How many continents are there?", "Translate 'good morning' into Spanish.",
    "What is the opposite of 'ancient'?", "Give me a synonym for 'happy'.",
    "Describe a sunset in two sentences.", "How do airplanes stay in the air?",
    "What causes the seasons?", "How do plants grow?", "What is a healthy breakfast?",
    "How can I save money each month?", "What is the tallest mountain in the world?",
]
_TOPICS_MORE = [
    "the Amazon rainforest", "penguins", "the Eiffel Tower", "photosynthesis in algae", "tornadoes",
    "the Sahara desert", "honeybees and pollination", "the Industrial Revolution", "atoms", "robots",
    "the solar system", "whales", "the Nile river", "wind turbines", "the periodic table", "mushrooms",
    "ancient Egypt", "the Moon landing", "blood cells", "deserts", "origami", "volleyball", "jazz",
    "the metric system", "glaciers and ice ages", "lightning", "coral reefs", "the alphabet",
    "bicycles", "tea ceremonies", "rain", "the heart of a computer (the CPU)", "compost", "owls",
]
_TEMPLATES_MORE = ["Tell me about {t}.", "Answer briefly: what is {t}?", "Describe {t} in one sentence."]
_TASKS_MORE = [
    "What is 9 times 8?", "What is 100 minus 37?", "What is half of 50?", "Spell the word 'banana'.",
    "Name three fruits.", "Name three animals that live in the ocean.", "What color is the sky on a clear day?",
    "What is the capital of Italy?", "What is the capital of Japan?", "What is the capital of Canada?",
    "Who wrote Hamlet?", "Who discovered penicillin?", "What is the freezing point of water?",
    "How many legs does a spider have?", "How many hours are in a day?", "What is the largest ocean?",
    "Write one sentence about cats.", "Write one sentence about the rain.", "Say hello in French.",
    "What do cows drink?", "What gas do plants absorb?", "Give me a word that rhymes with 'light'.",
    "Complete the sentence: The early bird...", "What is the plural of 'mouse'?",
]
SELF_PROMPTS = ([tp.format(t=t) for t in _TOPICS for tp in _TEMPLATES] + _TASKS
                + [tp.format(t=t) for t in _TOPICS_MORE for tp in _TEMPLATES_MORE] + _TASKS_MORE)

# ``chat``: a second, larger prompt set of the shape the tiers serve most - short factual questions
# and small instructions, answered briefly - so the exit blocks see chat, not only documentation.
# Written to avoid the facts the evaluation questions ask about (no capitals, sums or animals that
# EVAL_QUESTIONS / EVAL_QUESTIONS_LARGE use); check_disjoint asserts the exact-string part of that.
_TOPICS_CHAT = [
    "the Pacific Ocean", "mountains", "rivers", "the Arctic", "rain forests", "islands", "caves",
    "the wheel", "the telephone", "the light bulb", "the steam engine", "paper", "glass", "steel",
    "plastic", "cotton", "wool", "bread", "cheese", "rice", "chocolate", "salt", "sugar", "apples",
    "bananas", "potatoes", "tomatoes", "oranges", "carrots", "frogs", "butterflies", "ants", "eagles",
    "sharks", "dolphins", "elephants", "horses", "rabbits", "wolves", "snakes", "turtles", "parrots",
    "football", "tennis", "swimming", "running", "painting", "photography", "dancing", "poetry",
    "libraries", "museums", "schools", "hospitals", "farms", "cities", "bridges", "trains", "ships",
    "rockets", "satellites", "telescopes", "microscopes", "computers", "smartphones", "email",
    "passwords", "batteries", "magnets", "fire", "clouds", "snow", "wind", "thunder", "stars",
    "comets", "Jupiter", "Saturn's rings", "the Milky Way", "fossils", "rocks", "soil",
    "trees", "flowers", "seeds", "leaves", "forests", "kindness", "honesty", "teamwork", "patience",
    "gardening", "cooking", "camping", "maps", "clocks", "calendars", "money", "banks", "languages",
]
_TEMPLATES_CHAT = ["Give me one fact about {t}.", "Explain {t} to a child in two sentences."]
_TASKS_CHAT = [
    "What is 4 times 6?", "What is 9 plus 11?", "What is 30 minus 12?", "What is 45 divided by 9?",
    "What is 8 times 3?", "What is 14 plus 14?", "What is 60 divided by 5?", "What is 11 times 11?",
    "What is 50 plus 25?", "What is 81 divided by 9?", "What is 6 times 7?", "What is 13 minus 8?",
    "What is double 12?", "What is a quarter of 100?", "Is 9 an even number?", "Is 21 a prime number?",
    "What comes after Tuesday?", "What comes before Friday?", "How many minutes are in an hour?",
    "How many seconds are in a minute?", "How many weeks are in a year?",
    "How many cents are in a dollar?", "How many centimeters are in a meter?",
    "How many grams are in a kilogram?", "How many legs does an insect have?",
    "How many wheels does a bicycle have?", "How many strings does a violin have?",
    "How many players are on a soccer team?", "What is the capital of Egypt?",
    "What is the capital of China?", "What is the capital of India?", "What is the capital of Russia?",
    "What is the capital of Kenya?", "What is the capital of Greece?", "What is the capital of Portugal?",
    "What is the capital of Sweden?", "What is the capital of Argentina?",
    "What is the capital of Norway?", "What is the capital of Peru?", "What is the capital of Ireland?",
    "What is the longest river in the world?", "What is the largest desert in the world?",
    "What is the smallest planet in the solar system?", "Which planet has the most moons?",
    "What is the hottest planet?", "What is the largest continent?",
    "What is the largest country by area?", "What is the deepest ocean trench?",
    "Which ocean is the coldest?", "Who painted 'The Starry Night'?",
    "Who composed the 'Moonlight Sonata'?", "Who invented the telephone?", "Who invented the light bulb?",
    "Who developed the theory of relativity?", "Who was the first president of the United States?",
    "Who wrote 'Oliver Twist'?", "Who discovered gravity?", "Who wrote 'The Odyssey'?",
    "Who painted the ceiling of the Sistine Chapel?", "What is the chemical symbol for iron?",
    "What is the chemical symbol for oxygen?", "What is the chemical symbol for sodium?",
    "What gas do humans breathe out?", "What is the hardest natural substance?",
    "What is the center of an atom called?", "What organ pumps blood through the body?",
    "What organ do we use to think?", "How many bones are in the adult human body?",
    "What is the largest organ of the human body?", "What do caterpillars turn into?",
    "What do tadpoles grow into?", "What do squirrels eat?", "What do pandas eat?",
    "Where do penguins live?", "Where do kangaroos live?", "What is a group of wolves called?",
    "What is a baby horse called?", "What is a baby sheep called?", "What is a baby cow called?",
    "What sound does a duck make?", "What sound does a sheep make?",
    "Which bird cannot fly but runs fast?", "What color is a banana?", "What color is a ripe tomato?",
    "What color do you get by mixing blue and yellow?", "What color do you get by mixing red and white?",
    "What color is snow?", "What color is coal?", "What shape is a coin?",
    "How many corners does a cube have?", "What is the opposite of 'fast'?",
    "What is the opposite of 'happy'?", "What is the opposite of 'light'?",
    "What is the opposite of 'open'?", "What is the opposite of 'early'?",
    "What is the opposite of 'full'?", "Give me a synonym for 'small'.", "Give me a synonym for 'quick'.",
    "Give me a synonym for 'smart'.", "Give me a synonym for 'angry'.",
    "Give me a word that rhymes with 'cat'.", "Give me a word that rhymes with 'tree'.",
    "What is the plural of 'child'?", "What is the plural of 'goose'?",
    "What is the past tense of 'run'?", "What is the past tense of 'eat'?", "Spell the word 'school'.",
    "How many letters are in the word 'apple'?", "Is 'quickly' an adverb or an adjective?",
    "What is a verb?", "What is an adjective?", "Translate 'hello' into German.",
    "Translate 'cat' into French.", "Translate 'water' into Spanish.", "Translate 'friend' into Italian.",
    "Say goodbye in Spanish.", "How do you say 'yes' in French?", "Name a fruit that is yellow.",
    "Name a bird that cannot fly.", "Name three countries in Europe.",
    "Name a mammal that lives in the sea.", "Name two kinds of trees.", "Name a sport played with a bat.",
    "Name a famous scientist.", "Name a tool used for cutting paper.", "Name something that is cold.",
    "Write one sentence about horses.", "Write one sentence about the moon.",
    "Write one sentence about books.", "Write one sentence about summer.",
    "Write one sentence about music.", "Write one sentence about trees.",
    "Write one sentence about friendship.", "Write one sentence about the city.",
    "Write one sentence about trains.", "Write a two-line poem about the stars.",
    "Write a haiku about snow.", "Write a haiku about the morning.",
    "Write a short thank-you note to a teacher.", "Write a short message inviting a friend to lunch.",
    "Write a short apology for being late.", "Write a one-sentence story about a dragon.",
    "Give me a tip for sleeping better.", "Give me a tip for drinking more water.",
    "Give me a tip for learning a new language.", "Give me a tip for staying focused.",
    "Suggest a name for a pet goldfish.", "Suggest a fun activity for a rainy day.",
    "Suggest a healthy snack.", "Suggest a title for a story about a lost key.", "How do I boil an egg?",
    "How do I tie my shoelaces?", "How do I plant a seed?", "How do I wash my hands properly?",
    "How do I make a paper airplane?", "How do I brush my teeth?", "What should I do if I feel tired?",
    "What should I bring to a picnic?", "Why do we need sleep?", "Why do birds migrate?",
    "Why is the ocean salty?", "Why do cats purr?", "Why does ice float?", "Why do stars twinkle?",
    "What is a computer program?", "What is a variable in Python?",
    "What does the print function do in Python?", "Write a Python function that adds two numbers.",
    "Write a Python function that checks if a number is even.", "What is a dictionary in Python?",
    "What does 'def' mean in Python?", "What is an if statement?", "How do I write a comment in Python?",
    "What is the output of print(3 * 4) in Python?", "What is a file extension?",
    "What does CPU stand for?", "What does www stand for?", "What is a keyboard used for?",
    "What is the internet used for?", "Finish the sentence: An apple a day...",
    "Finish the sentence: Practice makes...", "Finish the sentence: Better late than...",
    "Is a tomato a fruit or a vegetable?", "Is the Earth flat or round?",
    "Which is heavier, a kilogram of feathers or a kilogram of iron?",
    "Which is bigger, an elephant or a mouse?", "Which is colder, ice or steam?",
]
CHAT_PROMPTS = [tp.format(t=t) for t in _TOPICS_CHAT for tp in _TEMPLATES_CHAT] + _TASKS_CHAT

HELDOUT_PROMPTS = [
    "Explain how a refrigerator works.", "What is a glacier?", "Write a short poem about the forest.",
    "Give me two tips for a job interview.", "How do magnets work?", "What is a noun?",
    "Describe the planet Mars.", "Why do leaves change color in autumn?",
]
# Questions `mfs eval` asks every tier (greedy, chat template). Not in any training set.
EVAL_QUESTIONS = [
    "What is the capital of France?", "What is 2 plus 2?", "Name a primary color.",
    "Who painted the Mona Lisa?", "What do bees make?", "Write one sentence about dogs.",
]

# The larger fixed question set (`mfs eval`, `mfs bench route`): short factual and instruction
# prompts, each judged by agreement with the top tier's greedy answer. Not in any training set.
EVAL_QUESTIONS_LARGE = [
    "What is the capital of Germany?", "What is the capital of Spain?", "What is 3 plus 5?",
    "What is 10 times 10?", "What is 20 divided by 4?", "How many days are in a week?",
    "How many months are in a year?", "What is the color of grass?", "What animal says 'moo'?",
    "What is the opposite of 'hot'?", "What is the opposite of 'up'?", "Name a vegetable.",
    "Name a musical instrument.", "Name a planet in our solar system.", "Who wrote 'Pride and Prejudice'?",
    "Who was the first person to walk on the Moon?", "What is H2O?", "What do we call a baby dog?",
    "What do we call a baby cat?", "What is the largest animal on Earth?", "What is the fastest land animal?",
    "Which planet is known as the Red Planet?", "What is the main language spoken in Mexico?",
    "What is the currency of Japan?", "How many sides does a triangle have?",
    "How many sides does a square have?", "What is the square root of 16?",
    "Translate 'thank you' into Spanish.", "Give me a synonym for 'big'.",
    "Write one sentence about the ocean.", "Write one sentence about winter.",
    "Write a short greeting for a birthday card.", "What season comes after summer?",
    "What is the boiling point of water in Fahrenheit?", "What is the capital of Australia?",
    "What do plants need to grow?", "What is the tallest animal?", "What shape is a ball?",
    "What is the first letter of the English alphabet?", "What is 7 plus 6?",
    "Name a color of the rainbow.", "What do you call frozen water?", "Where do fish live?",
    "What is the sun?",
]


def keyword_questions() -> set[str]:
    """The questions of the keyword-checked files under evals/questions/ (``mfs eval --questions``,
    ``mfs bench cuts``): evaluation questions like the others, never a training prompt."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    out: set[str] = set()
    for f in sorted((Path(__file__).resolve().parents[1] / "evals/questions").glob("*.jsonl")):
        out |= {json.loads(line)["question"] for line in f.read_text().splitlines() if line.strip()}
    return out


def check_disjoint() -> None:
    assert not set(STDLIB_TRAIN) & set(STDLIB_HELDOUT)
    evals = set(HELDOUT_PROMPTS) | set(EVAL_QUESTIONS) | set(EVAL_QUESTIONS_LARGE) | keyword_questions()
    assert not set(SELF_PROMPTS) & evals
    assert not set(CHAT_PROMPTS) & (evals | set(SELF_PROMPTS))
    assert len(set(CHAT_PROMPTS)) == len(CHAT_PROMPTS)
    assert not set(HELDOUT_PROMPTS) & (set(EVAL_QUESTIONS) | set(EVAL_QUESTIONS_LARGE))


# ``vocab``: prompts about whole English words of the tokenizer's vocabulary, never about a word the
# evaluation asks about or answers with (nor one sharing its first four letters with such a word).
VOCAB_PROMPTS_DEFAULT = 2400
_VOCAB_TEMPLATES = ['What does the word "{w}" mean?', 'Use the word "{w}" in a sentence.',
                    "Tell me something about {w}."]
# words the top tier's answers to the evaluation questions use (Paris, 4, honey, ...)
_EVAL_ANSWER_WORDS = (
    "paris berlin madrid canberra honey leonardo vinci primary red blue yellow green four eight hundred "
    "five seven twelve thirteen cow cold down carrot piano guitar mars jupiter austen jane armstrong neil "
    "water puppy kitten whale cheetah giraffe spanish yen triangle three square gracias large huge ocean "
    "winter birthday autumn fall fahrenheit sunlight sphere round letter alphabet rainbow ice star "
    "oxygen hydrogen sun loyal companion").split()


def _eval_words() -> set[str]:
    import re  # noqa: PLC0415
    text = " ".join(EVAL_QUESTIONS + EVAL_QUESTIONS_LARGE + HELDOUT_PROMPTS).lower()
    return {w for w in re.findall(r"[a-z]+", text) if len(w) >= 3} | set(_EVAL_ANSWER_WORDS)


def _whole_words(tokenizer, proper: bool) -> list[str]:
    """Sorted whole-word tokens of the tokenizer (a leading-space token of 5-12 ASCII letters) that no
    evaluation question asks about or answers with (nor one sharing its first four letters with such a
    word). ``proper=False``: lowercase words; ``proper=True``: capitalised words with no lowercase twin
    in the vocabulary (names of people, places, works: ``Korea``, ``Turing``, ``Everest``)."""
    banned = _eval_words()
    stems = {w[:4] for w in banned if len(w) >= 4}
    vocab = tokenizer.get_vocab()
    spaced = {t[1:] for t in vocab if t.startswith("\u0120")}
    if proper:
        words = {w for w in spaced if w.isascii() and w.isalpha() and 5 <= len(w) <= 12
                 and w[0].isupper() and w[1:].islower() and w.lower() not in spaced}
    else:
        words = {w for w in spaced if w.isascii() and w.isalpha() and w.islower() and 5 <= len(w) <= 12}
    return sorted(w for w in words if w.lower() not in banned and w.lower()[:4] not in stems)


def _word_prompts(words: list[str], templates: list[str], n: int, seed: int, source: str) -> list[str]:
    import random  # noqa: PLC0415
    if n > len(words):
        raise ValueError(f"{source}:{n}: the tokenizer has only {len(words)} eligible words")
    picked = random.Random(seed).sample(words, n)
    return [templates[i % len(templates)].format(w=w) for i, w in enumerate(picked)]


def vocab_prompts(tokenizer, n: int = VOCAB_PROMPTS_DEFAULT, seed: int = 0) -> list[str]:
    """``n`` prompts about distinct lowercase words drawn (seeded) from the tokenizer's whole-word
    tokens, templates taken in turn."""
    return _word_prompts(_whole_words(tokenizer, proper=False), _VOCAB_TEMPLATES, n, seed, "vocab")


# ``names``: the same for proper names of the vocabulary - chat answers that recall facts about people,
# places and works, the kind of recall the lower tiers miss most on the fixed questions.
NAMES_PROMPTS_DEFAULT = 1500
_NAMES_TEMPLATES = ["Tell me about {w}.", "What is {w} known for?", "Give me one fact about {w}."]


def names_prompts(tokenizer, n: int = NAMES_PROMPTS_DEFAULT, seed: int = 0) -> list[str]:
    """``n`` prompts about distinct capitalised whole words of the tokenizer with no lowercase twin
    (proper names), drawn seeded, templates taken in turn."""
    return _word_prompts(_whole_words(tokenizer, proper=True), _NAMES_TEMPLATES, n, seed, "names")


# the counted answer sources: name -> (default count, prompt builder)
COUNTED_SOURCES = {"vocab": (VOCAB_PROMPTS_DEFAULT, vocab_prompts),
                   "names": (NAMES_PROMPTS_DEFAULT, names_prompts)}


def _counted(part: str) -> tuple[str, int] | None:
    """'vocab' -> ('vocab', its default count), 'names:N' -> ('names', N), anything else -> None."""
    name, sep, num = part.partition(":")
    if name not in COUNTED_SOURCES:
        return None
    if not sep:
        return name, COUNTED_SOURCES[name][0]
    try:
        n = int(num)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"--data {part!r}: {name}:N needs a positive number of prompts")
    return name, n


def counted_prompts(part: str, tokenizer) -> tuple[str, int, list[str]] | None:
    """The prompts of a counted source ``part`` ('vocab:1200'), or None when it is not one."""
    if (c := _counted(part)) is None:
        return None
    if tokenizer is None:
        raise ValueError(f"the {c[0]} source's prompts need the tokenizer")
    return c[0], c[1], COUNTED_SOURCES[c[0]][1](tokenizer, c[1])
