"""The weight-format package (worker/formats/): a format added in one place (a scheme and a registry
line) is loaded, fused, counted, served and benched through the public path; every invalid combination
is refused by the registry with a message that says what; the schemes answer what the execution layer
asks (compilable, graphable, a swappable head kernel)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from worker.formats import (FORMATS, Int8DynamicLinear, Int8Embedding, Layout, Scheme, WeightConfig,
                            WeightFormat, linear_bytes_per_step, names, quantize_model, register, resolve,
                            rows_kernel_head, uncompilable, ungraphable)


class Half16Linear(Scheme):
    """A toy format: the weights in fp16, applied in fp32 (what a real new format's module looks like:
    class answers, ``supports`` / ``load``, a forward; ``concat`` and ``step_bytes`` from the base)."""
    name, backend, graphable = "half16", "any", True
    row_tensors = ("qweight",)

    def __init__(self, w: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = w.shape
        self.qweight = nn.Parameter(w.detach().half(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        return cls(mod.weight, mod.bias), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.qweight.float(), self.bias)


HALF16 = WeightFormat("half16", "fp16 weights (a test's toy)", ("cpu",), layouts={
    "cpu": Layout((Half16Linear,), (Half16Linear,), embedding=())})


@pytest.fixture
def half16():
    register(HALF16)  # the one registry line a new format adds
    yield HALF16
    del FORMATS["half16"]


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
    assert isinstance(layer.qkv_proj, Half16Linear) and isinstance(model.lm_head, Half16Linear)
    x = torch.randn(3, layer.qkv_proj.in_features)
    want = torch.cat([ref_layer.q_proj(x), ref_layer.k_proj(x), ref_layer.v_proj(x)], -1)
    torch.testing.assert_close(layer.qkv_proj(x), want, rtol=0, atol=1e-3)  # fp16's rounding, fused by the base concat
    assert isinstance(model.embed_tokens, nn.Embedding)  # its layout names no embedding scheme: kept as loaded
    assert linear_bytes_per_step(model) * 2 == linear_bytes_per_step(fp32)  # fp16: half of fp32's bytes
    ids = [[3, 17, 29, 4, 11]]
    out = Engine(model, max_model_len=64).generate(ids, [2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0]) == 4 and all(0 <= t < model.cfg.vocab_size for t in out[0])


def test_a_format_added_in_one_place_is_a_flag_and_a_bench_column(llama_dir, half16):
    from benches.linears import measure
    from worker.family import ModelArgs, load_family
    import argparse
    from core.cli import add_args
    p = argparse.ArgumentParser()
    add_args(p, ModelArgs)
    assert p.parse_args(["--weights", "half16"]).weights == "half16"
    with pytest.raises(SystemExit):
        p.parse_args(["--weights", "int3"])
    assert isinstance(load_family(str(llama_dir), tiers="2,4,6", dtype="float32",
                                  weights="half16").model.lm_head, Half16Linear)
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
