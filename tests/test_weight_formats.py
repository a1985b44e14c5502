"""The weight-format package (worker/formats/): a format added in one place (its own module and one
registry line) is listed by `mfs` (the flag's help, the start line), loaded, fused, counted, served and
benched through the public path; every invalid combination is refused by the registry with a message
that says what; the schemes answer what the execution layer asks (compilable, graphable, a swappable
head kernel)."""
from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

import pytest
import torch
from torch import nn

from worker.formats import (FORMATS, Int8DynamicLinear, Int8Embedding, linear_bytes_per_step, names,
                            quantize_model, register, resolve, rows_kernel_head, uncompilable, ungraphable)
from worker.family import ModelArgs  # noqa: F401 (the model flags exist before a format is added)

# A new format's whole module, as a file of its own in a package outside the tree: its scheme (class
# answers, ``supports`` / ``load``, a forward; ``concat`` and ``step_bytes`` from the base) and its
# ``FORMAT``. The counter says the served model ran it.
HALF16_MODULE = '''"""``--weights half16``: the weights in fp16, applied in fp32 (a toy format)."""
from __future__ import annotations

import torch
from torch import nn

from worker.formats.scheme import Scheme, WeightConfig
from worker.formats.weightformat import Layout, WeightFormat


class Half16Linear(Scheme):
    name, backend, graphable = "half16", "any", True
    row_tensors = ("qweight",)
    calls = 0  # forwards run, over every instance

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.qweight = nn.Parameter(w.detach().half(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        return cls(mod.weight, mod.bias), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        type(self).calls += 1
        return nn.functional.linear(x, self.qweight.float(), self.bias)


FORMAT = WeightFormat("half16", "fp16 weights (a test's toy)", ("cpu",),
                      layouts={"cpu": Layout((Half16Linear,), (Half16Linear,))})
'''


