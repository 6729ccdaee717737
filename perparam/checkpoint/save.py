"""``perparam.checkpoint.save`` and ``async_save``: where a save may write (agreed by every rank before
anything is written), the state and manifest it writes, the write into a temporary folder with every file's
checksum, and the commit (manifest, atomic rename, ``keep``) or, on a failure, the partial folder removed and
the cause (a full disk named) raised on every rank. The format and its guarantees:
``perparam/checkpoint/__init__.py``."""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor

from ..comm.peers import lost_peers, note_checkpoint, register
from ..errors import CheckpointError
from . import background
from .files import FORMAT, commit, leftovers, target_problem
from .integrity import DigestingWriter, disk_full
from .optim import as_json, info, listed, optimizer_entry
from .ranks import barrier, from_rank0, model_state, per_mesh_keys, rank, single_process_quiet


@lost_peers("perparam.checkpoint.save")
def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         extra: dict | None = None, keep: int | None = 2) -> Path:
    """Save ``model`` (and ``optimizer``: one, or a sequence of them, e.g. Muon and AdamW on disjoint
    parameters) to the folder ``path``, crash-safely; every rank calls it.

    ``extra``: a small JSON-serialisable dict (step, data position, seeds) returned by ``load``.
    ``keep``: how many complete checkpoints of ``path``'s series to keep (its siblings named like it up
    to trailing digits, e.g. ``step-000030``, the one saved included; oldest removed first; ``None``: all;
    0, negative or not a whole number: refused); only perparam checkpoints count and are ever removed.
    ``path`` must be new, an empty folder or a perparam checkpoint, which is replaced only once the new one
    is complete; a file, a link, ``""``, ``.`` or a folder holding anything else is refused on every rank
    before anything is written. The manifest records every file's size and SHA-256 (``load`` checks them).
    Returns ``path``. Raises ``CheckpointError`` for the refusals above and non-JSON ``extra`` or optimizer
    options, before writing; for a failed write (a full disk named as ENOSPC) after removing the partial
    folder, on every rank; and the error of an earlier ``async_save`` still unreported (after waiting for it).
    """
    background.wait_pending()
    register()  # this rank's host and pid: a PeerLostError names a peer that dies during the save
    path = _agreed_target(path, keep)
    state, manifest, tmp, token = _prepare(path, model, optimizer, extra)
    return _write_and_commit(state, path, tmp, token, manifest, keep, None)


def _agreed_target(raw, keep) -> Path:
    """``raw`` as a ``Path``, or ``CheckpointError`` on every rank (before anything is written) when any rank
    finds it may not be written (``files.target_problem``) or the ranks were given different
    paths. A collective."""
    mine = (os.fspath(raw) if isinstance(raw, (str, os.PathLike)) else repr(raw), target_problem(raw, keep))
    everyone = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    problem = next(((r, why) for r, (_, why) in enumerate(everyone) if why), None)
    if problem is None and len({p for p, _ in everyone}) > 1:
        problem = (0, "the ranks were given different paths "
                      f"({', '.join(sorted({p for p, _ in everyone}))}): every rank passes the same "
                      "checkpoint folder")
    if problem is not None:
        where = f" (found on rank {problem[0]})" if len(everyone) > 1 else ""
        raise CheckpointError(f"perparam.checkpoint.save: {problem[1]}{where}. Nothing was written")
    return Path(raw)


def _write_and_commit(state: dict, path: Path, tmp: Path, token: str, manifest: dict, keep, group,
                      in_background: bool = False) -> Path:
    """Every rank writes its files into ``tmp`` (hashing them), rank 0 commits with every file's checksum;
    on a failure anywhere every rank raises ``CheckpointError`` (naming a full disk) once ``tmp`` is removed.
    ``group``: the process group (``None``: the default one)."""
    no_dist = not dist.is_initialized()
    writer = DigestingWriter(tmp)
    failed: BaseException | None = None
    try:
        with single_process_quiet():
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=no_dist)
    # DCP's CheckpointException: raised on every rank, all writes over
    except BaseException as e:  # noqa: B036
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failed = e
    files = None
    if failed is None:  # every rank's digests to every rank (also: every rank's files are written)
        files = [writer.digests]
        if not no_dist and dist.get_world_size(group) > 1:
            files = [None] * dist.get_world_size(group)
            dist.all_gather_object(files, writer.digests, group=group)
    note = None
    if rank() == 0:
        try:
            if failed is None:
                commit(path, tmp, token, manifest, keep, {k: v for d in files for k, v in d.items()})
        except Exception as e:  # every rank must hear of it, not wait in the broadcast below
            failed = e
        if failed is not None:
            note = (f"{disk_full(failed, path.parent) or background.cause(failed)}; the partial folder "
                    f"{tmp.name} was removed")
            shutil.rmtree(tmp, ignore_errors=True)
    if not no_dist and dist.get_world_size(group) > 1:
        box = [note]
        dist.broadcast_object_list(box, src=0, group=group)
        note = box[0]
    if note:
        what = f"the background save of {path}" if in_background else f"saving {path}"
        raise CheckpointError(f"{what} failed: {note}; the previous checkpoint is unchanged")
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
        raise CheckpointError("async_save cannot run with ranks as threads of one process (the 'threaded' "
                              "process group): its background writer needs a process group of its own per "
                              "process; use perparam.checkpoint.save (blocking) there")
    background.wait_pending()
    register()  # this rank's host and pid: a PeerLostError names a peer that dies during the save
    path = _agreed_target(path, keep)
    state, manifest, tmp, token = _prepare(path, model, optimizer, extra)
    group = background.checkpoint_group()  # created by the first asynchronous save: a collective
    staged = background.snapshot(state)

    def write() -> Path:
        return _write_and_commit(staged, path, tmp, token, manifest, keep, group, in_background=True)

    return background.submit(write, path)


