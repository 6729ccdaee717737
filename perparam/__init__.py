"""perparam: per-parameter ZeRO-3 sharding over DTensor, in the style of PyTorch's FSDP2.

``fully_shard(module, mesh=...)`` turns each parameter, in place, into a sharded DTensor; forward and
backward hooks all-gather one group's parameters in one collective and reduce-scatter its gradients.
"""

from . import quant  # noqa: F401 (the quantizer registry at its documented path; registers "nf4")
from .api import ShardingError, fully_shard
from .clip import clip_grad_norm_
from .comm.collectives import CommCounter
from .comm.debug import CollectiveMismatchError, set_debug
from .comm.peers import PeerLostError
from .comm.timeouts import CollectiveTimeoutError
from .errors import CheckpointDamagedError, CheckpointError
from .invariant import InvariantError, InvariantUnits
from .module import (
    DeepcopyError,
    ShardedModule,
    StoredDtypeChangeError,
    UnshardedApplyError,
    UnshardHandle,
    register_forward_method,
)
from .offload import OffloadError
from .runtime.adopt import ReplacedParameterError, UnflattenableShardError
from .runtime.config import RuntimeConfig, configure
from .runtime.hooks import TransformError
from .runtime.param import ReplacedAfterShardingError
from .runtime.prefetch import PrefetchError
from .runtime.readers import UsedWhileShardedError
from .runtime.registration import ShardedTreeChangeError
from .runtime.state import StateError
from .runtime.writes import ShardDataAssignmentError
from .runtime.zero import UnseenShardWriteError
from .session import distributed_session
from .sharding.errors import MetaParameterError
from .sharding.policy import MixedPrecisionPolicy, OffloadPolicy, ParamPolicy, PolicyError, QuantPolicy

__all__ = [
    "CheckpointDamagedError",
    "CheckpointError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommCounter",
    "DeepcopyError",
    "InvariantError",
    "InvariantUnits",
    "MetaParameterError",
    "MixedPrecisionPolicy",
    "OffloadError",
    "OffloadPolicy",
    "ParamPolicy",
    "PeerLostError",
    "PolicyError",
    "PrefetchError",
    "QuantPolicy",
    "ReplacedAfterShardingError",
    "ReplacedParameterError",
    "RuntimeConfig",
    "ShardedModule",
    "ShardDataAssignmentError",
    "ShardedTreeChangeError",
    "ShardingError",
    "StateError",
    "StoredDtypeChangeError",
    "TransformError",
    "UnshardHandle",
    "UnflattenableShardError",
    "UnseenShardWriteError",
    "UnshardedApplyError",
    "UsedWhileShardedError",
    "clip_grad_norm_",
    "configure",
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
