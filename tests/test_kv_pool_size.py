"""How many KV blocks a worker's pools get from its memory budget (worker/runner.py: ``blocks_within``):
one block id costs what the pools allocate per block, and the budget, a full-length request and the cap
bound the count."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("family", ["llama_family", "exit_family"])
def test_a_block_costs_what_the_pools_allocate_per_block(request, family):
    from worker.kv_tensors import SegmentedKVCache
    from worker.runner import ModelRunner, kv_geometry
    model = request.getfixturevalue(family).model
    kv = ModelRunner(model, [10] * model.num_segments, 4).kv
    allocated = sum(t.numel() * t.element_size() for t in kv.k + kv.v + kv.hid)
    assert allocated == 10 * SegmentedKVCache.block_bytes(*_with_block_size(kv_geometry(model), 4))
    assert allocated == 10 * sum(kv.bytes_per_block(s) for s in range(kv.num_segments))


def test_the_budget_sets_the_blocks_between_one_full_request_and_the_cap(llama_family):
    from worker.kv_tensors import SegmentedKVCache
    from worker.runner import blocks_within, kv_geometry
    model = llama_family.model
    per = SegmentedKVCache.block_bytes(*_with_block_size(kv_geometry(model), 4))
    assert blocks_within(model, 4, 37 * per + per // 2, 8, 1024) == 37  # what the budget holds
    assert blocks_within(model, 4, 37 * per, 401, 1024) == 101  # one 401-token request: 101 blocks of 4
    assert blocks_within(model, 4, 10**12, 8, 1024) == 1024  # the cap


def _with_block_size(geometry, block_size: int):
    layers, heads, dim, dtype, hidden = geometry
    return layers, block_size, heads, dim, dtype, hidden
