"""perparam's error type, on the lowest floor so every floor can derive from it (``perparam.errors``
re-exports it as the face's): what ``fully_shard`` and the sharded module's methods raise for bad input."""


class ShardingError(ValueError):
    """Raised by ``fully_shard`` (and ``ShardedModule`` setters) for input it cannot shard or apply; the
    message names the parameter, module or value and says what to do instead. The refusals of a change
    FSDP2 would accept derive from it and from the builtin type torch raises for that kind of change
    (``docs/fsdp2-differences.md``), so either ``except`` catches them."""


class MetaParameterError(ShardingError, RuntimeError):
    """A sharded parameter is still on the meta device at the first forward (lazy init) or optimizer step:
    a ``RuntimeError`` too, the type FSDP2 raises there."""
