"""Every write to a sharded parameter is seen by the next forward, or refused
(``perparam/runtime/writes.py``).

The table (``tests/write_cases.py``): every way a user or a library writes parameter values (in-place DTensor
ops, ``torch._foreach_*``, ``.data =``, ``.data.mul_``, ``copy_``, ``torch.nn.init``, ``reset_parameters``,
``load_state_dict`` in place, ``set_model_state_dict``, foreach / fused / for-loop optimizer steps, an EMA
through ``torch._foreach_lerp_`` and ``torch.optim.swa_utils.AveragedModel``, writes into ``to_local()``
with and without ``mark_shards_written()``) against every way perparam keeps unsharded storage across it
(stage 3, stages 1 and 2, ``reshard_after_forward=False``, ``set_reshard_after_backward(False)``, kept
gathered for evaluation, the CPU offload tier). Each cell's next forward must equal one process's bitwise,
or the write be refused; whatever marks storage stale must be the same on every rank, an empty shard's
included (the fake-process-group property).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from tests.distributed import one_process, run_distributed
from tests.write_cases import HPZ, METHODS, MODES, REFUSED, cell, cells

TABLE = [(method, mode) for method in METHODS for mode in MODES]
#: the storage modes where a stale copy would be used if the write were missed (the forward after the write
#: must all-gather model[0]'s group again)
KEPT = {"stage1", "stage2", "kept_after_forward", "kept_after_backward", "eval_kept"}


def _check(table: list, world_size: int) -> None:
    ref = one_process(cells, table)
    got = run_distributed(cells, world_size, table, timeout=300)
    chunks = torch.arange(5).chunk(world_size)  # Linear(3, 5)'s rows over the ranks (torch.chunk's extents)
    rows_of_first = [len(chunks[r]) if r < len(chunks) else 0 for r in range(world_size)]
    for i, (method, mode) in enumerate(table):
        for rank in range(world_size):
            out = got[rank][i]
            if (method, mode) in REFUSED:
                if rows_of_first[rank]:
                    assert out == "UnseenShardWriteError", (method, mode, rank, out)
                continue
            assert not isinstance(out, str), (method, mode, rank, out)
            assert torch.equal(out, ref[i]), (method, mode, rank, (out - ref[i]).abs().max().item())


def test_every_write_to_a_sharded_parameter_is_seen_by_the_next_forward_or_refused():
    """The whole table on 2 ranks (uneven shards): bitwise one process's output, or refused."""
    _check(TABLE, 2)


@pytest.mark.fast
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_writes_are_seen_at_other_world_sizes_with_empty_shards(world_size):
    """Kept copies (stage 2, evaluation; on 4 ranks hpZ's rows kept after a forward) under the writes no
    version counter sees, on 1 rank and on 3-4 ranks (``Linear(5, 2)``'s 2 rows leave ranks 2-3 empty; over
    4 ranks ``Linear(3, 5)``'s rank 3 too)."""
    methods = ("foreach_mul_", "ema_foreach_lerp_", "data_full", "data_mul_", "reset_parameters",
               "adam_fused", "to_local")
    modes = ("stage2", "eval_kept", HPZ) if world_size == 4 else ("stage2", "eval_kept")
    _check([(method, mode) for method in methods for mode in modes], world_size)


def _issued(method: str, mode: str, world_size: int, rank: int):
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        return cell(rank, world_size, method, mode)
    finally:
        dist.destroy_process_group()


@pytest.mark.fast
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([c for c in TABLE if c not in REFUSED and c[0] != "set_model_state_dict"]),
       st.integers(2, 4))
def test_what_a_write_makes_stale_is_the_same_on_every_rank(case, world_size):
    """Each rank (one process per rank through torch's fake process group) issues the same collectives
    from the write to the end of the next forward, whatever its shard holds (ranks 2-3 hold none of
    ``Linear(5, 2)``; over 4 ranks rank 3 none of ``Linear(3, 5)``), and under kept storage that forward
    all-gathers the written parameters again instead of computing on the copy. (``set_model_state_dict``
    needs collectives that move data: the gloo tests cover it.)"""
    method, mode = case
    issued = [_issued(method, mode, world_size, rank) for rank in range(world_size)]
    assert all(not isinstance(out, str) for out, _ in issued), issued
    assert all(records == issued[0][1] for _, records in issued), issued
    if mode in KEPT:
        assert any(kind == "all_gather" for kind, _, _ in issued[0][1]), (case, issued[0][1])


def test_a_data_assignment_that_is_not_the_parameters_value_is_refused_naming_it():
    results = run_distributed(_refusals, 2)
    for messages in results:
        for message in messages:
            assert "'0.weight'" in message and "global shape [5, 3]" in message, message
        assert "this rank's shard shape" in messages[0] and "another shape" in messages[1]


def _refusals(rank: int, world_size: int) -> list[str]:
    import perparam

    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    perparam.fully_shard(model)
    w = model[0].weight
    messages = []
    for value in (torch.zeros(w.to_local().shape), torch.zeros(4, 3)):
        with pytest.raises(perparam.ShardDataAssignmentError) as e:
            w.data = value
        messages.append(str(e.value))
    assert w.shape == (5, 3) and model[0].weight is w
    return messages


class _Shard:
    """What ``runtime.zero``'s write tracking reads of a ``ShardedParam``: its local shard, kept storage."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.sharded = SimpleNamespace(_local_tensor=torch.zeros(3))
        self.aliases, self.aliases_lost, self.write_sig, self.kept = [], False, None, True

    def local_shard(self) -> torch.Tensor:
        return self.sharded._local_tensor


def test_a_local_shard_replaced_by_a_new_tensor_counts_as_written_even_at_the_freed_ones_address():
    """A shard replaced after the kept copy was gathered (``to_empty``, ``load_state_dict(assign=True)``) is
    a write: the new tensor, made as the old one is freed, takes its ``id()`` and has its version (0), which
    the baseline held, so the kept unsharded copy stayed in use."""
    from perparam.runtime import zero

    p = _Shard()
    zero.note_gathered([p])
    assert not zero.written(p)
    p.sharded._local_tensor = None  # the old shard freed
    p.sharded._local_tensor = torch.ones(3)  # its replacement
    assert zero.written(p)
