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
tensors and ``extra`` are saved once, from rank 0: ``save`` refuses values that differ between ranks. ``keep`` checkpoints are kept in ``path``'s parent.

``async_save(...)`` is ``save`` that returns once the state is copied to CPU memory: the write, the manifest
and the rename run in a background thread on a gloo process group of its own (``checkpoint_async.py``), with
the same crash safety; it returns a ``PendingSave`` (``wait()``), and the next save waits for it.

``load(path, model, optimizer)`` checks the manifest against the model and optimizer first (one message
naming every missing, unexpected or reshaped entry), loads into fresh tensors, and only then copies into
the model and optimizer: nothing is half-loaded. DCP's metadata file is a pickle; it is read with an
unpickler that admits DCP's own metadata classes and torch dtypes only, so loading never runs arbitrary
code (tensor payloads are read by DCP with ``weights_only=True``).

Optimizer state is saved per parameter name (of each optimizer, when ``save`` is given a sequence of them),
tensors through DCP (sharded like their parameter) and the rest in the manifest; a parameter that never got a gradient has no state and is fine, a parameter frozen
since the save gets its state back if it is still in the optimizer.

``full_state_dict(model)`` gathers the model on rank 0 one tensor at a time (rank 0 holds its shards plus
one unsharded tensor at a time, plus the CPU dict it returns); ``load_full_state_dict(model, sd)`` takes a
dict present on rank 0 only, broadcasts it one tensor at a time and keeps each rank's shard, so no rank
holds the model twice; a meta-device model is materialised first.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import uuid
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

from . import checkpoint_async as background
from .checkpoint_files import FORMAT, MANIFEST, _commit, _read_manifest, _SafeReader, _write_json, latest  # noqa: F401
from .checkpoint_optim import (
    _info,
    _json,
    _listed,
    _local,
    _optimizer_entry,
    _optimizer_targets,
    _restore_loaded,
)
from .comm.peers import lost_peers, note_checkpoint, register
from .full_state import (  # all but per_rank_keys re-exported (__all__)
    CheckpointError,
    full_state_dict,
    load_full_state_dict,
    per_rank_keys,
)
from .runtime import zero

PendingSave = background.PendingSave  # re-exported (__all__)


# -- helpers --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process when no process group exists: that is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _from_rank0(value):
    if not dist.is_initialized():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    meta = [k for k, v in state.items() if v.is_meta]
    if meta:
        raise CheckpointError(f"'{meta[0]}' (and {len(meta) - 1} more) of the model are on the meta device: "
                              "materialise it first with model.to_empty(device=...), then recompute its "
                              "non-persistent buffers, which no checkpoint holds (perparam.full_state."
                              "load_full_state_dict does both, for a full state dict held by rank 0)")
    return state


# -- save -----------------------------------------------------------------------------------------------
@lost_peers("perparam.checkpoint.save")
def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict | None = None, keep: int | None = 2) -> Path:
    """Save ``model`` (and ``optimizer``: one, or a sequence of them, e.g. Muon and AdamW on disjoint
    parameters) to the folder ``path``, crash-safely; every rank calls it.

    ``extra``: a small JSON-serialisable dict (step, data position, seeds) returned by ``load``.
    ``keep``: how many complete checkpoints of ``path``'s series to keep (its siblings named like it up
    to trailing digits, e.g. ``step-000030``; oldest removed first; ``None``: all). An existing checkpoint at ``path`` is replaced only once the new one is complete. Returns
    ``path``. Raises ``CheckpointError`` for non-JSON ``extra`` or optimizer options, before writing, and
    the error of an earlier ``async_save`` still unreported (after waiting for it).
    """
    background.wait_pending()
    register()  # this rank's host and pid: a PeerLostError names a peer that dies during the save
    path = Path(path)
    state, manifest, tmp, token = _prepare(path, model, optimizer, extra)
    with _single_process_quiet():
        dcp.save(state, storage_writer=FileSystemWriter(tmp), no_dist=not dist.is_initialized())
    _barrier()  # every rank's files are written
    if _rank() == 0:
        _commit(path, tmp, token, manifest, keep)
    _barrier()
    note_checkpoint(path)
    return path


