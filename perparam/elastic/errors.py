"""``SnapshotError``: a snapshot that cannot be taken or restored, with the reason and the fix in one line."""

from __future__ import annotations


class SnapshotError(RuntimeError):
    """An in-memory snapshot cannot be committed or restored (what cannot compose, no complete generation,
    a shard and its replica both lost)."""
