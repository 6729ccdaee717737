"""Counting ``torch.distributed`` collective calls from Python (FSDP2's bytes; a cross-check for perparam).

Byte convention (per rank, as ``perparam.CommCounter``): an all-gather counts its gathered output, a
reduce-scatter its input, an all-reduce or broadcast its tensor. perparam's reduce-scatter on gloo is an
``all_to_all_single`` of the reduce-scatter's input (``perparam.collectives``), counted as a reduce-scatter.
"""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist


class DistCounter:
    """Wraps the ``torch.distributed`` collective functions; counts calls and bytes while ``active``."""

    _OUTPUT_BYTES = ("all_gather_single", "all_gather_into_tensor")  # gathered output: first argument
    _INPUT_BYTES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single")  # input: second
    _TENSOR_BYTES = ("all_reduce", "broadcast")

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        for name in self._OUTPUT_BYTES + self._INPUT_BYTES + self._TENSOR_BYTES:
            fn = getattr(dist, name)
            setattr(dist, name, self._wrap(name, getattr(fn, "__wrapped_by_counter__", fn)))

    def _wrap(self, name: str, fn):
        kind = ("all_gather" if name in self._OUTPUT_BYTES else
                "reduce_scatter" if name in self._INPUT_BYTES else name)

        def wrapper(*args, **kwargs):
            if self.active:
                if name in self._INPUT_BYTES:
                    t = kwargs.get("input", args[1] if len(args) > 1 else None)
                else:
                    t = kwargs.get("output_tensor", kwargs.get("output", kwargs.get("tensor", args[0])))
                self.calls[kind] += 1
                self.bytes[kind] += t.numel() * t.element_size()
            return fn(*args, **kwargs)

        wrapper.__wrapped_by_counter__ = fn
        return wrapper

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        """(calls, bytes) per kind since the last ``take``; resets both."""
        calls, nbytes = dict(self.calls), dict(self.bytes)
        self.calls.clear()
        self.bytes.clear()
        return calls, nbytes
