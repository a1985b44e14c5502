"""kernels/cpu_rows.py: the per-row operators match the torch references, and a row's values are the
same bits whatever rows share its call."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_rows
from kernels.paged_attention import paged_attention_torch
from kernels.rmsnorm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.rotary import build_cos_sin_cache, rotary_torch

pytestmark = pytest.mark.skipif(not cpu_rows.rows_kernel(), reason="the per-row operators do not build here")


@pytest.mark.parametrize("H", [64, 576, 13])
def test_norms_match_torch_and_a_row_is_the_same_in_any_batch(H):
    g = torch.Generator().manual_seed(H)
    x, r, w = torch.randn(9, H, generator=g), torch.randn(9, H, generator=g), torch.randn(H, generator=g)
    torch.testing.assert_close(cpu_rows.rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
    (y, s), (y0, s0) = cpu_rows.fused_add_rms_norm(x, r, w, 1e-5), fused_add_rms_norm_torch(x, r, w, 1e-5)
    torch.testing.assert_close(y, y0)
    assert torch.equal(s, s0)
    for i in (0, 4, 8):
        assert torch.equal(cpu_rows.fused_add_rms_norm(x[i:i + 1], r[i:i + 1], w, 1e-5)[0], y[i:i + 1])
    assert cpu_rows.fused_add_rms_norm(x, None, w, 1e-5)[1] is x


def test_silu_mul_and_rotary_match_torch():
    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(7, 200, generator=g) * 8).chunk(2, dim=-1)  # strided halves, as the MLP's
    torch.testing.assert_close(cpu_rows.silu_mul(gate, up), F.silu(gate) * up)
    cs = build_cos_sin_cache(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)), 100)
    q, k = torch.randn(6, 9, 64, generator=g), torch.randn(6, 3, 64, generator=g)
    pos = torch.randint(0, 100, (6,), generator=g)
    for a, b in zip(cpu_rows.rotary(q, k, pos, cs), rotary_torch(q, k, pos, cs)):
        torch.testing.assert_close(a, b)


def _pool(g, ctx: list[int], bs: int = 4, hkv: int = 2, d: int = 16):
    blocks = [(c + bs - 1) // bs for c in ctx]
    nb = sum(blocks) + 1
    kc, vc = torch.randn(nb, bs, hkv, d, generator=g), torch.randn(nb, bs, hkv, d, generator=g)
    perm = torch.randperm(nb - 1, generator=g) + 1
    bt = torch.zeros(len(ctx), max(blocks), dtype=torch.long)
    at = 0
    for r, n in enumerate(blocks):
        bt[r, :n] = perm[at:at + n]
        at += n
    return kc, vc, bt


def test_attention_matches_sdpa_and_a_query_is_the_same_alone_or_in_any_step():
    """Decode rows, a verification row and a prefill chunk together; each query equals the same query
    attended in a step of its own."""
    g = torch.Generator().manual_seed(2)
    q_lens, ctx = [1, 5, 1, 12], [9, 14, 3, 12]
    kc, vc, bt = _pool(g, ctx)
    q = torch.randn(sum(q_lens), 4, 16, generator=g)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    args = (q, kc, vc, bt, qsl, torch.tensor(ctx), 0.25)
    got = cpu_rows.paged_attention(*args)
    torch.testing.assert_close(got, paged_attention_torch(*args), atol=1e-5, rtol=1e-5)
    for r in range(len(ctx)):
        a, b = int(qsl[r]), int(qsl[r + 1])
        for i in range(a, b):  # query i alone: a decode row whose context ends at its position
            pos = ctx[r] - (b - i)
            one = cpu_rows.paged_attention(q[i:i + 1], kc, vc, bt[r:r + 1], torch.tensor([0, 1]),
                                           torch.tensor([pos + 1]), 0.25)
            assert torch.equal(one, got[i:i + 1]), (r, i)


def test_opting_out_serves_the_torch_references(switch_env):
    switch_env(MFS_NONDETERMINISTIC="1")
    x, w = torch.randn(3, 64), torch.randn(64)
    assert torch.equal(cpu_rows.rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5))
