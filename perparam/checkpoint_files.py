"""A perparam checkpoint's folder on disk: the manifest (``MANIFEST``, ``FORMAT``), written with an fsync and
made visible by an atomic rename (``_commit``; the previous checkpoint replaced, a series pruned to
``keep``), the complete checkpoints of a folder (``latest``), the manifest read back with its errors, and
DCP's metadata read with an unpickler that admits DCP's own classes and torch dtypes only."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from . import checkpoint_async as background
from .full_state import CheckpointError

MANIFEST = "perparam_checkpoint.json"
FORMAT = "perparam-checkpoint/1"


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, ``collections.OrderedDict`` and torch's dtype/layout/format objects."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in {
                ("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"), ("builtins", "frozenset"),
                ("torch.serialization", "_get_layout"),  # rebuilds a layout from its name
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath")}:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                        torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which is not DCP metadata: refusing "
                              "to unpickle it (the checkpoint was not written by torch.distributed.checkpoint)")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _commit(path: Path, tmp: Path, token: str, manifest: dict, keep: int | None) -> None:
    """Rank 0, once every rank's files are in ``tmp``: the manifest, the atomic rename(s), ``keep``."""
    manifest["saved_ns"] = time.time_ns()
    _write_json(tmp / MANIFEST, manifest)
    if path.exists():
        old = path.parent / f".{path.name}.old-{token}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    _fsync_dir(path.parent)
    if keep is not None:
        for stale in _series(path)[:-keep]:
            if stale != path:
                shutil.rmtree(stale, ignore_errors=True)


def _write_json(target: Path, data: dict) -> None:
    part = target.with_suffix(".part")
    with open(part, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, target)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _complete(folder: Path) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest first."""
    found = []
    for d in folder.iterdir() if folder.is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file():
            try:
                found.append((json.loads((d / MANIFEST).read_text()).get("saved_ns", 0), d))
            except (OSError, ValueError):
                continue
    return [d for _, d in sorted(found)]


def _series(path: Path) -> list[Path]:
    """The complete checkpoints beside ``path`` named like it up to its trailing digits (``step-000030``:
    ``step-*``), oldest first; a name without trailing digits is a series of one."""
    prefix = path.name.rstrip("0123456789")
    if prefix == path.name:
        return [path]
    return [d for d in _complete(path.parent) if d.name.startswith(prefix) and d.name[len(prefix):].isdigit()]


def latest(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``folder`` (or ``folder`` itself if it is one), else ``None``; this
    process's ``async_save`` still in flight is waited for first."""
    background.wait_pending()
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        return folder
    found = _complete(folder)
    return found[-1] if found else None


def _read_manifest(path: Path) -> dict:
    if not path.is_dir():
        moved = sorted(path.parent.glob(f".{path.name}.old-*"))
        if moved and (moved[-1] / MANIFEST).is_file():
            raise CheckpointError(f"no checkpoint at {path}: a save was killed while replacing it; the previous "
                                  f"checkpoint is intact at {moved[-1]} (load it, or rename it back to {path.name})")
        raise CheckpointError(f"no checkpoint at {path}: the folder does not exist")
    if not (path / MANIFEST).is_file():
        newest = latest(path)
        hint = (f"; it holds checkpoints, the newest is {newest} (perparam.checkpoint.latest)" if newest else
                ": a save that was interrupted before it finished, or a folder not written by perparam.checkpoint")
        raise CheckpointError(f"{path} is not a complete perparam checkpoint (no {MANIFEST}){hint}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError as e:
        raise CheckpointError(f"{path / MANIFEST} is damaged ({e}); load an earlier checkpoint") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest
