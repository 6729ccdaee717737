"""Shared by the checkpoint safety tests (``test_checkpoint_target.py``, ``test_checkpoint_integrity.py``):
a trained model with its optimizer state, of two kinds ("adamw": TinyNet with AdamW; "owner": Muon on
owner parameters plus AdamW, ``tests/owner_cases.recipe``), saved sync or async, its full state, and a bit
flipped inside one named record of a saved checkpoint, and a small tmpfs to fill (a real full disk)."""

from __future__ import annotations

import contextlib
import io
import pickle
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import perparam
from perparam import checkpoint
from tests.models import TinyNet, full_params, make_batches
from tests.owner_cases import recipe


def build(rank: int, world_size: int, kind: str):
    """``(model, optimizer)`` trained 2 steps (the optimizer: one, or a list for "owner")."""
    if kind == "owner":
        model, opt = recipe(rank, world_size)
    else:
        torch.manual_seed(0)
        model = TinyNet()
        if world_size:
            for block in model.blocks:
                perparam.fully_shard(block)
            perparam.fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, rank, world_size, 2)
    return model, opt


def train(model, opt, rank: int, world_size: int, n: int, seed: int = 0) -> None:
    k = world_size or 1
    for idx, y in make_batches(n, 12, seed=seed):
        if world_size:
            idx, y = idx[rank * 12 // k:(rank + 1) * 12 // k], y[rank * 12 // k:(rank + 1) * 12 // k]
        F.mse_loss(model(idx), y).backward()
        for o in opt if isinstance(opt, list) else [opt]:
            o.step()
            o.zero_grad()


def saved(model, path, opt, mode: str, **kw):
    """``checkpoint.save`` or ``async_save`` (waited for) of ``model`` and ``opt`` at ``path``."""
    if mode == "async":
        return checkpoint.async_save(path, model, opt, **kw).wait()
    return checkpoint.save(path, model, opt, **kw)


def state(model, opt) -> dict:
    """The full parameters and every optimizer state tensor (full), by name."""
    out = {f"param.{k}": v for k, v in full_params(model).items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for i, o in enumerate(opt if isinstance(opt, list) else [opt]):
        for p, s in o.state.items():
            for key, v in s.items():
                if isinstance(v, torch.Tensor) and v.ndim:
                    out[f"optim{i}.{names[id(p)]}.{key}"] = (v.full_tensor() if hasattr(v, "full_tensor")
                                                             else v).clone()
    return out


def record(path: Path, key_part: str) -> tuple[str, int, int]:
    """``(file, offset, length)`` of the first stored record whose key contains ``key_part``, from DCP's
    metadata (read with a plain unpickler: this is the test's own checkpoint)."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    for index, info in sorted(metadata.storage_data.items(), key=lambda kv: (kv[0].fqn, str(kv[0].offset))):
        if key_part in index.fqn and info.length > 64:
            return info.relative_path, info.offset, info.length
    raise KeyError(key_part)


def flip_bit(path: Path, key_part: str) -> str:
    """Flip one exponent bit of a float in the middle of the tensor bytes of ``key_part``'s record (a
    ``torch.save`` zip: its ``data/0`` entry, stored uncompressed); returns the file's name."""
    name, offset, length = record(path, key_part)
    data = bytearray((path / name).read_bytes())
    blob = bytes(data[offset:offset + length])
    entry = next(i for i in zipfile.ZipFile(io.BytesIO(blob)).infolist() if i.filename.endswith("/data/0"))
    start = entry.header_offset + 30 + int.from_bytes(blob[entry.header_offset + 26:entry.header_offset
                                                           + 28], "little") \
        + int.from_bytes(blob[entry.header_offset + 28:entry.header_offset + 30], "little")
    # float32, little-endian: the exponent's top
    data[offset + start + (entry.file_size // 8) * 4 + 3] ^= 0x40
    (path / name).write_bytes(bytes(data))
    return name


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str = "1m"):
    folder.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no mount command: a full file system cannot be made here")
    if done.returncode:
        pytest.skip(f"a small tmpfs cannot be mounted here ({done.stderr.strip()[:120]}): needs root")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
