"""The face's error types: what ``fully_shard`` and the sharded module's methods raise for bad input
(defined on the sharding floor, ``perparam.sharding.errors``, so the runtime's refusals derive from it), and
the checkpoint family's (``CheckpointError``, ``CheckpointDamagedError``), which ``perparam.checkpoint``
and ``perparam.full_state`` share."""

from __future__ import annotations

from pathlib import Path

from .sharding.errors import ShardingError


class CheckpointError(RuntimeError):
    """A checkpoint or full state dict that cannot be saved or loaded; the message says what is wrong and
    what to do. (Its one home; ``perparam``, ``perparam.checkpoint`` and ``perparam.full_state`` re-export
    it.)"""


class CheckpointDamagedError(CheckpointError):
    """A checkpoint whose files are not what its save wrote: ``path`` (the checkpoint), ``file`` (the first
    damaged file's name) and ``what`` (missing, truncated, grown, changed in place, or a damaged manifest).
    Nothing was loaded; an older checkpoint may be intact (``perparam.checkpoint.latest`` /
    ``perparam finetune --resume`` take the newest intact one)."""

    def __init__(self, path: Path, file: str, what: str, more: int = 0) -> None:
        self.path, self.file, self.what = Path(path), file, what
        others = f" (and {more} more damaged file{'s' if more > 1 else ''})" if more else ""
        super().__init__(f"checkpoint {path} is damaged: {file} {what}{others}; nothing was loaded: load an "
                         "earlier checkpoint")


__all__ = ["CheckpointDamagedError", "CheckpointError", "ShardingError"]
