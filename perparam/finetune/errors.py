"""The one exception type of the main job, bad input the user can fix reported as one line, and the output
paths: proven writable before any worker starts, written whole or not at all after the run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path


class FinetuneInputError(ValueError):
    """Bad user input (missing or corrupt asset, wrong architecture, empty text, impossible sizes, an output
    path that cannot be written).

    The message is one line that says what is wrong and what to do; the CLI prints it as
    ``perparam finetune: error: <message>`` and exits with status 2, without a traceback.
    """


def check_output_path(flag: str, path: str | os.PathLike | None, folder: bool = False) -> None:
    """Prove that ``path`` (the value of the output flag ``flag``) can be written by writing there now, and
    leave nothing behind: the missing folders above it are created (then removed, deepest first), then

    - a file path (``folder=False``): the file itself is created empty and removed; next to an existing
      file, a probe file is created and removed instead (the file is left as it is: every writer replaces
      it through a temporary file in the same folder, :func:`write_output`);
    - a folder (``folder=True``, ``--save DIR``): DIR is created if missing and a probe folder inside it
      created and removed (checkpoints are folders inside DIR).

    Raises :class:`FinetuneInputError` (one line naming ``flag`` and ``path``) for a folder where a file
    is wanted or the reverse, a file in the way of a folder above it, or any refusal by the file system
    (no such folder as under ``/proc``, permission, read-only, name too long). As root, permission bits
    refuse nothing: only what the file system itself refuses is found.
    """
    if not path:
        return
    out = Path(path).absolute()
    if folder and out.exists() and not out.is_dir():
        raise FinetuneInputError(f"{flag} {path} is a file: pass a folder")
    if not folder and out.is_dir():
        raise FinetuneInputError(f"{flag} {path} is a folder: pass a file path")
    created: list[Path] = []
    try:
        _make_folders(flag, path, out if folder else out.parent, created)
        probe_name = f".perparam-check-{os.getpid()}"
        if folder:
            probe = out / probe_name
            probe.mkdir()
            probe.rmdir()
        elif out.exists():
            _create_and_remove(out.parent / f".{out.name}{probe_name}")
        else:
            _create_and_remove(out)
    except OSError as exc:
        raise FinetuneInputError(f"{flag} {path} cannot be written ({exc.strerror or exc}): pass another "
                                 "path") from None
    finally:
        for made in reversed(created):
            with contextlib.suppress(OSError):
                made.rmdir()


def _make_folders(flag: str, path, folder: Path, created: list[Path]) -> None:
    """Create ``folder`` and its missing parents, appending each one made to ``created`` (top first)."""
    missing = []
    above = folder
    while not above.exists() and above != above.parent:
        missing.append(above)
        above = above.parent
    if not above.is_dir():
        raise FinetuneInputError(f"{flag} {path} cannot be written: {above} is a file, not a folder")
    for made in reversed(missing):
        try:
            made.mkdir()
        except OSError as exc:
            raise FinetuneInputError(f"{flag} {path} cannot be written: the folder {made} cannot be created "
                                     f"({exc.strerror or exc}): pass another path") from None
        created.append(made)


def _create_and_remove(file: Path) -> None:
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(fd)
    file.unlink()


def write_output(flag: str, path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a temporary file next to ``path`` (folders above created), then rename it over
    ``path``: a run killed mid-write leaves no partial file. The file gets the permissions ``open()``
    would give it. An ``OSError`` becomes a one-line :class:`FinetuneInputError` naming ``flag``."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    umask = os.umask(0)
    os.umask(umask)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(str(tmp))
        os.chmod(tmp, 0o666 & ~umask)  # some writers (safetensors) make it 0600
        os.replace(tmp, target)
    except OSError as exc:
        raise FinetuneInputError(f"{flag} {path} could not be written ({exc.strerror or exc}): free space or "
                                 "pass another path") from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
