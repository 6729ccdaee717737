"""Counting the host reads and host-data uploads a piece of code makes, on any device (CPU included).

On CUDA each of these blocks the host until the device has caught up (``torch.cuda.set_sync_debug_mode``
reports them there, and only there). On CPU nothing blocks, so the counter counts the *calls* that would
block on CUDA, which the test suite can see without a GPU:

* ``aten._local_scalar_dense``: ``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``, ``if t:``;
* ``aten.nonzero`` and friends whose output size depends on the values (``torch.nonzero``, masked indexing);
* ``Tensor.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")`` of a tensor on another device;
* ``torch.tensor(data, device=...)`` / ``torch.as_tensor(data, device=...)`` with an explicit device: host
  data uploaded (pageable memory: a synchronous copy on CUDA).

``HostSyncCounter`` is a context manager; ``counts`` maps ``kind`` to a count and ``sites`` maps
``"file:line kind"`` (the innermost frame in ``perparam/``, else the innermost outside torch) to a count.
Counted by wrapping those functions for the length of the block (process-wide, every thread): a torch
function mode would miss the calls perparam makes inside autograd's backward functions. Calls made from
C++ (torch's own kernels) are not seen.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter

import torch

_TENSOR_METHODS = ("item", "__bool__", "__int__", "__float__", "tolist", "numpy", "cpu", "nonzero", "to")
_FACTORIES = ("tensor", "as_tensor")
_lock = threading.Lock()


def _site() -> str:
    frame = sys._getframe(2)
    outside = None
    while frame is not None:
        name = frame.f_code.co_filename.replace("\\", "/")
        if "/perparam/" in name:
            return f"perparam/{name.rsplit('/perparam/', 1)[1]}:{frame.f_lineno}"
        if outside is None and "/torch/" not in name and not name.endswith("host_syncs.py"):
            outside = f"{name.rsplit('/', 1)[-1]}:{frame.f_lineno}"
        frame = frame.f_back
    return outside or "?"


def _to_host(args, kwargs) -> bool:
    target = kwargs.get("device", args[1] if len(args) > 1 else None)
    if isinstance(target, str | torch.device):
        return torch.device(target).type == "cpu" and args[0].device.type != "cpu"
    return False


class HostSyncCounter:
    """``with HostSyncCounter() as syncs: step()``; ``syncs.total``, ``syncs.counts`` (kind -> n),
    ``syncs.sites`` ("file:line kind" -> n). Not reentrant; one at a time per process."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self._saved: list = []
        self._inside = threading.local()

    def _add(self, kind: str) -> None:
        with _lock:
            self.counts[kind] += 1
            self.sites[f"{_site()} {kind}"] += 1

    def _wrap(self, kind: str, fn, counts):
        def call(*args, **kwargs):
            if not getattr(self._inside, "on", False) and counts(args, kwargs):
                self._inside.on = True  # what the call does inside is not counted again
                try:
                    self._add(kind)
                    return fn(*args, **kwargs)
                finally:
                    self._inside.on = False
            return fn(*args, **kwargs)
        return call

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> HostSyncCounter:
        def always(args, kwargs):
            return True

        for name in _TENSOR_METHODS:
            fn = getattr(torch.Tensor, name)
            self._saved.append((torch.Tensor, name, vars(torch.Tensor).get(name)))
            setattr(torch.Tensor, name, self._wrap("to_cpu" if name == "to" else name.strip("_"), fn,
                                                   _to_host if name == "to" else always))
        for name in _FACTORIES:
            self._saved.append((torch, name, getattr(torch, name)))
            setattr(torch, name, self._wrap("upload", getattr(torch, name),
                                            lambda a, k: k.get("device") is not None
                                            and not isinstance(a[0] if a else None, torch.Tensor)))
        self._saved.append((torch, "nonzero", torch.nonzero))
        torch.nonzero = self._wrap("nonzero", torch.nonzero, always)
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
        self._saved.clear()
