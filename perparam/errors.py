"""The face's error type: what ``fully_shard`` and the sharded module's methods raise for bad input."""


class ShardingError(ValueError):
    """Raised by ``fully_shard`` (and ``ShardedModule`` setters) for input it cannot shard or apply; the
    message names the parameter, module or value and says what to do instead."""
