"""perparam's runtime runs eagerly, also inside a region ``torch.compile`` traces.

``torch.compile`` of a sharded module (``module.compile()``, ``torch.compile(model)``) traces through the
module's forward hooks into perparam's runtime unless told not to. Traced, its bookkeeping becomes graph
code, and the storage changes of the persistent unsharded buffer (``untyped_storage().resize_``, the
refill copies) become in-place graph ops on that buffer, which the compiled graph's epilogue replays as
writes that bump the buffer's version counter, shared by the unsharded parameter views autograd saved in
forward: the first backward then fails ("modified by an inplace operation ... version 4; expected version
2"). Eagerly (the hooks' own code) neither the storage resize nor the writes through the buffer's ``.data``
alias move that counter.

``untraced(fn)`` makes ``fn`` a graph break that runs eagerly, as FSDP2's hooks do: every entry point of
the runtime (forward hooks, gradient hooks, the final callback, ``ShardedModule`` methods that unshard,
reshard or reset, the optimizer step hooks of ``perparam.runtime.optim``, so ``torch.compile(optimizer.step)``
compiles the optimizer's arithmetic and never perparam's bookkeeping) carries it. Outside a traced region it
costs one ``torch.compiler.is_compiling()`` call and imports nothing (``torch._dynamo`` is imported by
``torch.compile`` itself). Being every entry point, it is also where a collective that failed because a peer
is gone becomes ``perparam.PeerLostError`` (``perparam.comm.peers``), on the error path only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import MappingProxyType
from typing import TypeVar

import torch

from ..comm.peers import explain

_F = TypeVar("_F", bound=Callable)

#: what a runtime entry point is part of, for ``PeerLostError``'s message (by function name)
_PHASES = MappingProxyType({
    "pre_forward": "the forward", "post_forward": "the forward", "_pre_backward": "the backward",
    "_late_grad": "the backward", "_final_callback": "the end of the backward", "unshard": "unshard()",
    "wait": "unshard()'s wait", "reset": "reset()"})


def untraced(fn: _F) -> _F:
    """``fn`` run eagerly, never traced by ``torch.compile`` (a graph break where a traced region calls
    it)."""

    where = _PHASES.get(fn.__name__, "the optimizer step" if "hook" in fn.__name__ else fn.__name__)

    def eager(*args, **kwargs):
        try:  # (a try costs nothing while nothing is raised)
            return fn(*args, **kwargs)
        except RuntimeError as e:  # a collective whose peer is gone: PeerLostError
            lost = explain(e, where)
            if lost is None:
                raise
            raise lost from None

    # The frame Dynamo meets holds no try block: Dynamo cannot resume a graph break inside one, so it would
    # run such a frame as it stands and trace every frame called from it (the runtime's collectives with it).
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.compiler.is_compiling():
            return eager(*args, **kwargs)
        return torch._dynamo.disable(eager, recursive=True,
                                     reason="perparam runtime (eager)")(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def graph_holder(module: torch.nn.Module) -> bool:
    """``module`` is one of ``torch.compile``'s holders of a traced graph's tensors (Dynamo's
    ``FakeRootModule``, an ``fx.GraphModule``): it registers the parameters a compiled function reads
    (``torch.compile(optimizer.step)`` reads every parameter it steps) as references for the graph, not as
    a place of the model perparam would all-gather or reduce (``registration`` lets them through)."""
    cls = type(module)
    return (cls.__name__ == "FakeRootModule" and cls.__module__.startswith("torch._dynamo")) or isinstance(
        module, torch.fx.GraphModule)
