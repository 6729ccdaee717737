"""Where a training step's CPU time goes, per phase and category (``profile_step.py --categories``).

One ``cProfile.Profile(time.thread_time)`` per phase (forward with ``zero_grad``, backward, optimizer):
the profiled thread's *CPU* time, so a loaded machine (time spent waiting for a core) does not inflate
it. Each function's own time (``tottime``) goes to one category, so nothing is counted twice:

* ``compute``: torch's built-in calls that compute (``linear``, the autograd engine's C++ backward
  ``run_backward``, attention, norms, AdamW's arithmetic, the reduce-scatter's sum);
* ``copies``: built-ins that move bytes without arithmetic (``copy_``, ``split_with_sizes_copy``,
  ``_foreach_copy_``, ``_chunk_cat``, ``cat``, ``clone``, ``zero_``/``fill_``);
* ``allocation``: ``empty``, ``zeros``, ``resize_``, ... (page faults of fresh memory land here);
* ``collectives``: c10d calls and waits (what the main thread spends issuing and waiting on them; the
  gloo threads' own CPU is ``other threads``);
* ``python: <where>``: Python functions' own time by package (perparam, FSDP2, DTensor, DDP, torch.optim,
  the rest of torch and the model), and Python's own built-ins (``isinstance``, ``getattr``, ...).

``other threads`` (gloo's transfers, the autograd engine's helpers) is the process CPU time of the phase
less the profiled thread's.
"""

from __future__ import annotations

import pstats
from collections import defaultdict

PHASES = ("forward", "backward", "optimizer")
_COLLECTIVE = ("c10d", "alltoall", "all_to_all", "allgather", "all_gather", "reduce_scatter", "allreduce",
               "'wait' of", "broadcast")
_COPIES = ("copy_", "split_with_sizes_copy", "_chunk_cat", "'cat'", ".cat>", "clone", "narrow_copy", "zero_",
           "fill_", "contiguous")
_ALLOC = ("empty", "zeros", "resize_", "new_empty", "new_zeros")
_PYTHON = (("/perparam/", "python: perparam"), ("/fsdp/", "python: FSDP2"),
           ("/distributed/tensor/", "python: DTensor"), ("/nn/parallel/", "python: DDP"),
           ("/optim/", "python: torch.optim"))


def category(filename: str, funcname: str) -> str:
    """The category of one profiled function (``pstats`` key parts)."""
    if filename == "~" and "torch" not in funcname:  # isinstance, getattr, list.append, ...
        return "python: builtins"
    if filename == "~":  # a built-in torch function: what it does
        if any(k in funcname for k in _COLLECTIVE):
            return "collectives"
        if any(k in funcname for k in _COPIES):
            return "copies"
        if any(k in funcname for k in _ALLOC):
            return "allocation"
        return "compute"
    for part, name in _PYTHON:
        if part in filename:
            return name
    return "python: other"


def _short(funcname: str) -> str:
    """``<built-in method torch._C._nn.linear>`` -> ``linear``, ``<method 'copy_' of '...' objects>`` ->
    ``copy_``."""
    if funcname.startswith("<method '"):
        return funcname.split("'")[1]
    return funcname.strip("<>").rsplit(" ", 1)[-1].rsplit(".", 1)[-1]


def categorize(profile, steps: int) -> dict[str, dict]:
    """Per category of one phase's ``cProfile.Profile``: ``ms`` (CPU ms per step) and ``top`` (its three
    largest functions, ms per step)."""
    per: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    stats = pstats.Stats(profile).stats
    for (filename, _line, funcname), (_cc, _nc, tottime, _ct, _callers) in stats.items():
        label = _short(funcname) if filename == "~" else f"{filename.rsplit('/', 1)[-1]}:{funcname}"
        per[category(filename, funcname)][label] += tottime * 1e3 / steps
    return {c: {"ms": sum(ops.values()), "top": sorted(ops.items(), key=lambda kv: -kv[1])[:3]}
            for c, ops in sorted(per.items(), key=lambda kv: -sum(kv[1].values()))}


def render(phases: dict[str, dict], process_ms: dict[str, float]) -> str:
    """Lines per phase: its process CPU ms per step, each category, then ``other threads``."""
    lines = []
    for phase in PHASES:
        cats = phases[phase]
        lines.append(f"  {phase}: {process_ms[phase]:.0f} ms CPU per step (process)")
        for name, c in cats.items():
            top = ", ".join(f"{op} {ms:.0f}" for op, ms in c["top"])
            lines.append(f"    {name:<22}{c['ms']:>7.0f}  ({top})")
        other = process_ms[phase] - sum(c["ms"] for c in cats.values())
        lines.append(f"    {'other threads':<22}{other:>7.0f}")
    return "\n".join(lines)