@pytest.fixture
def half16(tmp_path, monkeypatch) -> ModuleType:
    """The toy format's module, written into a package of its own, imported, and registered."""
    pkg = tmp_path / "toyformats"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "half16.py").write_text(HALF16_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("toyformats.half16")
    register(module.FORMAT)  # the one registry line a new format adds
    yield module
    del FORMATS["half16"]
    for name in ("toyformats.half16", "toyformats"):
        sys.modules.pop(name, None)


def _model(llama_dir):
    from worker.family import load_family
    return load_family(str(llama_dir), tiers="2,4,6", dtype="float32").model


def test_a_format_added_in_one_place_loads_fuses_counts_and_serves(llama_dir, half16):
    from engine import Engine
    from worker.sampling import SamplingParams
    assert "half16" in names() and resolve("half16").weights == "half16"
    fp32, model = _model(llama_dir), _model(llama_dir)
    report = quantize_model(model, "half16")
    assert report.schemes == {"half16": len(report.from_float)} and report.fused == 2 * len(model.layers)
    layer, ref_layer = model.layers[0], fp32.layers[0]
    assert isinstance(layer.qkv_proj, half16.Half16Linear) and isinstance(model.lm_head, half16.Half16Linear)
    x = torch.randn(3, layer.qkv_proj.in_features)
    want = torch.cat([ref_layer.q_proj(x), ref_layer.k_proj(x), ref_layer.v_proj(x)], -1)
    torch.testing.assert_close(layer.qkv_proj(x), want, rtol=0, atol=1e-3)  # fp16's rounding, fused by the base concat
    assert isinstance(model.embed_tokens, nn.Embedding)  # its layout names no embedding scheme: kept as loaded
    assert linear_bytes_per_step(model) * 2 == linear_bytes_per_step(fp32)  # fp16: half of fp32's bytes
    ids = [[3, 17, 29, 4, 11]]
    out = Engine(model, max_model_len=64).generate(ids, [2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4 and all(0 <= t < model.cfg.vocab_size for t in out[0])


def test_a_format_added_in_one_place_is_listed_loaded_and_served_by_mfs(tmp_path, frontend, half16, capsys):
    """The real `mfs` command line: `mfs up --help` lists the format with its help, `mfs up`'s start
    line names it, a bad name is refused, and `mfs generate --weights half16` serves a tiny model
    through the toy format's modules."""
    from family.manifest import manifest_for
    from mfs.cli import build_parser, main
    from mfs.commands import chosen, compile_choice
    from tests.support.factories import tiny_llama_with_tokenizer
    parser = build_parser()
    up = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["up"]
    assert "half16 = fp16 weights (a test's toy)" in " ".join(up.format_help().split())
    args = parser.parse_args(["up", "--weights", "half16", "--device", "cpu"])
    args.compile = compile_choice(args)
    assert "weights half16 (--weights half16)" in chosen(args, 1)
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--weights", "half17"])
    from worker.formats import names
    assert f"--weights 'half17': expected one of {', '.join(names())}" in capsys.readouterr().err
    assert names()[-1] == "half16"  # the one registered line put it in the list
    family = tiny_llama_with_tokenizer(tmp_path / "fam", frontend.tokenizer)
    tier = manifest_for(str(family))[0].tiers[-1].name
    half16.Half16Linear.calls = 0
    assert main(["generate", "--model", str(family), "--weights", "half16", "--device", "cpu", "--tier", tier,
                 "--max-tokens", "3", "--seed", "1", "hello"]) == 0
    assert capsys.readouterr().out.strip()
    assert half16.Half16Linear.calls > 0  # the served linears were the toy format's


def test_a_format_added_in_one_place_is_a_bench_column(llama_dir, half16):
    from benches.linears import measure
    from worker.family import load_family
    assert isinstance(load_family(str(llama_dir), tiers="2,4,6", dtype="float32",
                                  weights="half16").model.lm_head, half16.Half16Linear)
    rows, steps = measure(shapes=[("q 64->32", 64, 32, 2), ("head 64->128", 64, 128, 1)], batches=(1,), reps=1)
    assert {"fp32_us", "int8_us", "w8a8_us", "half16_us"} <= set(rows[0]) and "half16" in steps["1"]


@pytest.mark.parametrize("args,message", [
    (("int3",), "expected one of auto, fp32, int8"),
    (("int4", "mps"), "quantized kernels exist for CPU and CUDA, not mps"),
    (("w8a8", "cuda"), "fbgemm's int8 kernels are CPU only, not cuda"),
    (("w4a8", "cuda"), "its kernel is for CPUs with AVX2, not cuda"),
    (("w8a8", "cpu", "groups"), "layout 'groups', expected one of cpu"),
    (("int4", "cpu", "tiles"), "layout 'tiles'"),
])
def test_invalid_combinations_are_refused_by_the_registry(args, message):
    with pytest.raises(ValueError, match=message):
        resolve(*args)


def test_the_registry_refuses_what_cannot_compile_and_what_it_cannot_take():
    with pytest.raises(ValueError, match="--compile does not serve --weights w8a8 .*w8a8-cpu"):
        resolve("w8a8", "cpu", compile=True)
    assert resolve("int8", "cpu", compile=True).weights == "int8"
    with pytest.raises(ValueError, match="group 64"):
        resolve("w4a8", "cpu", group=64)
    with pytest.raises(ValueError, match="already registered"):
        register(FORMATS["int8"])
    assert resolve("auto", "cuda").weights == "fp32"  # CUDA's auto unchanged until the Triton kernel is measured


def test_the_execution_layer_asks_the_schemes(llama_dir):
    model = _model(llama_dir)
    assert uncompilable(model) == [] and not rows_kernel_head(model)
    quantize_model(model, "w8a8")
    assert uncompilable(model) == ["w8a8-cpu"] and isinstance(model.lm_head, Int8DynamicLinear)
    assert "w8a8-cpu" in ungraphable(model) and "int8-embedding" not in ungraphable(model)
    int8 = _model(llama_dir)
    quantize_model(int8, "int8")
    assert uncompilable(int8) == [] and rows_kernel_head(int8) and isinstance(int8.embed_tokens, Int8Embedding)
