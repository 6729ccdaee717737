"""Where a training step's time goes, by category, from ``torch.profiler``'s CPU events (``profile_step.py
--categories``).

Each event's *self* time (its own, less its children's; torch.profiler measures wall time on the thread
that ran it, so on a loaded machine it includes time waiting for a core) goes to one category, so nothing
is counted twice:

* ``optimizer``: everything under ``Optimizer.step`` (AdamW's arithmetic and its DTensor dispatch);
* ``collectives``: c10d/gloo calls and waits (``c10d::``, ``gloo:``, ``record_param_comms``, ``wait``);
* ``copies``: moving bytes between tensors without arithmetic (``copy_``, ``split_with_sizes_copy``,
  ``_foreach_copy_``, ``_chunk_cat``, ``cat``, ``clone``, ``narrow_copy``, ``fill_``/``zero_``);
* ``allocation``: ``empty``, ``empty_strided``, ``resize_`` (page faults of fresh memory land here);
* ``compute``: every other ``aten::`` operator (matmuls, attention, norms, the reduce-scatter's sum).

What a step's wall time has beyond these (``rest``: Python, hooks, autograd bookkeeping) is the caller's
measured step time less their sum.
"""

from __future__ import annotations

from collections import defaultdict

CATEGORIES = ("compute", "copies", "collectives", "allocation", "optimizer")
_COLLECTIVE = ("c10d::", "gloo:", "record_param_comms", "wait", "all_to_all", "allreduce", "all_gather",
               "reduce_scatter")
_COPIES = ("aten::copy_", "aten::split_with_sizes_copy", "aten::_foreach_copy_", "aten::_chunk_cat", "aten::cat",
           "aten::clone", "aten::narrow_copy", "aten::fill_", "aten::zero_", "aten::_to_copy", "aten::index_select")
_ALLOC = ("aten::empty", "aten::empty_strided", "aten::resize_", "aten::empty_like", "aten::new_empty")


def category(name: str, under_optimizer: bool) -> str | None:
    """The category of an event named ``name`` (``None``: a range of our own or an unknown non-aten event,
    whose self time is left to ``untracked``)."""
    if "barrier" in name:  # the profiler's caller synchronises the ranks between steps
        return None
    if under_optimizer:
        return "optimizer"
    if any(k in name for k in _COLLECTIVE):
        return "collectives"
    if name in _COPIES or name.startswith("aten::_foreach_copy"):
        return "copies"
    if name in _ALLOC:
        return "allocation"
    return "compute" if name.startswith("aten::") else None


def _under_optimizer(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer.step"):
            return True
        event = event.cpu_parent
    return False


def categorize(events, steps: int) -> dict[str, dict]:
    """Per category: ``ms`` (self ms per step) and ``top`` (its five largest operators, ms per step),
    from ``prof.events()`` of ``steps`` profiled steps."""
    per: dict[str, dict[str, float]] = {c: defaultdict(float) for c in CATEGORIES}
    for e in events:
        c = category(e.name, _under_optimizer(e))
        if c is not None:
            per[c][e.name] += e.self_cpu_time_total / 1e3 / steps
    return {c: {"ms": sum(ops.values()), "top": sorted(ops.items(), key=lambda kv: -kv[1])[:5]}
            for c, ops in per.items()}
