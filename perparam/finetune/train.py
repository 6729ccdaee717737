"""The worker of ``perparam finetune``: one process of N, sharding the model with ``perparam.fully_shard``.

Run by the launcher in :mod:`perparam.finetune.cli` (or by ``torchrun``) with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set. Steps: process group (gloo on CPU, NCCL on CUDA,
with a timeout so a rank blocked on a dead peer fails instead of hanging), a 1D mesh over all ranks, the
model (GGUF weights, or a random ``tiny`` one), ``fully_shard`` per decoder layer then on the root, AdamW,
held-out loss before and after training (averaged over all held-out tokens of all ranks), a progress bar
on rank 0, and at the end a table of per-rank model-state bytes and the ``--summary-json`` file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from perparam.finetune.data import BatchStream, PreparedData, rank_slice
from perparam.finetune.model import Llama, LlamaConfig, next_token_loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def model_state_bytes(model: torch.nn.Module,
                      optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimizer state, counted from the live tensors.

    DTensors count their local shard (``to_local()``); everything else counts whole. Returns
    ``{"params": P, "grads": G, "optimizer": O}`` in bytes (``numel * element_size`` summed).
    """
    def nbytes(t: torch.Tensor) -> int:
        t = _local(t)
        return t.numel() * t.element_size()

    params = list(model.parameters())
    counts = {"params": sum(nbytes(p) for p in params),
              "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
              "optimizer": 0}
    if optimizer is not None:
        for state in optimizer.state.values():
            counts["optimizer"] += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return counts


def setup_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """Init the default process group from the launcher's environment; ``(rank, world, device)``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one core per rank; the launcher also sets OMP_NUM_THREADS=1
        backend = "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size(), device


def build_model(args, device: torch.device) -> tuple[Llama, LlamaConfig, str]:
    """``(model, cfg, name)``: the tiny random model (seeded, same on every rank) or the GGUF's weights."""
    if args.config == "tiny":
        torch.manual_seed(args.seed)
        cfg = LlamaConfig.tiny()
        model, name = Llama(cfg), "tiny (random init)"
    else:
        from perparam.finetune.gguf_loader import load_llama

        model, cfg = load_llama(args.gguf_path)
        name = Path(args.gguf_path).name
    return model.to(device), cfg, name


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, rows: torch.Tensor, device: torch.device, micro_batch: int) -> float:
    """Mean next-token loss (nats/token) over this rank's ``rows`` ``[n, seq+1]`` and all other ranks'.

    Every rank must hold the same number of rows (the sharded forward is a collective).
    """
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of token losses, token count]
    for chunk in rows.split(micro_batch):
        chunk = chunk.to(device)
        logits = model(chunk[:, :-1])  # [micro, seq, vocab]
        total[0] += next_token_loss(logits, chunk[:, 1:], reduction="sum").double()
        total[1] += chunk[:, 1:].numel()
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def _mean_over_ranks(x: torch.Tensor) -> float:
    x = x.detach().clone().double()
    dist.all_reduce(x)
    return x.item() / dist.get_world_size()


