"""What the checkpoint checksums cost: ``perparam.checkpoint.save`` and ``load`` of SmolLM2-135M (the main
job's pretrained model, fp32, 134.5M parameters) with its AdamW state, with and without the SHA-256 of every
file, paired round by round.

    python -m benchmarks.checkpoint_checksums [--assets .cache/assets] [--rounds 3] [--no-optimizer] \\
        [--json out.json]

One process, no process group (the bytes are those of any world size's checkpoint; with K ranks each rank
hashes the files it wrote at save and 1/K of the files at load). Each round, in alternating order: a save
with checksums and one without (``DigestingWriter.write_data`` swapped for DCP's own for that save: no
file is hashed, the manifest lists only DCP's metadata), then ``load(verify=True)`` and
``load(verify=False)`` of the checksummed checkpoint; plus the hash pass alone (``file_digest`` of every
file). The files are read back from the page cache (a checkpoint just written, as in a resume on the same
machine); a cold read from disk costs more for both. Prints seconds per round and the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def _no_checksums():
    from torch.distributed.checkpoint import FileSystemWriter

    from perparam.checkpoint import integrity as checkpoint_integrity

    hashing = checkpoint_integrity.DigestingWriter.write_data
    checkpoint_integrity.DigestingWriter.write_data = FileSystemWriter.write_data
    try:
        yield
    finally:
        checkpoint_integrity.DigestingWriter.write_data = hashing


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", default=str(ROOT / ".cache" / "assets"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-optimizer", action="store_true", help="the model alone, without AdamW state")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    import torch

    from perparam import checkpoint
    from perparam.checkpoint.integrity import file_digest
    from perparam.finetune.gguf_loader import find_gguf, load_llama

    torch.set_num_threads(1)
    model, _ = load_llama(find_gguf(args.assets))
    opt = None
    if not args.no_optimizer:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(0))
        model(ids[:, :-1]).float().logsumexp(-1).mean().backward()  # any gradient: AdamW's state exists
        opt.step()
        opt.zero_grad(set_to_none=True)
    root = Path(tempfile.mkdtemp(prefix="perparam-checksums-", dir=args.dir))
    rows = []
    try:
        for r in range(args.rounds):
            row = {}
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            for mode in order:
                target = root / f"{mode}-{r}"
                with _no_checksums() if mode == "off" else contextlib.nullcontext():
                    row[f"save_{mode}_s"] = _timed(lambda t=target: checkpoint.save(t, model, opt, keep=None))
            files = sorted((root / f"on-{r}").iterdir())
            row["bytes"] = sum(f.stat().st_size for f in files)
            row["hash_only_s"] = _timed(lambda fs=files: [file_digest(f)
                                                          for f in fs if f.name != checkpoint.MANIFEST])
            for verify in ((True, False) if r % 2 == 0 else (False, True)):
                key = f"load_{'on' if verify else 'off'}_s"
                row[key] = _timed(lambda v=verify, p=root
                                  / f"on-{r}": checkpoint.load(p, model, opt, verify=v))
            for mode in order:
                shutil.rmtree(root / f"{mode}-{r}")
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    keys = [k for k in rows[0] if k.endswith("_s")]
    medians = {k: statistics.median(row[k] for row in rows) for k in keys}
    summary = {"bytes": rows[0]["bytes"], "rounds": rows, "median": medians,
               "save_cost_s": medians["save_on_s"] - medians["save_off_s"],
               "load_cost_s": medians["load_on_s"] - medians["load_off_s"],
               "cpu": os.cpu_count(), "load_average": os.getloadavg()[0]}
    print(f"SmolLM2-135M checkpoint{'' if opt else ' (model only)'}: {summary['bytes'] / 1e6:.0f} MB; median "
          f"of {args.rounds}: save {medians['save_off_s']:.2f} s -> {medians['save_on_s']:.2f} s with "
          f"checksums (+{summary['save_cost_s']:.2f} s), load {medians['load_off_s']:.2f} s -> "
          f"{medians['load_on_s']:.2f} s verified (+{summary['load_cost_s']:.2f} s); the hash pass alone "
          f"{medians['hash_only_s']:.2f} s (load average {summary['load_average']:.1f} on {summary['cpu']} "
          "CPUs)")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
