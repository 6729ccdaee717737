"""A perparam checkpoint's folder on disk: the manifest (``MANIFEST``, ``FORMAT``), written with an fsync and
made visible by an atomic rename (``_commit``; the previous checkpoint replaced, a series pruned to
``keep``), the complete checkpoints of a folder (``latest``), the manifest read back with its errors, and
DCP's metadata read with an unpickler that admits DCP's own classes and torch dtypes only."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import time
import warnings
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import StorageMeta

from ..errors import CheckpointDamagedError, CheckpointError
from . import background
from .integrity import (
    MANIFEST_SUM,
    damage,
    file_digest,
    manifest_damage,
    seal,
)

MANIFEST = "perparam_checkpoint.json"
FORMAT = "perparam-checkpoint/1"
METADATA = ".metadata"
#: the names a perparam checkpoint's folder holds: the manifest, DCP's metadata and its data files
OWN_FILE = re.compile(r"(perparam_checkpoint\.json|\.metadata|__\d+_\d+\.distcp)")
#: what a save leaves beside ``path`` while it runs: ``.<name>.tmp-<token>``, ``.<name>.old-<token>``
TOKEN = r"[0-9a-f]{12}"


class MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, ``collections.OrderedDict`` and torch's dtype/layout/format objects."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint.") or (module, name) in {
                ("collections", "OrderedDict"), ("torch", "Size"), ("builtins", "set"),
                # rebuilds a layout from its name
                ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                ("pathlib", "PureWindowsPath")}:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                        torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(f"checkpoint metadata refers to {module}.{name}, which is not DCP metadata: "
                              "refusing to unpickle it (the checkpoint was not written by "
                              "torch.distributed.checkpoint)")


class SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def commit(path: Path, tmp: Path, token: str, manifest: dict, keep: int | None,
           files: dict | None = None) -> None:
    """Rank 0, once every rank's files are in ``tmp``: the manifest (with ``files``, every data file's size
    and checksum, and DCP's metadata file's), the atomic rename(s), ``keep``."""
    manifest["saved_ns"] = time.time_ns()
    if files is not None:
        manifest["files"] = {**files, METADATA: file_digest(tmp / METADATA)}
    write_json(tmp / MANIFEST, seal(manifest))
    if path.exists():
        old = path.parent / f".{path.name}.old-{token}"
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    fsync_dir(path.parent)
    if keep is not None:  # the newest keep - 1 others of the series stay beside path; only checkpoints count
        others = [d for d in series(path) if d != path]
        for stale in others[:max(0, len(others) - (keep - 1))]:
            shutil.rmtree(stale, ignore_errors=True)


def write_json(target: Path, data: dict) -> None:
    part = target.with_suffix(".part")
    with open(part, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, target)


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete(folder: Path, unreadable: list | None = None) -> list[Path]:
    """The complete checkpoints in ``folder``, oldest first; those whose manifest cannot be read are left
    out (appended to ``unreadable`` as ``(folder, the OS's or the parser's words)`` when it is given)."""
    found = []
    for d in folder.iterdir() if folder.is_dir() else []:
        if d.is_dir() and not d.name.startswith(".") and (d / MANIFEST).is_file():
            try:
                found.append((json.loads((d / MANIFEST).read_text()).get("saved_ns", 0), d))
            except (OSError, ValueError) as e:
                if unreadable is not None:
                    unreadable.append((d, str(e)))
    return [d for _, d in sorted(found)]


def series(path: Path) -> list[Path]:
    """The complete checkpoints beside ``path`` named like it up to its trailing digits (``step-000030``:
    ``step-*``), oldest first; a name without trailing digits is a series of one."""
    prefix = path.name.rstrip("0123456789")
    if prefix == path.name:
        return [path]
    return [d for d in complete(path.parent) if d.name.startswith(prefix) and d.name[len(prefix):].isdigit()
            and is_checkpoint(d)]


def foreign_entries(folder: Path) -> list[str]:
    """The names in ``folder`` that no perparam checkpoint holds (a user's notes, another tool's files)."""
    return sorted(e.name for e in folder.iterdir() if not (OWN_FILE.fullmatch(e.name) and e.is_file()))


def is_checkpoint(folder: Path) -> bool:
    """``folder`` is a perparam checkpoint, complete or damaged: a manifest and nothing but a checkpoint's
    files (so replacing it or pruning it with ``keep`` loses nothing else)."""
    return (folder.is_dir() and not folder.is_symlink() and (folder / MANIFEST).is_file()
            and not foreign_entries(folder))


def target_problem(raw, keep) -> str | None:
    """Why ``save``/``async_save`` must not write to ``raw`` (the path as given) with ``keep``, or ``None``:
    an empty path, one that names no folder of its own (``.``, ``..``, ``/``), a file, a symbolic link, a
    folder that is neither empty nor a perparam checkpoint; ``keep`` not ``None`` or a whole number >= 1."""
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        return (f"keep={keep!r}: pass how many checkpoints of the series to keep, 1 or more (the one saved "
                "included), or keep=None to keep them all")
    if not isinstance(raw, (str, os.PathLike)) or not os.fspath(raw):
        return f"the path {raw!r} is empty: pass the checkpoint's own folder, e.g. 'checkpoints/step-000100'"
    path = Path(raw)
    if path.name in ("", ".", ".."):
        return f"{os.fspath(raw)!r} names no folder of its own: pass the checkpoint's own folder inside it"
    if path.is_symlink():
        return f"{path} is a symbolic link: pass the folder itself"
    if path.exists() and not path.is_dir():
        return f"{path} is a file, not a perparam checkpoint: pass another path, or remove it yourself"
    if path.is_dir() and not is_checkpoint(path):
        listed = foreign_entries(path)
        if listed:
            shown = ", ".join(listed[:4]) + (f" and {len(listed) - 4} more" if len(listed) > 4 else "")
            return (f"{path} is a folder that is not a perparam checkpoint (it holds {shown}): a save "
                    "replaces only a perparam checkpoint or an empty folder; pass another path")
        if not (path / MANIFEST).is_file() and any(path.iterdir()):
            return (f"{path} holds checkpoint files but no {MANIFEST} (an unfinished or damaged checkpoint "
                    "of another tool?): pass another path, or remove it yourself")
    return None


def leftovers(path: Path, kind: str) -> list[Path]:
    """What a killed save of ``path`` left beside it: ``.<name>.<kind>-<token>`` folders (``tmp``,
    ``old``)."""
    pattern = re.compile(re.escape(f".{path.name}.{kind}-") + TOKEN)
    return [p for p in path.parent.glob(f".{path.name}.{kind}-*") if pattern.fullmatch(p.name) and p.is_dir()]


def survey(folder: str | os.PathLike) -> list[tuple[Path, str | None]]:
    """The checkpoints in ``folder`` (visible folders holding a manifest or DCP metadata; ``folder`` alone
    where it is a checkpoint itself, as ``latest`` takes it), newest first, each
    with what is wrong with it as far as it is known without reading the data (a missing, unreadable or
    changed manifest, a data file missing or of the wrong size), or ``None``. Newest: by the manifest's
    save time, or the folder's time where the manifest cannot be read."""
    found = []
    folder = Path(folder)
    # a checkpoint, not a folder of them
    itself = (folder / MANIFEST).exists() or (folder / METADATA).exists()
    for d in [folder] if itself else sorted(folder.iterdir()) if folder.is_dir() else []:
        if not itself and (d.name.startswith(".") or not d.is_dir() or not (
                (d / MANIFEST).exists() or (d / METADATA).exists())):
            continue
        when, problem = d.stat().st_mtime_ns, None
        if not (d / MANIFEST).is_file():
            found.append((when, d, f"{MANIFEST} is missing"))
            continue
        try:
            manifest = read_manifest(d)
            when = manifest.get("saved_ns", when)
            wrong = damage(d, manifest.get("files", {}), sorted(manifest.get("files", {})), hashes=False)
            if wrong:
                problem = f"{wrong[0][0]} {wrong[0][1]}"
        except CheckpointDamagedError as e:
            problem = f"{e.file} {e.what}"
        except CheckpointError as e:
            problem = str(e)
        found.append((when, d, problem))
    return [(d, problem) for _, d, problem in sorted(found, key=lambda t: (t[0], t[1].name), reverse=True)]