@lost_peers("perparam.checkpoint.async_save")
def async_save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
               extra: dict | None = None, keep: int | None = 2) -> background.PendingSave:
    """``save`` that returns once the state is copied to CPU memory and writes in a background thread, on a
    gloo process group of its own; every rank calls it. Returns a ``PendingSave``: ``wait()`` returns
    ``path`` once the checkpoint is complete.

    What is saved is the state at the call: training may change the model and optimizer as soon as it
    returns. Costs one CPU copy of this rank's model and optimizer shards while the write runs. Crash-safe
    as ``save``: the manifest and the rename happen only after every rank has written its files, so a run
    killed during the write leaves the previous checkpoint loadable. An earlier save still in flight is
    waited for first (one write at a time); ``save``, ``distributed_session()``'s end and interpreter exit
    wait too. Raises ``CheckpointError`` at once for the inputs ``save`` refuses; a failure of the write
    itself is raised by ``wait()`` (or the next save, or ``perparam.checkpoint.wait_pending()``), on every
    rank. Ranks running as threads of one process (torch's ``threaded`` process group) are refused with
    ``CheckpointError`` before anything is written: the background write's own process group and DCP's
    collectives from a writer thread do not work there; use ``save``.
    """
    if dist.is_initialized() and dist.get_backend() == "threaded":
        raise CheckpointError("async_save cannot run with ranks as threads of one process (the 'threaded' process "
                              "group): its background writer needs a process group of its own per process; use "
                              "perparam.checkpoint.save (blocking) there")
    background.wait_pending()
    register()
    path = Path(path)
    state, manifest, tmp, token = _prepare(path, model, optimizer, extra)
    group = background.checkpoint_group()  # created by the first asynchronous save: a collective
    staged = background.snapshot(state)

    def write() -> Path:
        with _single_process_quiet():
            dcp.save(staged, storage_writer=FileSystemWriter(tmp), process_group=group, no_dist=group is None)
        failed = None
        if group is not None:
            dist.barrier(group=group)  # every rank's files are written
        if _rank() == 0:
            try:
                _commit(path, tmp, token, manifest, keep)
            except Exception as e:  # every rank must hear of it, not wait in the broadcast below
                failed = f"{type(e).__name__}: {e}"
        if group is not None:
            box = [failed]
            dist.broadcast_object_list(box, src=0, group=group)
            failed = box[0]
        if failed:
            raise CheckpointError(f"the background save of {path} was written but not committed ({failed}); "
                                  "the previous checkpoint is unchanged")
        note_checkpoint(path)
        return path

    return background.submit(write, path)


def wait_pending() -> None:
    """Wait for this process's checkpoints still being written by ``async_save``; raises the first failed
    one's ``CheckpointError`` (once). Call it on every rank."""
    background.wait_pending()


def _prepare(path: Path, model: nn.Module, optimizer, extra: dict | None) -> tuple[dict, dict, Path, str]:
    """The state dict to write (the model's and the optimizer's tensors), the manifest, the temporary folder
    and the save's token; removes what killed saves left behind. A collective."""
    extra = _json(extra or {}, "extra")
    state = {f"model.{k}": v for k, v in _model_state(model).items()}
    manifest: dict = {"format": FORMAT, "extra": extra, "world_size": dist.get_world_size() if dist.is_initialized()
                      else 1, "model": {k.removeprefix("model."): _info(v) for k, v in state.items()}}
    for prefix, opt in _listed(optimizer):
        entry = _optimizer_entry(model, opt, state, prefix)
        if isinstance(optimizer, torch.optim.Optimizer):
            manifest["optimizer"] = entry
        else:
            manifest.setdefault("optimizers", []).append(entry)
    _check_same_on_every_rank(state, extra)
    state = _per_mesh_keys(state, model)
    manifest = json.loads(json.dumps(manifest))  # a copy: later changes to extra or the options stay out
    token = _from_rank0(uuid.uuid4().hex[:12])
    tmp = path.parent / f".{path.name}.tmp-{token}"
    if _rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a save killed between its two renames left the previous one as .old: done with it
            for stale in path.parent.glob(f".{path.name}.old-*"):
                shutil.rmtree(stale, ignore_errors=True)
        for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    return state, manifest, tmp, token


def _mesh_renames(state: dict, model: nn.Module) -> dict[str, str]:
    """Key -> the key DCP stores it under, for each DTensor that is a different tensor on different ranks
    (``perparam.full_state.per_rank_keys``: experts of expert parallelism, each rank's on its own mesh
    given by ``ParamPolicy(mesh=...)``). DCP would take them for one tensor and keep one rank's copy; each
    is stored as ``<key>@ranks=<its mesh's ranks>`` instead, so a load with the same layout reads each back
    (another layout finds no such key: an error, never another rank's values). A collective on every rank;
    ``{}`` on one process."""
    return {k: f"{k}@ranks={'-'.join(map(str, ranks))}" for k, ranks in per_rank_keys(state, model).items()}


def _per_mesh_keys(state: dict, model: nn.Module) -> dict:
    """``state`` with the keys of per-rank-mesh DTensors renamed (``_mesh_renames``): the same tensors."""
    renames = _mesh_renames(state, model)
    return {renames.get(k, k): v for k, v in state.items()}


