"""Counting ``torch.distributed`` collective calls from Python (FSDP2's bytes; a cross-check for perparam).

Byte convention (per rank, as ``perparam.CommCounter``): an all-gather counts its gathered output, a
reduce-scatter its input, an all-reduce or broadcast its tensor. On gloo perparam runs both its
all-gathers and its reduce-scatters as ``all_to_all_single`` calls with split sizes
(``perparam.comm.collectives``); those are counted as kind ``all_to_all`` (the input's bytes). Every call also
adds the bytes this rank sends to other ranks (``sent``): ``(K-1)/K`` of an all-gather's output or a
reduce-scatter's input (ring), ``2 (K-1)/K`` of an all-reduce, the other ranks' splits of an all-to-all.
perparam's zero-copy all-gather (the default on gloo) sends point to point (``ProcessGroup.send``: kind
``send``, all of its bytes sent).
"""

from __future__ import annotations

from collections import defaultdict

import torch.distributed as dist


class DistCounter:
    """Wraps the ``torch.distributed`` collective functions; counts calls and bytes while ``active``."""

    _OUTPUT_BYTES = ("all_gather_single", "all_gather_into_tensor")  # gathered output: first argument
    _INPUT_BYTES = ("reduce_scatter_single", "reduce_scatter_tensor", "all_to_all_single")  # input: second
    _ARG_GROUP = {"all_to_all_single": 4}  # positional index of ``group`` (else 2: the other functions)
    _TENSOR_BYTES = ("all_reduce", "broadcast")

    def __init__(self) -> None:
        self.active = False
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)
        self.sent = 0.0
        for name in self._OUTPUT_BYTES + self._INPUT_BYTES + self._TENSOR_BYTES:
            fn = getattr(dist, name)
            setattr(dist, name, self._wrap(name, getattr(fn, "__wrapped_by_counter__", fn)))
        send = dist.ProcessGroup.send
        dist.ProcessGroup.send = self._wrap_send(getattr(send, "__wrapped_by_counter__", send))

    def _wrap_send(self, fn):
        """``ProcessGroup.send(tensors, dst, tag)``: perparam's zero-copy all-gather on gloo (a point-to-point
        send per parameter and peer, ``perparam.comm.collectives.all_gather_in_place``); counted as kind
        ``send``, every byte sent to another rank."""

        def wrapper(pg, tensors, *args, **kwargs):
            if self.active:
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                self.calls["send"] += 1
                self.bytes["send"] += nbytes
                self.sent += nbytes
            return fn(pg, tensors, *args, **kwargs)

        wrapper.__wrapped_by_counter__ = fn
        return wrapper

    def _wrap(self, name: str, fn):
        kind = ("all_gather" if name in self._OUTPUT_BYTES else "all_to_all" if name == "all_to_all_single"
                else
                "reduce_scatter" if name in self._INPUT_BYTES else name)

        def wrapper(*args, **kwargs):
            if self.active:
                if name in self._INPUT_BYTES:
                    t = kwargs.get("input", args[1] if len(args) > 1 else None)
                else:
                    t = kwargs.get("output_tensor", kwargs.get("output", kwargs.get("tensor", args[0])))
                nbytes = t.numel() * t.element_size()
                self.calls[kind] += 1
                self.bytes[kind] += nbytes
                pos = self._ARG_GROUP.get(name, 2)
                group = kwargs.get("group", args[pos] if len(args) > pos else None)
                k = dist.get_world_size(group)
                if kind == "all_to_all":
                    splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
                    if splits:
                        me, row = dist.get_rank(group), nbytes // max(sum(splits), 1)
                        self.sent += sum(n for r, n in enumerate(splits) if r != me) * row
                    else:
                        self.sent += nbytes * (k - 1) / k
                else:
                    self.sent += nbytes * (k - 1) / k * (2 if kind == "all_reduce" else 1)
            return fn(*args, **kwargs)

        wrapper.__wrapped_by_counter__ = fn
        return wrapper

    def take(self) -> tuple[dict[str, int], dict[str, int], float]:
        """(calls, bytes) per kind and bytes sent to other ranks since the last ``take``; resets them."""
        calls, nbytes, sent = dict(self.calls), dict(self.bytes), self.sent
        self.calls.clear()
        self.bytes.clear()
        self.sent = 0.0
        return calls, nbytes, sent
