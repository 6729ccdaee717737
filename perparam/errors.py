"""The face's error type: what ``fully_shard`` and the sharded module's methods raise for bad input
(defined on the sharding floor, ``perparam.sharding.errors``, so the runtime's refusals derive from it)."""

from .sharding.errors import ShardingError

__all__ = ["ShardingError"]
