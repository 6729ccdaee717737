"""``SnapshotError``: a snapshot that cannot be taken or restored, with the reason and the fix in one line."""

from __future__ import annotations


class SnapshotError(RuntimeError):
    """An in-memory snapshot cannot be committed or restored (what cannot compose, no complete generation,
    a shard and its replica both lost).

    ``reason``: what is wrong without the advice on what to do (the message's first clause), for a caller
    that has a fix of its own to offer (``perparam finetune`` falls back to its ``--save`` checkpoint);
    ``lost``: True when snapshots exist but none can be restored (a lost shard, every header damaged)."""

    def __init__(self, message: str, reason: str | None = None, lost: bool = False) -> None:
        super().__init__(message)
        self.reason = reason or message
        self.lost = lost
