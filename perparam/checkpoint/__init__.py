"""Sharded checkpoints that survive crashes and load on another world size or mesh, and full state dicts.

``save(path, model, optimizer, extra=...)`` writes a ``torch.distributed.checkpoint`` (DCP) checkpoint: every
rank writes its own shards (an HSDP replica's copies once), so a checkpoint saved on K ranks loads on any
other K, on a 1D or HSDP mesh, with or without tensor parallelism, or into one unsharded process; DCP
reassembles and reslices each tensor. Crash safety: the files go into a temporary folder next to
``path``; after every rank has finished, rank 0 writes the manifest (``perparam_checkpoint.json``: names,
global shapes and dtypes, optimizer hyper-parameters, ``extra``) and renames the folder to ``path``
(``os.rename`` is atomic on one filesystem). A save killed half-way leaves the previous checkpoint as it
was (replacing an existing ``path`` takes two renames; killed between them, the previous checkpoint stays
as ``.<name>.old-*`` and ``load`` says so), and the next save removes the leftovers. Plain (non-DTensor)
tensors and ``extra`` are saved once, from rank 0: ``save`` refuses values that differ between ranks. ``keep``
checkpoints are kept in ``path``'s parent.

``async_save(...)`` is ``save`` that returns once the state is copied to CPU memory: the write, the manifest
and the rename run in a background thread on a gloo process group of its own (``background.py``), with
the same crash safety; it returns a ``PendingSave`` (``wait()``), and the next save waits for it.

``load(path, model, optimizer)`` checks the manifest against the model and optimizer first (one message
naming every missing, unexpected or reshaped entry), loads into fresh tensors, and only then copies into
the model and optimizer: nothing is half-loaded. DCP's metadata file is a pickle; it is read with an
unpickler that admits DCP's own metadata classes and torch dtypes only, so loading never runs arbitrary
code (tensor payloads are read by DCP with ``weights_only=True``).

Optimizer state is saved per parameter name (of each optimizer, when ``save`` is given a sequence of them),
tensors through DCP (sharded like their parameter) and the rest in the manifest; a parameter that never got a
gradient has no state and is fine, a parameter frozen since the save gets its state back if it is still in the
optimizer.

``full_state_dict(model)`` gathers the model on rank 0 one tensor at a time (rank 0 holds its shards plus
one unsharded tensor at a time, plus the CPU dict it returns); ``load_full_state_dict(model, sd)`` takes a
dict present on rank 0 only, broadcasts it one tensor at a time and keeps each rank's shard, so no rank
holds the model twice; a meta-device model is materialised first.

The family, one responsibility per file: ``save.py`` (``save``, ``async_save``: the target agreed, the
write, the commit or the cleanup), ``load.py`` (``load``: checks, checksums, then the read), ``files.py`` (the
folder on disk: manifest, rename, series and ``keep``, ``latest``, ``survey``, what a save may write over),
``integrity.py`` (the files' SHA-256, the damage found, a full disk named), ``optim.py`` (optimizer state by
parameter name), ``background.py`` (``async_save``'s snapshot, writer thread and process group),
``ranks.py`` (rank helpers, the model's state and per-rank-mesh keys). ``CheckpointError`` and
``CheckpointDamagedError`` live in ``perparam/errors.py``.
"""

from __future__ import annotations

from ..errors import CheckpointDamagedError, CheckpointError
from ..full_state import full_state_dict, load_full_state_dict
from .background import PendingSave
from .files import FORMAT, MANIFEST, latest, survey, target_problem
from .load import load, load_from
from .save import async_save, capture, save, wait_pending

__all__ = ["FORMAT", "MANIFEST", "CheckpointDamagedError", "CheckpointError", "PendingSave", "async_save",
           "capture", "full_state_dict", "latest", "load", "load_from", "load_full_state_dict", "save",
           "survey", "target_problem", "wait_pending"]
