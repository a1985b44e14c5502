"""Our CPU operators ``mfs::int8_gemv``, ``mfs::w4a8_gemv``, ``mfs::w4a8_tile_gemv``, ``mfs::int8_a8_gemv`` and ``mfs::int8_a8_tile_gemv`` (kernels/cpu_gemv.cpp): built with the
machine's compiler (for AVX-512 VNNI where the CPU has it, else AVX2), checked against float64
products, batch invariance bit for bit, their errors, and that an int8 model takes them where torch
reports AVX2 or AVX-512. Runs on any x86 CPU with AVX2 and FMA."""
from pathlib import Path

import pytest
import torch

from kernels import cpu_gemv

if not {"avx2", "fma"} <= cpu_gemv.cpu_flags():
    pytest.skip("the operator needs AVX2 and FMA", allow_module_level=True)


@pytest.fixture(scope="module")
def op():
    cpu_gemv.load()
    return torch.ops.mfs.int8_gemv


def _case(M, N, K, seed=0, scale_dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s = (torch.rand(N, generator=g) * 0.02 + 1e-3).to(scale_dtype)
    return x, q, s


# K: multiples of 32 (the model's), of 8 but not 32, and with a scalar tail; N: the model's and tiny
@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (2, 576, 1536), (3, 7, 600), (5, 13, 20), (16, 64, 44),
                                   (1, 1, 8), (4, 33, 100)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_matches_a_float64_product(op, M, N, K, scale_dtype):
    x, q, s = _case(M, N, K, scale_dtype=scale_dtype)
    got = op(x, q, s)
    want = x.double() @ q.double().t() * s.double()
    bound = 1e-6 * (x.abs().double() @ q.abs().double().t() * s.double()).max()  # fp32 rounding of |terms|
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert (got.double() - want).abs().max() <= bound


def test_a_rows_output_is_the_same_bit_for_bit_at_any_batch_size(op):
    x, q, s = _case(9, 300, 576, seed=1)
    full = op(x, q, s)
    for m in range(1, 9):
        parts = torch.cat([op(x[i:i + m], q, s) for i in range(0, 9, m)])
        assert torch.equal(parts, full), m


def test_threads_do_not_change_the_result(op):
    x, q, s = _case(3, 1000, 576, seed=2)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(x, q, s)
        torch.set_num_threads(2)
        two = op(x, q, s)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_empty_batch_and_non_contiguous_input(op):
    x, q, s = _case(4, 16, 64, seed=3)
    assert op(x[:0], q, s).shape == (0, 16)
    wide = torch.randn(4, 128)
    wide[:, ::2] = x
    assert torch.equal(op(wide[:, ::2], q, s), op(x, q, s))


@pytest.mark.parametrize("bad,match", [
    (lambda x, q, s: (x.double(), q, s), "x must be fp32"),
    (lambda x, q, s: (x, q.float(), s), "q must be contiguous int8"),
    (lambda x, q, s: (x, q.t(), s), "q must be contiguous int8|columns"),
    (lambda x, q, s: (x[:, :32], q, s), "columns"),
    (lambda x, q, s: (x, q, s[:3]), "scales must be"),
    (lambda x, q, s: (x, q, s.half()), "scales must be"),
])
def test_bad_inputs_are_refused_with_a_message(op, bad, match):
    with pytest.raises(RuntimeError, match=match):
        op(*bad(*_case(2, 16, 64)))


def test_it_traces_into_a_compiled_graph(op):
    x, q, s = _case(2, 40, 64, seed=4)
    f = torch.compile(lambda x: torch.relu(op(x, q, s)) + 1, dynamic=True)
    assert torch.equal(f(x), torch.relu(op(x, q, s)) + 1)


@pytest.mark.parametrize("capability,env,takes", [("AVX2", None, True), ("AVX512", None, True),
                                                  ("DEFAULT", None, False), ("AVX2", "0", False)])
def test_the_kernel_is_chosen_by_capability(monkeypatch, switch_env, capability, env, takes):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(cpu_gemv, "_choice", [])
    switch_env(MFS_CPU_GEMV=env)
    assert (cpu_gemv.int8_gemv_kernel() is torch.ops.mfs.int8_gemv) is takes


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("MFS_CACHE", str(tmp_path))
    src = tmp_path / "broken.cpp"
    src.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="failed on broken.cpp"):
        cpu_gemv.build(src)


