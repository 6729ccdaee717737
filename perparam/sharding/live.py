"""What a sharded module reports of its live state to the floors beside the runtime, declared here (the
lowest floor) so ``perparam.memory`` reads it without importing the runtime or naming its attributes."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ReportsKeptCopies(Protocol):
    """A module ``fully_shard`` sharded (``perparam.ShardedModule`` implements it)."""

    def _perparam_kept_unsharded(self) -> list[torch.Tensor]:
        """The unsharded buffers its group's stage-1/2 parameters keep across steps on this rank (padded,
        ``param_dtype``) whose storage is alive; the same tensors from every module of one group."""
        ...
