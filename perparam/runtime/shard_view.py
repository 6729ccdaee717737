"""ZeRO stages 1 and 2 at Table 7-2's P: the local shard as a view of the kept copy's own rows.

A stage-1/2 parameter keeps its unsharded copy (``ShardedParam._padded``: ``K * chunk`` rows in
``param_dtype``) on every rank across steps. Where that copy holds this rank's shard bit for bit
(``perparam.sharding.resolution.shard_in_kept``: ``Shard(0)``, stored dtype = compute dtype, no quantization,
no offload tier, stepped per shard, no tensor parallelism), the sharded DTensor's local tensor *is* the copy's
own rows: ``rows[r * chunk : r * chunk + rows_r]`` of the padded buffer, a view without storage of its own.
A rank then holds P for the parameter (the copy), not P + P/K (the copy and a separate shard).

* The optimizer's step writes the shard, i.e. the copy's own rows, in place; the other ranks' rows are
  refreshed by the all-gather that follows every step anyway (``runtime/zero.py``): the same collectives,
  the same bytes (each rank sends its shard, which is its own rows).
* Padding rows (the last shard's ``chunk - rows_r``, all of an empty shard's) lie outside every shard's view;
  an empty shard is a 0-row view.
* Version counters: the view is ``.data`` of the rows, so it has a counter of its own (the refresh writes the
  buffer through ``ShardedParam._padded_data``, which has another; autograd's saved tensors a third). The
  tensors ``state_dict()`` hands out for the shard are views of one more ``.data`` alias, ``_lend``, kept by
  the parameter: a write into any of them (``dcp.load``) bumps ``_lend``'s counter, readable after they died
  (``runtime.zero.lent``: one entry per parameter, whatever the number of calls).
* A rank-local write (into ``p.to_local()`` or a ``state_dict()`` tensor) can no longer be compared with the
  copy (it *is* the copy's own rows) and the other ranks' copies miss it: ``zero.check_unwritten`` refuses it
  whatever it wrote, naming ``model.mark_shards_written()``.

``link`` makes the view (at ``fully_shard``, and again before a refresh whenever the local tensor was
swapped: ``to_empty``, ``.to(device)``, a cast, ``load_state_dict(assign=True)`` on ``meta``, a tree
move); until then the shard has storage of its own, as every other parameter's. ``sp`` below: a
``perparam.runtime.param.ShardedParam`` (not imported: it imports this module).
"""

from __future__ import annotations

import torch

from ..sharding.resolution import shard_in_kept


def applies(sp) -> bool:
    """``sp``'s shard can be a view of its kept copy (see the module docstring)."""
    return sp.kept and shard_in_kept(sp.policy, sp.tp is not None)


def linked(sp) -> bool:
    """``sp``'s local shard is the view of its current kept copy's own rows."""
    view = sp._view
    return view is not None and sp.sharded._local_tensor is view and sp._view_of is sp._padded


def link(sp) -> bool:
    """Make ``sp``'s local shard the view of its kept copy's own rows (``applies`` only; idempotent; a shard
    on ``meta`` waits for its ``to_empty``): the buffer is made (or given its storage back), the shard's
    values copied into its own rows, the DTensor's local tensor replaced by the view, and the copy marked
    stale (the other ranks' rows are filled by the next all-gather). Returns whether it linked now."""
    if linked(sp) or sp._no_view is sp.policy:
        return False
    if not applies(sp):
        sp._no_view = sp.policy  # (asked again only for another policy: a cast makes a new one)
        return False
    local = sp.local_shard()
    if local.is_meta:
        return False
    sp.alloc()
    lay, rank = sp.layout, sp.shard_rank
    with torch.inference_mode(False), torch.no_grad():
        rows = sp._padded_data.view(lay.num_shards, lay.padded_local_numel)[rank]
        own = rows.narrow(0, 0, lay.local_numel(rank)).view(lay.local_shape(rank))
        if own.data_ptr() != local.data_ptr():
            own.copy_(local)
        view, lend = own.data, own.data  # counters of their own (see the module docstring)
    sp.sharded._local_tensor = view
    sp._view, sp._view_of, sp._lend = view, sp._padded, lend
    sp.kept_key = None
    # the old shard's aliases see another storage now
    sp.aliases, sp.aliases_lost, sp.write_sig = [], False, None
    return True


def lend(sp) -> torch.Tensor | None:
    """A tensor for a ``state_dict()`` value of ``sp``'s linked shard: a view of ``_lend`` (its writes bump
    ``_lend``'s counter); ``None`` when not linked."""
    if not linked(sp):
        return None
    return sp._lend.view_as(sp._lend)
