"""The coordinator's staging pool: a buffer handed back is handed out again for the same shape and dtype."""

from __future__ import annotations

import torch

from dcp_storage.runtime import HostBufferPool


def test_a_staging_pool_hands_back_a_used_buffer_of_the_same_shape_within_its_bound() -> None:
    pool = HostBufferPool(torch.device("cpu"), max_bytes=64)
    first = pool.take((4, 2), torch.float32)  # 32 bytes
    assert first.shape == (4, 2) and first.dtype == torch.float32 and first.is_contiguous()
    pool.give_back(first)
    assert pool.take((4, 2), torch.float32) is first  # reused: no fresh pages to fault in
    assert pool.take((4, 2), torch.float32) is not first  # handed out already: a new one
    pool.give_back(first)
    assert pool.take((8,), torch.float32) is not first  # another shape
    assert pool.take((4, 2), torch.int32) is not first  # another dtype
    big = torch.empty(20, dtype=torch.float32)  # 80 bytes: over the bound, not kept
    pool.give_back(big)
    assert pool.take((20,), torch.float32) is not big
