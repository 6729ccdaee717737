"""Offload per parameter: the ``"cpu"`` and ``"disk"`` tiers of ``OffloadPolicy`` (``docs/offload.md``).

``fully_shard(..., offload_policy=...)`` or ``ParamPolicy(offload=...)`` choose a tier per parameter;
``perparam.offload.tier`` moves the state. ``stats()`` reports this process's disk traffic.
"""

from ..sharding.policy import OffloadPolicy
from .mapped import STATS, OffloadError
from .tier import flush, offloaded_bytes, trim_heap


def stats() -> dict:
    """This process's disk-tier counters since the last ``reset_stats()``: ``bytes_fetched``,
    ``bytes_written`` (bytes), ``fetch_s`` (seconds the I/O thread spent reading ahead), ``evict_s``
    (writing back and dropping), ``wait_s`` (seconds the training thread waited for I/O: the part of
    ``fetch_s`` + ``evict_s`` that was not hidden)."""
    return STATS.as_dict()


def reset_stats() -> None:
    STATS.reset()


__all__ = ["OffloadError", "OffloadPolicy", "flush", "offloaded_bytes", "reset_stats", "stats", "trim_heap"]
