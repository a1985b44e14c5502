"""An in-process engine over a family's model with the tests' small KV pool, and greedy decoding."""
from engine import Engine
from worker.sampling import SamplingParams

BS = 4


def make_engine(fam, **kw) -> Engine:
    kw.setdefault("block_size", BS)
    kw.setdefault("num_blocks", 64)
    return Engine(fam.model, **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def cold(fam, prompt: list[int], tier: int, n: int) -> list[int]:
    """The greedy answer of a fresh engine (nothing cached)."""
    return make_engine(fam).generate([prompt], [tier], greedy(n))[0]