class Progress:
    """Rank 0's progress display: a rich progress bar on a terminal, one plain line per step otherwise."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.bar = enabled, total, None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=False)
            if self.console.is_terminal:
                from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

                self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                    TextColumn("loss {task.fields[loss]:.4f}"),
                                    TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeElapsedColumn(),
                                    console=self.console)
                self.task = self.bar.add_task("train", total=total, loss=float("nan"), tps=0.0)
                self.bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, elapsed_s: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=loss, tps=tokens_per_s)
        elif self.enabled:
            print(f"step {step}/{self.total}  loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  {elapsed_s:.1f} s",
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def print_memory_table(per_rank: list[dict[str, int]], params_total: int, world: int) -> dict[str, int]:
    """Rank 0: the rich table of live per-rank bytes against unsharded and ZeRO-3 ``(P+G+O)/K``.

    Returns the unsharded figures ``{"params", "grads", "optimizer"}`` (fp32 AdamW: 4, 4 and 8 bytes/param).
    """
    from rich.console import Console
    from rich.table import Table

    unsharded = {"params": 4 * params_total, "grads": 4 * params_total, "optimizer": 8 * params_total}
    mib = 1024 ** 2
    table = Table(title=f"Model state per rank (MiB), {world} ranks, {params_total:,} parameters")
    table.add_column("rank")
    for key in ("params", "grads", "optimizer", "total"):
        table.add_column(key, justify="right")
    for r, row in enumerate(per_rank):
        table.add_row(str(r), *(f"{row[k] / mib:.2f}" for k in ("params", "grads", "optimizer")),
                      f"{sum(row.values()) / mib:.2f}")
    table.add_row("unsharded (1 rank)", *(f"{unsharded[k] / mib:.2f}" for k in unsharded),
                  f"{sum(unsharded.values()) / mib:.2f}", style="dim")
    table.add_row(f"ZeRO-3 (P+G+O)/{world}", *(f"{unsharded[k] / world / mib:.2f}" for k in unsharded),
                  f"{sum(unsharded.values()) / world / mib:.2f}", style="bold")
    Console().print(table)
    return unsharded


def train(args, data: PreparedData) -> dict:
    """The whole worker; returns the summary dict (on every rank; rank 0 also prints and writes it)."""
    from perparam import fully_shard

    start = float(os.environ.get("PERPARAM_LAUNCH_TIME", time.time()))  # wall_s: from launch (or this worker)
    rank, world, device = setup_distributed(args.pg_timeout)
    try:
        mesh = init_device_mesh(device.type, (world,))
        model, cfg, name = build_model(args, device)
        params_total = sum(p.numel() for p in model.parameters())
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        if rank == 0:
            print(f"model {name}: {params_total:,} parameters, {cfg.n_layers} layers sharded over {world} "
                  f"ranks ({device.type}); text {data.source}: {data.train.shape[0]} training rows and "
                  f"{data.heldout.shape[0]} held-out rows of {data.seq_len} tokens", flush=True)
        eval_rows = rank_slice(data.heldout, rank, world)
        micro = max(1, args.batch_size // world)
        loss_before = heldout_loss(model, eval_rows, device, micro)
        if rank == 0:
            print(f"held-out loss before: {loss_before:.4f}", flush=True)

        stream = BatchStream(data.train, args.batch_size, args.seed)
        progress = Progress(rank == 0, args.steps)
        train_losses, train_start = [], time.perf_counter()
        tokens_per_step = args.batch_size * data.seq_len
        for step in range(args.steps):
            if args.crash_at_step is not None and step == args.crash_at_step and rank == world - 1:
                os._exit(17)  # test hook: a worker dying mid-run
            inputs, targets = (t.to(device) for t in stream.rank_batch(step, rank, world))  # [B/K, seq]
            optimizer.zero_grad(set_to_none=True)
            loss = next_token_loss(model(inputs), targets)
            loss.backward()
            optimizer.step()
            train_losses.append(_mean_over_ranks(loss))
            elapsed = time.perf_counter() - train_start
            progress.update(step + 1, train_losses[-1], tokens_per_step * (step + 1) / elapsed, elapsed)
        progress.close()
        train_s = time.perf_counter() - train_start
        state_bytes = model_state_bytes(model, optimizer)  # grads of the last step are still alive
        loss_after = heldout_loss(model, eval_rows, device, micro)
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, state_bytes)
        summary = {
            "world_size": world, "steps": args.steps, "model": name, "params_total": params_total,
            "seq_len": data.seq_len, "global_batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
            "text": data.source, "heldout_rows": data.heldout.shape[0],
            "heldout_loss_before": loss_before, "heldout_loss_after": loss_after,
            "train_losses": train_losses,
            "tokens_per_s": tokens_per_step * args.steps / train_s if args.steps else 0.0,
            # the largest rank's live bytes (rank 0: torch.chunk puts any remainder rows first)
            "model_state_bytes_per_rank": {k: max(r[k] for r in per_rank) for k in state_bytes},
            "model_state_bytes_by_rank": per_rank,
            "device": device.type,
        }
        if rank == 0:
            print(f"held-out loss after:  {loss_after:.4f} (before {loss_before:.4f})", flush=True)
            unsharded = print_memory_table(per_rank, params_total, world)
            summary["model_state_bytes_unsharded"] = unsharded
            summary["model_state_bytes_zero3_formula"] = {k: v / world for k, v in unsharded.items()}
        summary["wall_s"] = time.time() - start
        if rank == 0 and args.summary_json:
            out = Path(args.summary_json)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(summary, indent=2) + "\n")
            print(f"summary written to {out}", flush=True)
        return summary
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