def test_a_background_build_fills_the_cache_once_and_leaves_failures_to_the_loader(tmp_path, monkeypatch, switch_env):
    """build_in_background: the library in the cache when its thread ends, one thread per set of sources,
    none where the operators would not be loaded; a source that fails leaves the error to build()."""
    monkeypatch.setenv("MFS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_gemv, "_background", {})
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text("extern \"C\" int mfs_probe() { return 1; }\n")
    bad.write_text("this is not C++\n")
    t = cpu_gemv.build_in_background([good], "MFS_CPU_ROWS")
    assert cpu_gemv.build_in_background([good], "MFS_CPU_ROWS") is t
    t.join(120)
    assert list((tmp_path / "cache" / "kernels").glob("*/libmfs_cpu_gemv.so"))
    cpu_gemv.build_in_background([bad], "MFS_CPU_ROWS").join(120)  # no exception escapes the thread
    with pytest.raises(RuntimeError, match="failed on bad.cpp"):
        cpu_gemv.build(bad)
    switch_env(MFS_CPU_ROWS="0")
    assert cpu_gemv.build_in_background([tmp_path / "other.cpp"], "MFS_CPU_ROWS") is None
    switch_env(MFS_CPU_ROWS=None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert cpu_gemv.build_in_background([tmp_path / "other.cpp"], "MFS_CPU_ROWS") is None


def test_an_int8_linear_on_avx2_runs_it(monkeypatch):
    from worker.formats import Int8Linear
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(cpu_gemv, "_choice", [])
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(5))
    lin = Int8Linear.from_float(w, torch.randn(48))
    x = torch.randn(3, 2, 64)
    want = x.double() @ lin.dequantize().double().t() + lin.bias.double()
    got = lin(x)
    assert got.shape == (3, 2, 48)
    assert (got.double() - want).abs().max() < 1e-4
    assert torch.equal(got.reshape(6, 48), torch.ops.mfs.int8_gemv(x.reshape(6, 64), lin.qweight, lin.scales)
                       + lin.bias)


# ---- mfs::w4a8_gemv: Q4_1 weight blocks times activations quantized per 32 ----------------------
def _w4a8_case(M, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    u = torch.randint(0, 16, (N, K), generator=g)
    dm = torch.stack([torch.rand(N, K // 32, generator=g) * 0.02,
                      -torch.rand(N, K // 32, generator=g) * 0.1], -1).half()
    return x, u, cpu_gemv.pack_q4_rows(u), dm


def test_q4_rows_pack_in_q4_1_order():
    u = torch.arange(32).remainder(16).repeat(2, 2)  # [2, 64]
    p = cpu_gemv.pack_q4_rows(u)
    assert p.shape == (2, 32) and p.dtype == torch.uint8
    assert p[0, 0].item() == (0 | (0 << 4)) and p[0, 1].item() == (1 | (1 << 4))  # inputs j and j + 16
    assert torch.equal(cpu_gemv.unpack_q4_rows(p), u.to(torch.uint8))
    with pytest.raises(ValueError, match="K % 32"):
        cpu_gemv.pack_q4_rows(torch.zeros(2, 48, dtype=torch.long))


@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (2, 576, 1536), (3, 7, 64), (5, 13, 32), (16, 40, 96)])
def test_w4a8_matches_its_float64_reference_and_tracks_the_fp32_product(op, M, N, K):
    x, u, p, dm = _w4a8_case(M, N, K)
    got = torch.ops.mfs.w4a8_gemv(x, p, dm)
    want = cpu_gemv.w4a8_gemv_reference(x, p, dm)
    scale = want.abs().max()
    assert got.shape == (M, N) and (got - want).abs().max() <= 1e-6 * scale + 1e-7
    d, m = dm.double().unbind(-1)
    w = (u.double().view(N, K // 32, 32) * d[..., None] + m[..., None]).view(N, K)
    exact = x.double() @ w.t()  # the activations' 8-bit rounding is the only approximation:
    _, dx = cpu_gemv.quantize_activations_q8(x)  # each x moves by at most dx / 2 of its block
    half_step = (dx.double() / 2).repeat_interleave(32, dim=1)
    bound = half_step @ w.abs().t() * 1.001 + 1e-6
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("K", [576, 224])  # 18 blocks: groups of four and a pair left; 7: a short group of 3
def test_w4a8_activation_quantization_is_per_row_and_the_batch_changes_nothing(op, K):
    x, _, p, dm = _w4a8_case(13, 200, K, seed=1)
    x[3] *= 1000  # one loud row must not coarsen the others' quantization
    full = torch.ops.mfs.w4a8_gemv(x, p, dm)
    for m in range(1, 9):  # every rows-per-pass count the kernel has, and a pass split across calls
        parts = torch.cat([torch.ops.mfs.w4a8_gemv(x[i:i + m], p, dm) for i in range(0, 13, m)])
        assert torch.equal(parts, full), m


def test_w4a8_quantizes_activations_as_llama_cpp_q8_1(op):
    x = torch.tensor([[0.5, -1.0, 0.25] + [0.0] * 29, [0.0] * 32])
    xq, dx = cpu_gemv.quantize_activations_q8(x)
    assert dx[0, 0].item() == pytest.approx(1 / 127) and dx[1, 0].item() == 0
    assert xq[0, :3].tolist() == [64, -127, 32] and xq[1].abs().sum() == 0  # 63.5 rounds half to even


@pytest.mark.parametrize("bad,match", [
    (lambda x, p, dm: (x[:, :48], p, dm), "multiple of 32"),
    (lambda x, p, dm: (x, p.to(torch.int8), dm), "q must be contiguous uint8"),
    (lambda x, p, dm: (x, p, dm.float()), "dm must be contiguous fp16"),
    (lambda x, p, dm: (x, p[:, :16], dm), r"q must be contiguous uint8 \[N, K / 2\]"),
])
def test_w4a8_bad_inputs_are_refused_with_a_message(op, bad, match):
    x, _, p, dm = _w4a8_case(2, 16, 64)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mfs.w4a8_gemv(*bad(x, p, dm))


# ---- mfs::w4a8_tile_gemv: the same sum over weights interleaved 16 rows to a tile ------------------
def test_tiles_hold_the_same_bytes_16_rows_interleaved():
    x, u, p, dm = _w4a8_case(1, 32, 64)
    qt, dmt = cpu_gemv.tile_q4_rows(p, dm)
    assert qt.shape == (2, 2, 4, 16, 4) and dmt.shape == (2, 2, 2, 16) and dmt.dtype == torch.float16
    t, b, pp, j, i = 1, 1, 2, 5, 3  # row 16t + j's byte 4p + i of block b
    assert qt[t, b, pp, j, i] == p[16 * t + j, 16 * b + 4 * pp + i]
    assert dmt[t, b, 0, j] == dm[16 * t + j, b, 0] and dmt[t, b, 1, j] == dm[16 * t + j, b, 1]
    back = cpu_gemv.untile_q4_rows(qt, dmt)
    assert torch.equal(back[0], p) and torch.equal(back[1], dm)
    with pytest.raises(ValueError, match="N % 16"):
        cpu_gemv.tile_q4_rows(p[:24], dm[:24])
    with pytest.raises(ValueError, match=r"packed must be uint8 \[N, K / 2\]"):
        cpu_gemv.tile_q4_rows(p.to(torch.int8), dm)
    with pytest.raises(ValueError, match=r"packed must be uint8"):
        cpu_gemv.tile_q4_rows(p[:, :24], dm)
    with pytest.raises(ValueError, match=r"dm must be fp16 \[N, K / 32, 2\] = \[32, 2, 2\]"):
        cpu_gemv.tile_q4_rows(p, dm[:, :1])
    with pytest.raises(ValueError, match=r"dm must be fp16"):
        cpu_gemv.tile_q4_rows(p, dm.float())
    with pytest.raises(ValueError, match=r"q must be int8 \[N, K\]"):
        cpu_gemv.tile_int8_rows(p)


# N: one tile, the model's fused shapes; K: one block, 7 blocks, the model's 18 and 48; M: past the pass
@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (2, 576, 1536), (3, 16, 32), (6, 48, 224), (17, 3072, 576)])
def test_w4a8_tiles_match_the_float64_reference_and_the_row_operator(op, M, N, K):
    x, u, p, dm = _w4a8_case(M, N, K, seed=3)
    got = torch.ops.mfs.w4a8_tile_gemv(x, *cpu_gemv.tile_q4_rows(p, dm))
    want = cpu_gemv.w4a8_gemv_reference(x, p, dm)
    scale = want.abs().max()
    assert got.shape == (M, N) and (got - want).abs().max() <= 1e-6 * scale + 1e-7
    rows = torch.ops.mfs.w4a8_gemv(x, p, dm)  # the same sum in another order
    assert (got - rows).abs().max() <= 2e-6 * scale + 1e-7


def test_w4a8_tiles_quantize_each_row_alone_and_the_batch_changes_nothing(op):
    x, _, p, dm = _w4a8_case(19, 208, 576, seed=4)
    x[3] *= 1000
    qt, dmt = cpu_gemv.tile_q4_rows(p, dm)
    full = torch.ops.mfs.w4a8_tile_gemv(x, qt, dmt)
    for m in range(1, 11):  # every rows-per-pass count (up to 8 a pass), and a pass split across calls
        parts = torch.cat([torch.ops.mfs.w4a8_tile_gemv(x[i:i + m], qt, dmt) for i in range(0, 19, m)])
        assert torch.equal(parts, full), m
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(torch.ops.mfs.w4a8_tile_gemv(x, qt, dmt), full)  # the threads change nothing
    finally:
        torch.set_num_threads(threads)
    assert torch.ops.mfs.w4a8_tile_gemv(x[:0], qt, dmt).shape == (0, 208)


_TILE_AVX2 = """
import sys, torch
from kernels import cpu_gemv
cpu_gemv.load()
x, qt, dmt, ht, hs = torch.load(sys.argv[1])
torch.save((torch.ops.mfs.w4a8_tile_gemv(x, qt, dmt), torch.ops.mfs.int8_a8_tile_gemv(x, ht, hs)), sys.argv[2])
"""


@pytest.mark.skipif(not cpu_gemv.VNNI <= cpu_gemv.cpu_flags(), reason="one build only on a CPU without AVX-512 VNNI")
def test_the_tiles_avx2_and_vnni_builds_agree_bit_for_bit(op, tmp_path):
    import os
    import subprocess
    import sys
    x, u, _, dm = _w4a8_case(7, 96, 576, seed=5)
    # the AVX2 forms' 16-bit sums at their largest: every code 15 (w4a8: 8 * 2 * 15 * 127 = 30480) and
    # -128 / 127 (head: 2 * 128 * 127 = 32512) against rows whose every 8-bit value is +127 or -127
    x[1], x[2] = 0.5, -0.5
    u[:16], u[16:32] = 15, 0
    p = cpu_gemv.pack_q4_rows(u)
    qt, dmt = cpu_gemv.tile_q4_rows(p, dm)
    _, hq, hs = _case(7, 64, 576, seed=6)
    hq[0, :3] = -128
    hq[1], hq[2] = -128, 127
    ht = cpu_gemv.tile_int8_rows(hq)
    torch.save((x, qt, dmt, ht, hs), tmp_path / "in.pt")
    assert cpu_gemv.isa() == "avx512-vnni"  # else both sides would be the AVX2 build
    env = {**os.environ, "MFS_CPU_GEMV_ISA": "avx2"}
    subprocess.run([sys.executable, "-c", _TILE_AVX2, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, cwd=Path(__file__).parent.parent)
    w4a8, head = torch.load(tmp_path / "out.pt")
    assert torch.equal(w4a8, torch.ops.mfs.w4a8_tile_gemv(x, qt, dmt))
    assert torch.equal(head, torch.ops.mfs.int8_a8_tile_gemv(x, ht, hs))
    want = cpu_gemv.w4a8_gemv_reference(x, p, dm)  # and the extremes summed right, not only alike
    assert (w4a8 - want).abs().max() <= 1e-6 * want.abs().max() + 1e-7
    want = cpu_gemv.int8_a8_gemv_reference(x, hq, hs)
    assert (head - want).abs().max() <= 1e-6 * want.abs().max() + 1e-7


@pytest.mark.parametrize("bad,match", [
    (lambda x, q, d: (x[:, :48], q, d), "multiple of 32"),
    (lambda x, q, d: (x, q.to(torch.int8), d), "qt must be contiguous uint8"),
    (lambda x, q, d: (x, q[:, :1], d), r"qt must be contiguous uint8 \[N / 16, K / 32, 4, 16, 4\]"),
    (lambda x, q, d: (x, q, d.float()), "dmt must be contiguous fp16"),
    (lambda x, q, d: (x, q, d[:1]), r"dmt must be contiguous fp16 \[N / 16, K / 32, 2, 16\]"),
])
def test_w4a8_tiles_bad_inputs_are_refused_with_a_message(op, bad, match):
    x, _, p, dm = _w4a8_case(2, 32, 64)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mfs.w4a8_tile_gemv(*bad(x, *cpu_gemv.tile_q4_rows(p, dm)))


def test_w4a8_tiles_trace_into_a_compiled_graph(op):
    x, _, p, dm = _w4a8_case(3, 32, 64)
    qt, dmt = cpu_gemv.tile_q4_rows(p, dm)
    f = torch.compile(lambda a: torch.ops.mfs.w4a8_tile_gemv(a, qt, dmt) * 2, fullgraph=True)
    assert torch.equal(f(x), torch.ops.mfs.w4a8_tile_gemv(x, qt, dmt) * 2)


# ---- mfs::int8_a8_gemv: int8 weights (a scale per row) times activations quantized per 32 ------------
# K: one block, an odd number (a lone last block), the model's 576 (18), wide; M: below, at and past
# the 4-row register block
@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (2, 33, 32), (3, 7, 96), (5, 13, 160), (16, 40, 1536),
                                   (9, 100, 576)])
def test_int8_a8_matches_its_float64_reference_and_tracks_the_fp32_product(op, M, N, K):
    x, q, s = _case(M, N, K, seed=6)
    q[0, :5] = -128  # the full int8 range, though our heads hold -127..127
    got = torch.ops.mfs.int8_a8_gemv(x, q, s)
    want = cpu_gemv.int8_a8_gemv_reference(x, q, s)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert (got - want).abs().max() <= 1e-6 * want.abs().max() + 1e-7
    exact = x.double() @ q.double().t() * s.double()  # the activations' 8-bit rounding is the only approximation
    _, dx = cpu_gemv.quantize_activations_q8(x)
    half_step = (dx.double() / 2).repeat_interleave(32, dim=1)
    bound = (half_step @ q.abs().double().t()) * s.double() * 1.001 + 1e-6
    assert ((got.double() - exact).abs() <= bound).all()


def test_int8_a8_rows_are_quantized_alone_and_the_batch_changes_nothing(op):
    x, q, s = _case(11, 300, 576, seed=7)
    x[3] *= 1000  # one loud row must not coarsen the others' quantization
    full = torch.ops.mfs.int8_a8_gemv(x, q, s)
    for m in (1, 2, 3, 4, 5):
        parts = torch.cat([torch.ops.mfs.int8_a8_gemv(x[i:i + m], q, s) for i in range(0, 11, m)])
        assert torch.equal(parts, full), m
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.mfs.int8_a8_gemv(x, q, s), full)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bad,match", [
    (lambda x, q, s: (x[:, :48], q[:, :48].contiguous(), s), "multiple of 32"),
    (lambda x, q, s: (x.double(), q, s), "x must be fp32"),
    (lambda x, q, s: (x, q.to(torch.uint8), s), "q must be contiguous int8"),
    (lambda x, q, s: (x, q[:, :32].contiguous(), s), r"q must be contiguous int8 \[N, K\]"),
    (lambda x, q, s: (x, q, s.half()), "scales must be"),
])
def test_int8_a8_bad_inputs_are_refused_with_a_message(op, bad, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mfs.int8_a8_gemv(*bad(*_case(2, 16, 64)))


def test_int8_a8_traces_into_a_compiled_graph_and_empty_batches(op):
    x, q, s = _case(3, 40, 64, seed=8)
    f = torch.compile(lambda x: torch.ops.mfs.int8_a8_gemv(x, q, s) * 2, dynamic=True)
    assert torch.equal(f(x), torch.ops.mfs.int8_a8_gemv(x, q, s) * 2)
    assert torch.ops.mfs.int8_a8_gemv(x[:0], q, s).shape == (0, 40)


@pytest.mark.parametrize("M,N,K", [(1, 960, 576), (2, 32, 32), (9, 48, 96), (17, 160, 1536)])
def test_int8_a8_tiles_match_the_float64_reference_and_the_batch_changes_nothing(op, M, N, K):
    x, q, s = _case(M, N, K, seed=7)
    q[0, :5] = -128  # the full int8 range: q + 128 and |q| both hold it
    qt = cpu_gemv.tile_int8_rows(q)
    assert qt.shape == (N // 16, K // 32, 8, 16, 4) and torch.equal(cpu_gemv.untile_int8_rows(qt), q)
    assert qt[0, K // 32 - 1, 7, 3, 2] == q[3, K - 32 + 30]  # row 16t + j's input 32b + 4c + i
    got = torch.ops.mfs.int8_a8_tile_gemv(x, qt, s)
    want = cpu_gemv.int8_a8_gemv_reference(x, q, s)
    assert got.shape == (M, N) and (got - want).abs().max() <= 1e-6 * want.abs().max() + 1e-7
    for m in range(1, 10):  # every rows-per-pass count of both builds (8 and 2), a pass split across calls
        assert torch.equal(torch.cat([torch.ops.mfs.int8_a8_tile_gemv(x[i:i + m], qt, s) for i in range(0, M, m)]),
                           got), m
    assert torch.ops.mfs.int8_a8_tile_gemv(x[:0], qt, s).shape == (0, N)
    with pytest.raises(ValueError, match="N % 16"):
        cpu_gemv.tile_int8_rows(q[:8])


@pytest.mark.parametrize("bad,match", [
    (lambda x, q, s: (x[:, :48], q, s), "multiple of 32"),
    (lambda x, q, s: (x, q.view(torch.uint8), s), "qt must be contiguous int8"),
    (lambda x, q, s: (x, q[:, :1], s), r"qt must be contiguous int8 \[N / 16, K / 32, 8, 16, 4\]"),
    (lambda x, q, s: (x, q, s[:16]), r"scales must be fp32 or bf16 \[N\]"),
])
def test_int8_a8_tiles_bad_inputs_are_refused_with_a_message(op, bad, match):
    x, q, s = _case(2, 32, 64)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.mfs.int8_a8_tile_gemv(*bad(x, cpu_gemv.tile_int8_rows(q), s))


def test_the_w4a8_head_runs_int8_a8():
    from worker.formats import Int8A8Linear
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(9))
    lin = Int8A8Linear.from_float(w, torch.randn(48))
    x = torch.randn(3, 2, 64)
    got = lin(x)
    assert got.shape == (3, 2, 48)
    assert lin.tiled  # 48 rows: three tiles of 16
    assert torch.equal(got.reshape(6, 48), torch.ops.mfs.int8_a8_tile_gemv(x.reshape(6, 64), lin.qweight, lin.scales)
                       + lin.bias)
    want = x.double() @ lin.dequantize().double().t() + lin.bias.double()
    assert (got.double() - want).abs().max() < 0.02 * want.abs().max()
    rows = Int8A8Linear.from_float(w[:40], lin.bias[:40])  # 40 rows: the row layout and mfs::int8_a8_gemv
    assert not rows.tiled and torch.equal(rows.dequantize(), lin.dequantize()[:40])
    assert torch.equal(rows(x).reshape(6, 40), torch.ops.mfs.int8_a8_gemv(x.reshape(6, 64), rows.qweight, rows.scales)
                       + rows.bias)
    with pytest.raises(ValueError, match="per 32 inputs"):
        Int8A8Linear.from_float(torch.randn(8, 40))


def test_build_takes_a_folder_of_sources_as_the_probes_pass_it(tmp_path):
    """`cpu_gemv.build(folder)` builds the folder's cpu_gemv*.cpp (the A/B probes pass an older
    checkout's kernels/); an empty folder is refused."""
    from pathlib import Path  # noqa: PLC0415
    from kernels import cpu_gemv  # noqa: PLC0415
    assert cpu_gemv.build(Path(cpu_gemv.__file__).parent) == cpu_gemv.build()
    with pytest.raises(ValueError, match="no cpu_gemv"):
        cpu_gemv.build(tmp_path)