def latest(folder: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``folder`` (or ``folder`` itself if it is one), else ``None``; this
    process's ``async_save`` still in flight is waited for first. A newer folder whose manifest cannot be read
    (a truncated or damaged ``perparam_checkpoint.json``) is passed over with a ``UserWarning`` naming it,
    never in silence (:func:`survey` lists every checkpoint with what is wrong with it)."""
    background.wait_pending()
    folder = Path(folder)
    if (folder / MANIFEST).is_file():
        return folder
    unreadable: list = []
    found = complete(folder, unreadable)
    newest = found[-1] if found else None
    since = json.loads((newest / MANIFEST).read_text()).get("saved_ns", 0) if newest is not None else -1
    for d, why in sorted(unreadable):
        if d.stat().st_mtime_ns > since:
            warnings.warn(f"perparam.checkpoint.latest: passed over {d}: its {MANIFEST} cannot be read "
                          f"({why}); " + (f"the newest readable checkpoint is {newest}" if newest is not None
                             else "no other checkpoint is complete"), stacklevel=2)
    return newest


def read_manifest(path: Path) -> dict:
    if not path.is_dir():
        moved = sorted(path.parent.glob(f".{path.name}.old-*"))
        if moved and (moved[-1] / MANIFEST).is_file():
            raise CheckpointError(f"no checkpoint at {path}: a save was killed while replacing it; the "
                                  f"previous checkpoint is intact at {moved[-1]} (load it, or rename it back "
                                  f"to {path.name})")
        raise CheckpointError(f"no checkpoint at {path}: the folder does not exist")
    if not (path / MANIFEST).is_file():
        newest = latest(path)
        hint = (f"; it holds checkpoints, the newest is {newest} (perparam.checkpoint.latest)" if newest else
                ": a save that was interrupted before it finished, or a folder not written by "
                "perparam.checkpoint")
        raise CheckpointError(f"{path} is not a complete perparam checkpoint (no {MANIFEST}){hint}")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointDamagedError(path, MANIFEST,
                                     f"cannot be read (truncated or overwritten: {e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointDamagedError(path, MANIFEST, "is not a manifest (overwritten)")
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    changed = manifest_damage(manifest)
    if changed:
        raise CheckpointDamagedError(path, MANIFEST, changed)
    manifest.pop(MANIFEST_SUM, None)
    return manifest
