"""int8 weights times int8 activations on CPU (``--weights w8a8``): the decode-bound mode.

Owns :class:`Int8DynamicLinear` (the scheme ``w8a8-cpu``), :func:`reduce_range`, and ``FORMAT``, which
first smooths the activations into the weights (:func:`smooth_activations`).

Why it exists: torch's weight-only kernels (:mod:`worker.formats.int8`, :mod:`worker.formats.int4`) dequantize the weights and multiply
in bf16/fp32, so every extra row of a batch costs its full FMA count — on these 2-core machines about
as much per row as streaming the int4 weights once (docs/BENCHMARKS.md, "Why ~1.4×"). fbgemm's
dynamic quantized linear (``torch.ops.quantized.linear_dynamic``, what ``torch.ao`` dynamic
quantization runs) multiplies uint8 activations by int8 weights into int32 (VNNI's ``vpdpbusd`` on
AVX-512, ``vpmaddubsw`` on AVX2): a row costs a quarter of the arithmetic, so a decode step's cost is
nearly flat in its rows up to ~16 — the regime where one nested pass beats three deployments.

Batch invariance. fbgemm quantizes the activations with one (scale, zero point) per call, taken from
the whole batch's min and max: a row's result would depend on its neighbours. So each row is first
divided by its own max |x| and one extra row holding -1 and +1 is appended: the batch's range is then
always exactly [-1, 1], every row is quantized with the same parameters whatever else is in the batch,
the int32 dot products are exact, and the output is multiplied back by the row's max. A row's output
is the same bit for bit at any batch size (tested), so mixed batches still equal solo runs.

``reduce_range``: without VNNI, fbgemm's ``vpmaddubsw`` path adds pairs of u8*s8 products in int16 and
can saturate; activations are then quantized to 7 bits (what ``torch.ao`` does on x86 by default).
Decided once from the CPU's flags and logged.
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import structlog
import torch
from torch import nn

from worker.formats.int8 import Int8Embedding
from worker.formats.scheme import Scheme, WeightConfig
from worker.formats.weightformat import Layout, WeightFormat

log = structlog.get_logger(__name__)


@functools.cache
def reduce_range() -> bool:
    """True unless the CPU has AVX-512 VNNI (fbgemm's exact int8 path)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        flags = []
    vnni = "avx512_vnni" in flags and torch.backends.cpu.get_cpu_capability() == "AVX512"
    log.info("w8a8 activations", bits=8 if vnni else 7, avx512_vnni=vnni)
    return not vnni


def _engine() -> str:
    engines = torch.backends.quantized.supported_engines
    for e in ("x86", "fbgemm"):
        if e in engines:
            return e
    raise RuntimeError(f"--weights w8a8 needs torch's x86/fbgemm quantized engine; this build has {engines}")


class Int8DynamicLinear(Scheme):
    """y = x @ (q * scale[:, None]).T + b with q int8 [N, K] per output channel (symmetric), run by
    fbgemm on per-row 8-bit activations (see the module docstring). The int8 weights live only in
    fbgemm's packed form (``linear_unpack`` gives them back); the scales are a parameter.
    Not compilable: dynamo breaks the graph at every fbgemm call and the step ran ~2x slower (measured)."""
    name, backend, compilable = "w8a8-cpu", "cpu", False

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert q.dtype == torch.int8 and q.dim() == 2 and scales.shape == (q.shape[0],)
        self.out_features, self.in_features = q.shape
        self.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; fbgemm's ops take them
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q.contiguous(), self.scales.double(),
                                                          torch.zeros(self.out_features, dtype=torch.long), 0)
        prev = torch.backends.quantized.engine
        torch.backends.quantized.engine = _engine()
        try:
            # the bias stays out of fbgemm: it is added after the per-row rescale
            self.packed = torch.ops.quantized.linear_prepack(qw, None)
        finally:
            torch.backends.quantized.engine = prev
        self.reduce_range = reduce_range()
        pin = torch.zeros(1, self.in_features)
        pin[0, 0], pin[0, 1 % self.in_features] = -1.0, 1.0
        self.register_buffer("pin", pin, persistent=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8DynamicLinear":
        w = w.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-30)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        return cls.from_float(mod.weight, mod.bias), False

    def step_bytes(self) -> int:
        return self.packed_bytes() + super().step_bytes()

    def packed_bytes(self) -> int:
        """The packed int8 weights (not a parameter, so :func:`worker.model.weight_bytes` asks here)."""
        return self.out_features * self.in_features

    def int8_weight(self) -> torch.Tensor:
        qw, _ = torch.ops.quantized.linear_unpack(self.packed)
        return qw.int_repr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        # abs().amax(), not vector_norm(inf): that one does not vectorize over rows (31 vs 4 us at 16 x 576)
        amax = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)
        xn = torch.cat([x2 / amax, self.pin])
        y = torch.ops.quantized.linear_dynamic(xn, self.packed, self.reduce_range)[:-1].mul_(amax)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.int8_weight().float() * self.scales[:, None]

    @classmethod
    def concat(cls, mods: list["Int8DynamicLinear"]) -> "Int8DynamicLinear | None":
        """One linear computing ``cat([m(x) for m in mods], -1)`` (rows are independent)."""
        if any(type(m) is not cls or m.in_features != mods[0].in_features
               or (m.bias is None) != (mods[0].bias is None) for m in mods):
            return None
        bias = None if mods[0].bias is None else torch.cat([m.bias for m in mods])
        out = cls(torch.cat([m.int8_weight() for m in mods]), torch.cat([m.scales for m in mods]), bias)
        out.reduce_range = mods[0].reduce_range
        return out


def smooth_activations(model: nn.Module, cfg: WeightConfig, load_tokenizer: Callable | None) -> int:
    """Folds the activations' range into the weights before packing, calibrated on text in the model's
    tokenizer (worker/smoothing.py): it runs a nested model's tiers. Returns the linears changed."""
    from worker.smoothing import calibration_windows, input_amax, smooth  # noqa: PLC0415
    if not hasattr(model, "exit_hidden"):
        raise ValueError(f"--weights w8a8 smooths a nested model's activations; got {type(model).__name__}")
    windows = calibration_windows(load_tokenizer() if load_tokenizer else None, model.cfg.vocab_size)
    return smooth(model, input_amax(model, windows))


FORMAT = WeightFormat("w8a8", "int8 weights times int8 activations (fbgemm: cheap extra rows, for batches)",
                      ("cpu",), "fbgemm's int8 kernels are CPU only",
                      {"cpu": Layout((Int8DynamicLinear,), (Int8DynamicLinear,), (Int8Embedding,))},
                      prepare=smooth_activations)

__all__ = ["FORMAT", "Int8DynamicLinear", "reduce_range", "smooth_activations"]
