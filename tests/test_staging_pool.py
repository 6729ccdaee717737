"""``perparam.comm.staging.StagingPool``: the owner path's all-to-all buffers, reused across optimizer steps
(smallest idle buffer that fits, a view of its first bytes), bounded, never handed out twice."""

from __future__ import annotations

import pytest
import torch

from perparam.comm.staging import StagingPool

pytestmark = pytest.mark.fast
CPU = torch.device("cpu")


def test_a_given_back_buffer_is_reused_smallest_fit_as_a_view_of_its_first_bytes():
    pool = StagingPool()
    big, small = pool.take(100, torch.float32, CPU), pool.take(10, torch.float32, CPU)
    assert pool.allocations == 2 and big.shape == (100,) and big.dtype == torch.float32
    pool.give_back(big)
    pool.give_back(small)
    assert pool.idle_bytes() == 440
    got = pool.take(8, torch.float32, CPU)  # the 40-byte buffer fits, not the 400-byte one
    assert got.untyped_storage().data_ptr() == small.untyped_storage().data_ptr() and got.shape == (8,)
    other = pool.take(50, torch.bfloat16, CPU)  # any dtype: 100 bytes from the 400-byte buffer
    assert other.untyped_storage().data_ptr() == big.untyped_storage().data_ptr() and other.dtype == torch.bfloat16
    assert pool.allocations == 2 and pool.idle_bytes() == 0
    assert pool.take(1, torch.float32, CPU).untyped_storage().data_ptr() not in (
        big.untyped_storage().data_ptr(), small.untyped_storage().data_ptr())  # both in use: a new one
    assert pool.allocations == 3


def test_the_pool_keeps_at_most_max_idle_bytes_and_each_buffer_once():
    pool = StagingPool(max_idle_bytes=500)
    a, b = pool.take(100, torch.float32, CPU), pool.take(100, torch.float32, CPU)
    pool.give_back(a[:10])  # a view: its whole storage is kept
    pool.give_back(a)  # given back twice (a K = 1 exchange's receive buffer is its send buffer): kept once
    pool.give_back(b)  # beyond the bound: dropped
    assert pool.idle_bytes() == 400
    assert pool.take(0, torch.float32, CPU).numel() == 0 and pool.idle_bytes() == 400  # empty: no buffer spent
    pool.clear()
    assert pool.idle_bytes() == 0
