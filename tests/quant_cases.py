"""Hypothesis cases shared by the quantizer tests: ``[rows, n]`` matrices with a block size, and each
element's block absmax."""

from __future__ import annotations

import torch
from hypothesis import strategies as st


@st.composite
def matrix_case(draw):
    """``[rows, n]`` values with a block size; often an all-zero block, an odd ``n`` or an empty matrix."""
    rows = draw(st.integers(0, 4))
    n = draw(st.integers(0, 150))
    block = draw(st.sampled_from([1, 3, 8, 64, 100]))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    seed = draw(st.integers(0, 2**16))
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * scale
    if rows and n and draw(st.booleans()):
        x[:, : min(n, block)] = 0.0  # an all-zero block
    return x, block


def block_amax(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each element's block absmax, ``[rows, n]``."""
    rows, n = x.shape
    nb = -(-n // block)
    padded = torch.zeros(rows, nb * block)
    padded[:, :n] = x.abs()
    return padded.view(rows, nb, block).amax(2).repeat_interleave(block, 1)[:, :n]
