"""``mfs::decode_attention`` (kernels/cpu_attention.cpp): decode rows against their context read in place
from the paged pool, the new entry from the step. Checked against a float64 reference (the 512-bit form
for SmolLM-like shapes on AVX-512 machines, the AVX2 form for others, and the AVX2 build in a subprocess
wherever this one is AVX-512), bit for bit across batch splits and thread counts, its errors, its use in
a compiled graph, and the compiled decode layer with and without it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_attention
from kernels.cpu_gemv import cpu_flags, isa
from tests.support.attention import SHAPES, case

if not {"avx2", "fma"} <= cpu_flags():
    pytest.skip("the operator needs AVX2 and FMA", allow_module_level=True)


@pytest.fixture(scope="module")
def op():
    cpu_attention.load()
    return torch.ops.mfs.decode_attention


@pytest.mark.parametrize("T,Hq,Hkv,D,lmax", SHAPES)
def test_matches_its_float64_reference(op, T, Hq, Hkv, D, lmax):
    args = case(T, Hq, Hkv, D, lmax)
    got = op(*args, D ** -0.5)
    want = cpu_attention.decode_attention_reference(*args, D ** -0.5)
    assert got.shape == (T, Hq, D)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


def test_large_scores_do_not_overflow_and_a_lone_position_is_its_value(op):
    q, kp, vp, flat, last, kn, vn = case(3, 9, 3, 64, 12, seed=2)
    q *= 300  # scores in the thousands: softmax must subtract the max
    torch.testing.assert_close(op(q, kp, vp, flat, last, kn, vn, 0.125),
                               cpu_attention.decode_attention_reference(q, kp, vp, flat, last, kn, vn, 0.125),
                               rtol=2e-5, atol=2e-5)
    last = torch.zeros(3, dtype=torch.long)  # only the new entry: the output is its value
    out = op(q, kp, vp, flat, last, kn, vn, 0.125)
    assert torch.equal(out, vn.repeat_interleave(3, dim=1))


def test_a_rows_output_is_the_same_bit_for_bit_at_any_batch_size_and_thread_count(op):
    q, kp, vp, flat, last, kn, vn = case(7, 9, 3, 64, 40, seed=1)
    full = op(q, kp, vp, flat, last, kn, vn, 0.125)
    for t in range(7):
        one = op(q[t:t + 1], kp, vp, flat[t * 40:(t + 1) * 40], last[t:t + 1], kn[t:t + 1], vn[t:t + 1], 0.125)
        assert torch.equal(one[0], full[t]), t
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(op(q, kp, vp, flat, last, kn, vn, 0.125), full)
    finally:
        torch.set_num_threads(before)


def test_empty_batch_and_non_contiguous_q(op):
    q, kp, vp, flat, last, kn, vn = case(0, 9, 3, 64, 5)
    assert op(q, kp, vp, flat, last, kn, vn, 0.125).shape == (0, 9, 64)
    q, kp, vp, flat, last, kn, vn = case(2, 9, 3, 64, 5)
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not qt.is_contiguous()
    assert torch.equal(op(qt, kp, vp, flat, last, kn, vn, 0.125), op(q, kp, vp, flat, last, kn, vn, 0.125))


@pytest.mark.parametrize("bad,match", [
    ("q_bf16", "q must be fp32"), ("heads", "query heads"), ("last", "outside"), ("slot", "outside the pool"),
    ("k_new", "k_new and v_new"), ("width", "multiple of 16"), ("flat", "flat must be int64")])
def test_bad_inputs_are_refused_with_a_message(op, bad, match):
    q, kp, vp, flat, last, kn, vn = case(2, 9, 3, 64, 6)
    if bad == "q_bf16":
        q = q.bfloat16()
    elif bad == "heads":
        q = torch.randn(2, 8, 64)
    elif bad == "last":
        last = torch.tensor([1, 6])
    elif bad == "slot":
        flat[0], last[0] = 10_000, 3
    elif bad == "k_new":
        kn = kn[:1]
    elif bad == "width":
        q, kp, vp, flat, last, kn, vn = case(2, 6, 3, 8, 6)
    elif bad == "flat":
        flat = flat.int()
    with pytest.raises(RuntimeError, match=match):
        op(q, kp, vp, flat, last, kn, vn, 0.125)


def test_it_traces_into_a_compiled_graph(op):
    args = case(3, 9, 3, 64, 11)
    f = torch.compile(lambda *a: op(*a, 0.125) * 2, fullgraph=True, dynamic=True)
    torch.testing.assert_close(f(*args), op(*args, 0.125) * 2)


def test_the_avx2_build_matches_the_reference_too(tmp_path):
    """On an AVX-512 machine the AVX2 form serves only shapes the 512-bit one is not built for; here the
    whole operator is built for AVX2 alone (MFS_CPU_GEMV_ISA=avx2) and checked in a fresh process."""
    if isa() == "avx2":
        pytest.skip("this process's build is the AVX2 one already")
    script = tmp_path / "check.py"
    script.write_text(
        "import torch, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from kernels import cpu_attention\n"
        "from tests.support.attention import SHAPES, case\n"
        "cpu_attention.load()\n"
        "for T, Hq, Hkv, D, lmax in SHAPES:\n"
        "    a = case(T, Hq, Hkv, D, lmax)\n"
        "    torch.testing.assert_close(torch.ops.mfs.decode_attention(*a, D ** -0.5),\n"
        "                               cpu_attention.decode_attention_reference(*a, D ** -0.5), rtol=2e-5, atol=2e-6)\n"
        "print('ok')\n")
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "MFS_CPU_GEMV_ISA": "avx2"}, cwd=root)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_the_kernel_choice_can_be_turned_off(monkeypatch, switch_env):
    monkeypatch.setattr(cpu_attention, "_choice", [])
    switch_env(MFS_CPU_ATTENTION="0")
    assert cpu_attention.decode_attention_kernel() is None
    monkeypatch.setattr(cpu_attention, "_choice", [])
    switch_env(MFS_CPU_ATTENTION=None)
    assert cpu_attention.decode_attention_kernel() is torch.ops.mfs.decode_attention