def wait_pending() -> None:
    """Wait for this process's checkpoints still being written by ``async_save``; raises the first failed
    one's ``CheckpointError`` (once). Call it on every rank."""
    background.wait_pending()


def capture(model: nn.Module, optimizer=None,
            extra: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """What ``save`` writes, without writing it: the state dict (``model.<name>`` and the optimizers' tensors,
    this rank's DTensors as they are, no copy) and the manifest (JSON: names, shapes, dtypes, optimizer
    options and non-tensor state, ``extra``). Every rank calls it (owner state of whole-matrix optimizers is
    moved: a collective there, none otherwise). ``load_from(manifest, reader, ...)`` takes them back from any
    ``torch.distributed.checkpoint`` storage reader (``perparam.elastic``'s in-memory snapshots use it)."""
    extra = as_json(extra or {}, "extra")
    state = {f"model.{k}": v for k, v in model_state(model).items()}
    manifest: dict = {"format": FORMAT, "extra": extra,
                      "world_size": dist.get_world_size() if dist.is_initialized()
                      else 1, "model": {k.removeprefix("model."): info(v) for k, v in state.items()}}
    for prefix, opt in listed(optimizer):
        entry = optimizer_entry(model, opt, state, prefix)
        if isinstance(optimizer, torch.optim.Optimizer):
            manifest["optimizer"] = entry
        else:
            manifest.setdefault("optimizers", []).append(entry)
    return state, manifest


def _prepare(path: Path, model: nn.Module, optimizer, extra: dict | None) -> tuple[dict, dict, Path, str]:
    """The state dict to write (the model's and the optimizer's tensors), the manifest, the temporary folder
    and the save's token; removes what killed saves left behind. A collective."""
    state, manifest = capture(model, optimizer, extra)
    extra = manifest["extra"]
    _check_same_on_every_rank(state, extra)
    state = per_mesh_keys(state, model)
    manifest = json.loads(json.dumps(manifest))  # a copy: later changes to extra or the options stay out
    token = from_rank0(uuid.uuid4().hex[:12])
    tmp = path.parent / f".{path.name}.tmp-{token}"
    if rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():  # a save killed between its two renames left the previous one as .old: done with it
            for stale in leftovers(path, "old"):
                shutil.rmtree(stale, ignore_errors=True)
        for stale in leftovers(path, "tmp"):  # left by a save that was killed
            shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return state, manifest, tmp, token


def _check_same_on_every_rank(state: dict, extra: dict) -> None:
    """DCP saves a plain (non-DTensor) tensor once, from rank 0, as replicated; ``extra`` is written by rank
    0. A value that differs between ranks would come back as rank 0's everywhere: refuse before writing."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = {k: zlib.crc32(v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            if v.numel() else 0
            for k, v in state.items() if not isinstance(v, DTensor)}
    mine["<extra>"] = json.dumps(extra, sort_keys=True)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    # from `everyone` only (the same list on every rank), so every rank decides alike: a key some rank lacks
    # differs too, on the ranks that have it and on those that do not
    differ = sorted(k for k in set().union(*everyone)
                    if any(o.get(k) != everyone[0].get(k) for o in everyone))
    if differ:
        what = ", ".join(k.removeprefix("model.") for k in differ[:5])
        raise CheckpointError(f"save: {what} differ between ranks, but a plain tensor (not a DTensor) and "
                              "extra are saved once, from rank 0, and would load as rank 0's value "
                              "everywhere: make rank-dependent state a DTensor, keep it out of the state "
                              "dict, or save it yourself (e.g. extra={'per_rank': {rank: ...}} gathered to "
                              "every rank first). Nothing was written")
