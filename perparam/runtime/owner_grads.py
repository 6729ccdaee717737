"""Gradients reduced straight to their owner (``paths.reduce_owner``): which parameters' whole gradient an
owner holds between backward and the optimizer step."""

from __future__ import annotations

import torch


def at_owner(sp) -> bool:
    """``sp``'s current ``.grad`` came from a reduction to its owner (the same answer on every rank)."""
    return False


def whole(sp) -> torch.Tensor | None:
    """On ``sp``'s owner, the whole reduced gradient it holds (``None`` elsewhere, or when none is held)."""
    return None
