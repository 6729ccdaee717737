"""A perparam checkpoint's checksums: every file's size and SHA-256 in the manifest, taken by the rank that
wrote it (``DigestingWriter``: DCP's file writer that hashes what it has just written, in the write phase,
so the ranks hash in parallel), the manifest's own checksum, and the check at load (``damage``: which file
is missing, truncated, grown or changed in place), raised as ``perparam.errors.CheckpointDamagedError``; and
the naming of a full disk (``disk_full``).

Why SHA-256: strong (any flipped bit, truncation or overwrite is found, and two checkpoints' files never
pass for each other), in the standard library, and the fastest strong hash there on CPUs with SHA
instructions. zlib's CRC-32 (faster) is the IEEE polynomial, not CRC-32C, and at 32 bits it is an
error-detecting code, not a checksum two different files can be trusted not to share. The hashes' speeds
and the cost per save and load of SmolLM2-135M's checkpoint: ``checkpoint_checksums`` in
``benchmarks/README.md``.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter

HASH = "sha256"
MANIFEST_SUM = "manifest_sha256"
_CHUNK = 8 << 20


def file_digest(path: Path) -> dict:
    """``{"bytes": size, "sha256": hex}`` of one file (hashlib releases the GIL: a writer thread hashes
    while training runs)."""
    h = hashlib.new(HASH)
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return {"bytes": size, HASH: h.hexdigest()}


class DigestingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that, once this rank's files are written (and fsynced), takes each one's
    ``file_digest`` into ``digests`` (file name -> digest); the caller gathers them into the manifest."""

    def __init__(self, path, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        self.folder = Path(path)
        self.digests: dict[str, dict] = {}

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        names = sorted({r.storage_data.relative_path for r in future.wait()})
        self.digests = {name: file_digest(self.folder / name) for name in names}
        return future


def seal(manifest: dict) -> dict:
    """``manifest`` with its own checksum (over its canonical JSON without that key) under
    ``MANIFEST_SUM``."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_SUM}
    return {**body, MANIFEST_SUM: hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def manifest_damage(manifest: dict) -> str | None:
    """What is wrong with a parsed manifest's own checksum (``None``: intact, or written before checksums)."""
    if MANIFEST_SUM not in manifest:
        return None
    if seal(manifest)[MANIFEST_SUM] != manifest[MANIFEST_SUM]:
        return "was changed after the save (its checksum does not match its contents)"
    return None


def damage(folder: Path, files: dict[str, dict], names: list[str],
           hashes: bool = True) -> list[tuple[str, str]]:
    """``[(file, what is wrong)]`` for ``names`` of the manifest's ``files`` in ``folder``; sizes only
    without ``hashes``."""
    out = []
    for name in names:
        want, path = files[name], folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            out.append((name, "is missing"))
            continue
        if size < want["bytes"]:
            out.append((name,
                        f"is truncated: {size} of the {want['bytes']} bytes the save wrote (cut short, or "
                              "overwritten by a smaller file)"))
        elif size > want["bytes"]:
            out.append((name,
                        f"was overwritten: {size} bytes, the save wrote {want['bytes']} (replaced by a "
                              "larger file or appended to)"))
        elif hashes and file_digest(path)[HASH] != want[HASH]:
            out.append((name,
                        f"was changed in place: the same {size} bytes with another {HASH} than the save "
                              "recorded (a flipped bit, or overwritten with data of the same size)"))
    return out


def disk_full(exc: BaseException, folder: Path) -> str | None:
    """A note naming a full file system when ``exc`` (or a DCP failure inside it, or its chain) is ENOSPC or
    EDQUOT, or ``folder``'s file system has under 1 MiB left (torch's zip writer reports a short write as
    "unexpected pos ..."), else ``None``."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"{os.strerror(e.errno)} ({errno.errorcode[e.errno]}) on the file system holding {folder}"
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]
        todo += [e.__cause__, e.__context__]
    try:
        st = os.statvfs(folder if folder.exists() else folder.parent)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    if free < (1 << 20):
        return f"No space left on device (ENOSPC: {free} bytes free) on the file system holding {folder}"
    return None
