"""The runtime's switches, as one frozen ``RuntimeConfig`` set through ``perparam.configure``.

No other module-level variable of perparam changes how it runs. ``configure`` replaces the process's
config (it is read at every unshard and reduction, so it applies from the next collective on) and
returns the previous one, so a benchmark or a test can restore it::

    previous = perparam.configure(prefetch=False)
    ...
    perparam.configure(**dataclasses.asdict(previous))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

#: how a gloo collective on CPU runs: "all_to_all" (perparam's: the same bytes, no flat staging buffer)
#: or "native" (``dist.all_gather_single`` / ``dist.reduce_scatter_single``)
GLOO_ALGORITHMS = ("all_to_all", "native")
#: the all-gather's further choice: "zero_copy" (per parameter, point-to-point sends and receives straight
#: into the unsharded buffers: no copy-out; ``perparam.runtime.paths.gather_zero_copy``)
GLOO_ALL_GATHER_ALGORITHMS = (*GLOO_ALGORITHMS, "zero_copy")
#: the reduce-scatter's: "zero_copy" (per parameter, point-to-point sends straight from the unsharded
#: gradients: no packing; ``perparam.runtime.paths.reduce_zero_copy``)
GLOO_REDUCE_SCATTER_ALGORITHMS = (*GLOO_ALGORITHMS, "zero_copy")
#: where the gradient of a ``ParamPolicy(update="owner")`` parameter goes after backward: "rows"
#: (reduce-scattered as every parameter's; its rows travel to the owner at the step) or "owner" (reduced
#: straight to its owner, ``paths.reduce_owner``)
OWNER_GRADS = ("rows", "owner")


@dataclass(frozen=True)
class RuntimeConfig:
    """``prefetch``: issue the all-gather of the group expected next (forward and backward) before
    computing this one. ``gloo_all_gather`` / ``gloo_reduce_scatter``: how those collectives run on gloo
    on CPU, ``"all_to_all"`` (one all-to-all of the same bytes, less CPU per call than gloo's own),
    ``"native"`` (gloo's own) or ``"zero_copy"``, the default of both: the all-gather's per-parameter sends
    and receives into the unsharded buffers, no copy-out, the reduce-scatter's per-parameter sends straight
    from the unsharded gradients, no packing (their CPU against the all-to-all's: the benchmarks
    ``gather_step`` and ``reduce_step`` in ``benchmarks/README.md``); a collective zero-copy cannot take
    (quantized pieces or gradients,
    ``Shard(d > 0)``, TP, hpZ, a custom collective) runs as ``"all_to_all"``. Other backends always run the
    native ones.
    ``local_optimizer_step``: ``torch.optim.SGD``/``Adam``/``AdamW`` steps on perparam parameters run on
    their local shards, without DTensor dispatch (bitwise the same update; ``perparam.runtime.local_step``).
    ``gather_read_ahead``: how many groups ahead (in the direction the all-gathers go) a disk-tier group's
    all-gather starts the shard reads (``perparam.offload.tier``): the runtime prefetches one group ahead,
    so 2 keeps a read in flight behind each prefetch; 0: none (the kernel reads the pages when the
    all-gather packs them).
    ``owner_grad``: ``"rows"`` (an ``update="owner"`` parameter's gradient is reduce-scattered, every rank
    holds its rows, which travel to the owner at the step: ``3 (K-1)/K m n`` elements per matrix beside
    the reduction) or ``"owner"`` (reduced straight to its owner, whole there and nowhere else, the same
    bytes as the reduce-scatter: ``2 (K-1)/K m n`` beside it; between backward and the step the other
    ranks' ``.grad`` of it holds NaN, ``perparam.clip_grad_norm_`` counts the owner's whole gradient;
    ``docs/whole-matrix-optimizers.md``). Read at each reduction once the optimizer's owners are planned
    (its first step: that step's gradients are reduce-scattered).

    Raises ``ValueError`` naming the field for a value outside these."""

    prefetch: bool = True
    gloo_all_gather: str = "zero_copy"
    gloo_reduce_scatter: str = "zero_copy"
    local_optimizer_step: bool = True
    gather_read_ahead: int = 2
    owner_grad: str = "rows"

    def __post_init__(self) -> None:
        for name in ("prefetch", "local_optimizer_step"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"perparam.configure: {name} must be True or False, got "
                                 f"{getattr(self, name)!r}")
        ahead = self.gather_read_ahead
        if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
            raise ValueError(f"perparam.configure: gather_read_ahead must be an int >= 0, got {ahead!r}")
        for name, allowed in (("gloo_all_gather", GLOO_ALL_GATHER_ALGORITHMS),
                              ("gloo_reduce_scatter", GLOO_REDUCE_SCATTER_ALGORITHMS),
                              ("owner_grad", OWNER_GRADS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"perparam.configure: {name} must be one of {allowed}, got {value!r}")


_current = RuntimeConfig()


def current() -> RuntimeConfig:
    """The config the runtime reads now."""
    return _current


def configure(**changes) -> RuntimeConfig:
    """Change the runtime's switches (fields of ``RuntimeConfig``) for the whole process, from the next
    collective on; returns the previous config. ``configure()`` changes nothing and returns the current one.

    Raises ``TypeError`` for an unknown field and ``ValueError`` for a bad value, before changing anything.
    """
    global _current
    fields = {f.name for f in dataclasses.fields(RuntimeConfig)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"perparam.configure: unknown setting(s) {unknown}; the settings are "
                        f"{sorted(fields)}")
    previous = _current
    _current = dataclasses.replace(_current, **changes)
    return previous
