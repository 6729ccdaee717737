"""``perparam.quant``: the quantizer protocol and registry, at their documented path.

The code lives in the pure floor (``perparam/sharding/quant.py``, NF4 in ``quant_nf4.py``); this module
re-exports what a user needs: ``register(name, quantizer)`` to add a ``BlockQuantizer`` that
``QuantPolicy(name)`` then uses, ``get(name_or_codes_dtype)`` and ``names()`` to look them up (``KeyError``
for an unknown name), and the block (de)quantization helpers.
"""

from __future__ import annotations

from .sharding.quant import (
    BlockQuantizer,
    Fp8Quantizer,
    Int8Quantizer,
    dequantize_blocks,
    get,
    names,
    quantize_blocks,
    register,
)
from .sharding.quant_nf4 import NF4Quantizer  # importing it registers "nf4"

__all__ = ["BlockQuantizer", "Fp8Quantizer", "Int8Quantizer", "NF4Quantizer", "dequantize_blocks", "get",
           "names", "quantize_blocks", "register"]