def _check_same_on_every_rank(state: dict, extra: dict) -> None:
    """DCP saves a plain (non-DTensor) tensor once, from rank 0, as replicated; ``extra`` is written by rank 0.
    A value that differs between ranks would come back as rank 0's everywhere: refuse before writing."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = {k: zlib.crc32(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) if v.numel() else 0
            for k, v in state.items() if not isinstance(v, DTensor)}
    mine["<extra>"] = json.dumps(extra, sort_keys=True)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    # from `everyone` only (the same list on every rank), so every rank decides alike: a key some rank lacks
    # differs too, on the ranks that have it and on those that do not
    differ = sorted(k for k in set().union(*everyone) if any(o.get(k) != everyone[0].get(k) for o in everyone))
    if differ:
        what = ", ".join(k.removeprefix("model.") for k in differ[:5])
        raise CheckpointError(f"save: {what} differ between ranks, but a plain tensor (not a DTensor) and extra are "
                              "saved once, from rank 0, and would load as rank 0's value everywhere: make "
                              "rank-dependent state a DTensor, keep it out of the state dict, or save it yourself "
                              "(e.g. extra={'per_rank': {rank: ...}} gathered to every rank first). Nothing was written")


# -- load -----------------------------------------------------------------------------------------------
def _differences(saved: dict, current: dict[str, torch.Tensor], what: str) -> list[str]:
    out = [f"{what} '{k}' is in the checkpoint but not in the {what}" for k in saved if k not in current]
    out += [f"{what} '{k}' is not in the checkpoint" for k in current if k not in saved]
    for k in [k for k in saved if k in current]:  # in state-dict order
        s, c = saved[k], _info(current[k])
        if s["shape"] != c["shape"] or s["dtype"] != c["dtype"]:
            out.append(f"{what} '{k}' was saved as {s['dtype']}{s['shape']} and is {c['dtype']}{c['shape']} now")
    return out


@lost_peers("perparam.checkpoint.load")
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by ``save`` into ``model`` (and ``optimizer``: what ``save`` was given, one
    optimizer or a sequence of them in the same order); every rank calls it.

    The world size, mesh shape and tensor parallelism may differ from the saving run's. Returns the
    ``extra`` dict given to ``save``. Waits for this process's ``async_save`` still in flight first (and
    raises its failure). Raises ``CheckpointError`` before changing anything when ``path`` is
    missing, incomplete or foreign, or names, shapes or dtypes differ (all differences in one message).
    """
    background.wait_pending()  # an async_save of this process still writing (perhaps this very checkpoint)
    path = Path(path)
    manifest = _read_manifest(path)
    current = _model_state(model)
    problems = _differences(manifest["model"], current, "model")
    targets = {f"model.{k}": torch.zeros_like(v) for k, v in current.items()}
    listed = _listed(optimizer)
    single = isinstance(optimizer, torch.optim.Optimizer)
    saved_all = [manifest.get("optimizer")] if single else manifest.get("optimizers", [])
    if listed and len(saved_all) != len(listed):
        saved_all = [None] * len(listed)
    restores = [_optimizer_targets(model, opt, saved, prefix, targets, problems)
                for (prefix, opt), saved in zip(listed, saved_all)]
    per_mesh = _per_mesh_keys(targets, model)  # the same tensors as ``targets``, under the keys ``save`` wrote
    try:  # DCP's own metadata, read safely, before anything is touched
        _SafeReader(path).read_metadata()
    except CheckpointError as e:
        problems.insert(0, str(e))
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        problems.insert(0, f"its DCP metadata (.metadata) cannot be read ({e}): the save did not finish")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"checkpoint {path} does not match: {shown}. Nothing was loaded")
    try:
        with _single_process_quiet():
            dcp.load(per_mesh, storage_reader=_SafeReader(path), no_dist=not dist.is_initialized())
    except BaseException as e:  # noqa: B036 (DCP's CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading {path} failed ({type(e).__name__}: {str(e)[:300]}); the files are damaged or "
                              "incomplete: load an earlier checkpoint. Nothing was loaded") from e
    # every tensor read: now change the model and the optimizer
    with torch.no_grad():
        for k, v in current.items():
            _local(v).copy_(_local(targets[f"model.{k}"]))
    zero.invalidate()  # stage-1/2 kept copies: refreshed at the next all-gather
    for (_, opt), saved, restore in zip(listed, saved_all, restores):
        _restore_loaded(opt, saved, restore)
    note_checkpoint(path)
    return manifest.get("extra", {})


__all__ = ["CheckpointError", "PendingSave", "async_save", "full_state_dict", "latest", "load", "load_full_state_dict",
           "save", "wait_pending"]
