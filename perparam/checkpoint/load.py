"""``perparam.checkpoint.load``: the manifest read and checked against the model and optimizer (every
difference in one message), every file's checksum verified with the files split between the ranks, then
DCP's read into fresh tensors, and only then the model and optimizer changed: nothing is half-loaded."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from ..comm.peers import lost_peers, note_checkpoint
from ..errors import CheckpointDamagedError, CheckpointError
from ..runtime import zero
from . import background
from .files import SafeReader, read_manifest
from .integrity import damage
from .optim import info, listed, local, optimizer_targets, restore_loaded
from .ranks import model_state, per_mesh_keys, rank, single_process_quiet


def _differences(saved: dict, current: dict[str, torch.Tensor], what: str) -> list[str]:
    out = [f"{what} '{k}' is in the checkpoint but not in the {what}" for k in saved if k not in current]
    out += [f"{what} '{k}' is not in the checkpoint" for k in current if k not in saved]
    for k in [k for k in saved if k in current]:  # in state-dict order
        s, c = saved[k], info(current[k])
        if s["shape"] != c["shape"] or s["dtype"] != c["dtype"]:
            out.append(f"{what} '{k}' was saved as {s['dtype']}{s['shape']} and is {c['dtype']}{c['shape']} "
                       "now")
    return out


@lost_peers("perparam.checkpoint.load")
def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         verify: bool = True) -> dict:
    """Load a checkpoint written by ``save`` into ``model`` (and ``optimizer``: what ``save`` was given, one
    optimizer or a sequence of them in the same order); every rank calls it.

    The world size, mesh shape and tensor parallelism may differ from the saving run's. Returns the
    ``extra`` dict given to ``save``. Waits for this process's ``async_save`` still in flight first (and
    raises its failure). Raises ``CheckpointError`` before changing anything when ``path`` is
    missing, incomplete or foreign, or names, shapes or dtypes differ (all differences in one message).
    With ``verify`` (the default), every file's size and SHA-256 are checked against the manifest first, the
    files split between the ranks: ``CheckpointDamagedError`` (a ``CheckpointError``) on every rank names
    the first damaged file and what is wrong with it (missing, truncated, overwritten, changed in place);
    checkpoints saved before checksums are loaded unchecked.
    """
    background.wait_pending()  # an async_save of this process still writing (perhaps this very checkpoint)
    path = Path(path)
    manifest = read_manifest(path)
    if verify:
        _verify(path, manifest.get("files") or {})
    extra = load_from(manifest, SafeReader(path), model, optimizer, source=f"checkpoint {path}")
    note_checkpoint(path)
    return extra


def load_from(manifest: dict, reader, model: nn.Module, optimizer=None, *,
              source: str = "the checkpoint") -> dict:
    """``load`` from a manifest (``save.capture``'s) and any DCP ``StorageReader`` holding the tensors it
    names, saved on any world size or mesh; ``source`` names it in errors. Every rank calls it (a collective).
    Returns the manifest's ``extra``. Raises ``CheckpointError`` before changing anything on a mismatch."""
    current = model_state(model)
    problems = _differences(manifest["model"], current, "model")
    targets = {f"model.{k}": torch.zeros_like(v) for k, v in current.items()}
    pairs = listed(optimizer)
    single = isinstance(optimizer, torch.optim.Optimizer)
    saved_all = [manifest.get("optimizer")] if single else manifest.get("optimizers", [])
    if pairs and len(saved_all) != len(pairs):
        saved_all = [None] * len(pairs)
    restores = [optimizer_targets(model, opt, saved, prefix, targets, problems)
                for (prefix, opt), saved in zip(pairs, saved_all)]
    per_mesh = per_mesh_keys(targets, model)  # the same tensors as ``targets``, under the keys ``save`` wrote
    try:  # DCP's own metadata, read safely, before anything is touched
        reader.read_metadata()
    except CheckpointError as e:
        problems.insert(0, str(e))
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        problems.insert(0, f"its DCP metadata (.metadata) cannot be read ({e}): the save did not finish")
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise CheckpointError(f"{source} does not match: {shown}. Nothing was loaded")
    try:
        with single_process_quiet():
            dcp.load(per_mesh, storage_reader=reader, no_dist=not dist.is_initialized())
    except BaseException as e:  # noqa: B036 (DCP's CheckpointException is a BaseException)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"reading {source} failed ({type(e).__name__}: {str(e)[:300]}); the files are "
                              "damaged or incomplete: load an earlier checkpoint. Nothing was loaded") from e
    # every tensor read: now change the model and the optimizer
    with torch.no_grad():
        for k, v in current.items():
            local(v).copy_(local(targets[f"model.{k}"]))
    zero.invalidate()  # stage-1/2 kept copies: refreshed at the next all-gather
    for (_, opt), saved, restore in zip(pairs, saved_all, restores):
        restore_loaded(opt, saved, restore)
    return manifest.get("extra", {})


def _verify(path: Path, files: dict[str, dict]) -> None:
    """Check ``files`` (name -> size and checksum) in ``path``: rank r hashes every K-th name from the r-th,
    the ranks share what they found, and every rank raises the same ``CheckpointDamagedError``. A
    collective."""
    names = sorted(files)
    world = dist.get_world_size() if dist.is_initialized() else 1
    found = [damage(path, files, names[rank()::world])]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, damage(path, files, names[rank()::world]))
    wrong = sorted(w for part in found for w in part)
    if wrong:
        raise CheckpointDamagedError(path, wrong[0][0], wrong[0][1], more=len(wrong) - 1)
