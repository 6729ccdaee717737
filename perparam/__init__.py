"""perparam: per-parameter ZeRO-3 sharding over DTensor, in the style of PyTorch's FSDP2.

``fully_shard(module, mesh=...)`` turns each parameter, in place, into a sharded DTensor; forward and
backward hooks all-gather one group's parameters in one collective and reduce-scatter its gradients.
"""

from . import quant_nf4  # noqa: F401 (registers the "nf4" quantizer)
from .api import ShardingError, fully_shard
from .clip import clip_grad_norm_
from .collectives import CommCounter
from .debug import CollectiveMismatchError, set_debug
from .module import (
    ShardedModule,
    StoredDtypeChangeError,
    UnshardedApplyError,
    UnshardHandle,
    register_forward_method,
)
from .policy import MixedPrecisionPolicy, ParamPolicy, QuantPolicy
from .readers import UsedWhileShardedError
from .registration import ShardedTreeChangeError
from .session import distributed_session

__all__ = [
    "CollectiveMismatchError",
    "CommCounter",
    "MixedPrecisionPolicy",
    "ParamPolicy",
    "QuantPolicy",
    "ShardedModule",
    "ShardedTreeChangeError",
    "ShardingError",
    "StoredDtypeChangeError",
    "UnshardHandle",
    "UnshardedApplyError",
    "UsedWhileShardedError",
    "clip_grad_norm_",
    "distributed_session",
    "fully_shard",
    "register_forward_method",
    "set_debug",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``perparam.checkpoint`` and ``perparam.full_state`` after a bare ``import perparam`` (imported on
    first use: they pull in torch's distributed checkpoint)."""
    if name in ("checkpoint", "full_state"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
