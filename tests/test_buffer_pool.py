"""The collectives' buffer pool (``perparam.comm.buffers``): bounded in bytes, only buffers glibc would map
anew (>= 32 MiB), and ``ParamGroup.pool_bytes()`` equal to what one unshard and one reduction of the group
take from it, on 2 and 3 ranks (the first, middle and last rank) with two reduce dtypes in one group."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import perparam
from perparam import ParamPolicy
from perparam.comm.buffers import BufferPool
from perparam.runtime.group import group_of
from tests.distributed import run_distributed


def test_pool_keeps_only_large_buffers_and_at_most_max_idle_bytes():
    pool = BufferPool(max_idle_bytes=100, min_bytes=10)
    small, a, b, c = (pool.take(n, torch.device("cpu")) for n in (9, 40, 40, 40))
    for buf in (small, a, b, c):
        pool.give_back(buf)
    assert pool.idle_bytes() == 80  # the 9-byte buffer is below min_bytes; the third 40 would pass 100
    again = pool.take(40, torch.device("cpu"))
    assert again.untyped_storage().data_ptr() in {a.untyped_storage().data_ptr(),
                                                  b.untyped_storage().data_ptr()}
    assert pool.idle_bytes() == 40
    pool.clear()
    assert pool.idle_bytes() == 0


class _Recording(BufferPool):
    def __init__(self) -> None:
        super().__init__(max_idle_bytes=None, min_bytes=0)
        self.taken: list[int] = []

    def take(self, nbytes, device):
        self.taken.append(nbytes)
        return super().take(nbytes, device)


ALGORITHMS = (("zero_copy", "zero_copy"), ("zero_copy", "all_to_all"), ("all_to_all", "all_to_all"))


def _taken_in_one_step(rank: int, world: int) -> list[tuple[int, int]]:
    # (all-gather, reduce-scatter): the zero-copy all-gather (the default on gloo) takes nothing from the
    # pool, the row all-gather its rows; the zero-copy reduce-scatter (the default) nothing for K = 2 and a
    # [K, n] staging buffer for K > 2, the packed one its [K, n] input (and for K > 2 its received pieces)
    result = []
    for gather, reduce in ALGORITHMS:
        previous = perparam.configure(gloo_all_gather=gather, gloo_reduce_scatter=reduce)
        result.append(_taken_with_the_configured_all_gather())
        perparam.configure(gloo_all_gather=previous.gloo_all_gather,
                           gloo_reduce_scatter=previous.gloo_reduce_scatter)
    return result


def _taken_with_the_configured_all_gather() -> tuple[int, int]:
    torch.manual_seed(0)
    # uneven rows: padding on 2 and 3 ranks
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    perparam.fully_shard(model, param_policy={"2.*": ParamPolicy(reduce_dtype=torch.float64)})
    x = torch.randn(4, 5)
    F.mse_loss(model(x), torch.zeros(4, 3)).backward()  # creates the root's context
    group = group_of(model)
    recording = _Recording()
    group.pool = recording
    model.zero_grad()
    F.mse_loss(model(x), torch.zeros(4, 3)).backward()  # the root: one all-gather, one reduction per dtype
    return sum(recording.taken), group.pool_bytes()


def test_pool_bytes_equal_the_buffers_one_unshard_and_one_reduction_take():
    for world in (2, 3):
        for (direct, direct_predicted), (packed, packed_predicted), (rows, rows_predicted) in run_distributed(
                _taken_in_one_step, world):
            assert direct == direct_predicted and packed == packed_predicted > direct
            assert rows == rows_predicted > packed
            assert (direct > 0) == (world > 2)  # K = 2: the zero-copy collectives take nothing


@pytest.mark.fast
def test_a_smallest_fit_pool_hands_out_an_exact_size_first_else_the_smallest_that_fits_as_a_view():
    """The owner path's pool (``smallest_fit``, every size): a scatter reuses a gather's larger buffer."""
    cpu = torch.device("cpu")
    pool = BufferPool(min_bytes=0, smallest_fit=True)
    big, small = pool.take(400, cpu), pool.take(40, cpu)
    assert pool.allocations == 2
    pool.give_back(big)
    pool.give_back(small)
    pool.give_back(small[:8])  # given back twice (a view of it): kept once
    assert pool.idle_bytes() == 440
    got = pool.take(32, cpu)  # the 40-byte buffer fits, not the 400-byte one
    assert got.untyped_storage().data_ptr() == small.untyped_storage().data_ptr() and got.numel() == 32
    exact = pool.take(400, cpu)
    assert exact.untyped_storage().data_ptr() == big.untyped_storage().data_ptr() and exact.numel() == 400
    assert pool.allocations == 2 and pool.idle_bytes() == 0
    assert pool.take(0, cpu).numel() == 0 and pool.allocations == 2  # empty: nothing allocated
    fresh = pool.take(4, cpu)
    assert fresh.untyped_storage().data_ptr() not in (big.untyped_storage().data_ptr(),
                                                      small.untyped_storage().data_ptr())
    assert pool.allocations == 3
    exact_only = BufferPool(min_bytes=0)
    exact_only.give_back(exact_only.take(400, cpu))
    exact_only.take(32, cpu)  # the group pools' behaviour: no fit, a new buffer
    assert exact_only.allocations == 2 and exact_only.idle_bytes() == 400


@pytest.mark.fast
@settings(max_examples=150, deadline=None)
@given(smallest_fit=st.booleans(), bound=st.one_of(st.none(), st.integers(0, 600)),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 200)), max_size=40))
def test_a_pool_never_hands_out_memory_in_use_and_keeps_its_bound(smallest_fit, bound, ops):
    """Any sequence of takes (``True``, n bytes) and give-backs (``False``, of the i-th live buffer): no two
    live buffers share bytes, each has the bytes asked for, and the idle bytes are what is idle, within the
    bound."""
    cpu = torch.device("cpu")
    pool = BufferPool(max_idle_bytes=bound, min_bytes=0, smallest_fit=smallest_fit)
    live = []
    for take, n in ops:
        if take:
            buf = pool.take(n, cpu)
            assert buf.numel() == n and buf.dtype == torch.uint8
            live.append(buf)
        elif live:
            pool.give_back(live.pop(n % len(live)))
        spans = sorted((b.data_ptr(), b.data_ptr() + b.numel()) for b in live if b.numel())
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), spans
        idle = [b for bufs in pool._idle.values() for b in bufs]
        assert pool.idle_bytes() == sum(b.numel() for b in idle)
        assert bound is None or pool.idle_bytes() <= bound
        assert not any(i.data_ptr() <= s < i.data_ptr() + i.numel() for i in idle for s, _ in spans)
