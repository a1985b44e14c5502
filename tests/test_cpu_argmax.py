"""``mfs::argmax_rows`` (kernels/cpu_argmax.cpp): torch.argmax's answer along the last dim -- the first
maximum, a row's first NaN, rows of -inf, lengths off the 8-lane and 16-lane steps, strided rows --
its errors, and greedy sampling through it."""

import pytest
import torch

from kernels import cpu_argmax
from kernels.cpu_gemv import cpu_flags

if not {"avx2", "fma"} <= cpu_flags():
    pytest.skip("the operator needs AVX2 and FMA", allow_module_level=True)


@pytest.fixture(scope="module")
def op():
    cpu_argmax.load()
    return torch.ops.mfs.argmax_rows


@pytest.mark.parametrize("n", [1, 7, 8, 9, 15, 16, 17, 31, 33, 1000, 49152])
def test_random_rows_are_torchs_argmax(op, n):
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(op(x), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("n", [3, 8, 40, 1001])
def test_ties_give_the_first_maximum(op, n):
    x = torch.zeros(4, n)
    x[0, n // 2:] = 1.0   # ties from the middle on: the first of them
    x[1, n - 1] = x[1, 0] = 2.0   # the first and the last
    x[2, :] = -1.0   # all equal: 0
    x[3, n - 1] = 0.5   # only the last
    assert torch.equal(op(x), torch.argmax(x, dim=-1))
    assert op(x).tolist() == [n // 2, 0, 0, n - 1]
    z = torch.full((2, n), -1.0)
    z[0, 0], z[0, n - 1] = -0.0, 0.0  # -0.0 == +0.0: the first of them
    z[1, n - 1] = -0.0
    assert op(z).tolist() == torch.argmax(z, dim=-1).tolist() == [0, n - 1]


@pytest.mark.parametrize("n", [5, 24, 1003])
def test_nans_and_infinities_are_torchs(op, n):
    x = torch.randn(5, n, generator=torch.Generator().manual_seed(1))
    x[0, n - 2] = float("nan")  # the NaN wins, wherever it is (torch's answer)
    x[1, 1] = x[1, n - 1] = float("nan")  # the first NaN
    x[2, :] = float("-inf")  # a fully masked row: 0
    x[3, n // 3] = float("inf")
    x[4, 2] = float("inf")
    x[4, n - 1] = float("nan")  # NaN over +inf
    got = op(x)
    assert torch.equal(got, torch.argmax(x, dim=-1))
    assert got.tolist() == [n - 2, 1, 0, n // 3, n - 1]


def test_strided_and_sliced_rows(op):
    base = torch.randn(6, 130, generator=torch.Generator().manual_seed(2))
    for x in (base[:, 3:120], base[::2], base[1:4, :64]):
        assert torch.equal(op(x), torch.argmax(x, dim=-1))
    col = base.t()  # rows not contiguous: the operator copies them
    assert torch.equal(op(col), torch.argmax(col, dim=-1))
    assert op(torch.empty(0, 10)).shape == (0,)


def test_bad_input_is_refused(op):
    with pytest.raises(RuntimeError, match="CPU fp32"):
        op(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="CPU fp32"):
        op(torch.randn(5))
    with pytest.raises(RuntimeError, match="must not be empty"):
        op(torch.empty(2, 0))


def test_argmax_rows_takes_torchs_path_where_the_operator_does_not_apply(op, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_argmax, "_choice", [lambda x: calls.append(x.shape) or op(x)])
    for x in (torch.randn(3, 9, dtype=torch.float64), torch.randn(3, 9).to(torch.bfloat16), torch.randn(9, 3).t()):
        assert torch.equal(cpu_argmax.argmax_rows(x), torch.argmax(x, dim=-1))
    assert calls == []  # float64, bf16 and rows not contiguous went to torch


def test_greedy_sampling_goes_through_the_operator(op, monkeypatch):
    from worker.sampling import SamplingParams, sample
    calls = []
    monkeypatch.setattr(cpu_argmax, "_choice", [lambda x: calls.append(x.shape) or op(x)])
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    got = sample(logits, [SamplingParams(max_tokens=1)] * 4, [None] * 4)
    assert got == torch.argmax(logits, dim=-1).tolist() and calls == [(4, 300)]


def test_the_linears_bench_times_the_operator_against_torch_on_the_same_answer():
    from benches.linears import measure_argmax
    from kernels.cpu_argmax import argmax_kernel
    rows = measure_argmax(vocab=1000, batches=(1, 3), reps=3)
    if argmax_kernel() is None:
        assert rows is None  # serving takes torch.argmax, and the bench says so
        return
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["mfs_us"] > 0 and r["torch_us"] > 0 and r["speedup"] == r["torch_us"] / r["mfs_us"] for r in rows)
