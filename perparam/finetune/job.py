"""The worker of ``perparam finetune`` in three phases, as torchtitan splits its trainer: ``setup`` (process
group, meshes, model, ``fully_shard``, optimizer, resume), ``training_loop`` (the steps, checkpoints) and
``report`` (held-out loss, bytes, the summary). ``JobConfig`` is the typed configuration, built once from the
command line; the phases never read ``argparse`` attributes.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.distributed as dist

from perparam.finetune import lifecycle, lora, train
from perparam.finetune.checkpointing import resume_from, save_if_due
from perparam.finetune.data import BatchStream, PreparedData, rank_slice
from perparam.finetune.errors import FinetuneInputError
from perparam.finetune.model import next_token_loss


@dataclass(frozen=True)
class JobConfig:
    """What one worker runs (the ``perparam finetune`` flags, after the launcher's checks)."""

    steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    config: str = "gguf"  # "gguf" or "tiny"
    gguf_path: str | None = None
    summary_json: str | None = None
    param_dtype: str | None = "fp32"  # None: bf16 under --qlora, else fp32
    quant: str = "none"
    dp_replicate: int = 1
    tp: int = 1
    pg_timeout: float = 300.0
    crash_at_step: int | None = None  # test hook: the last rank dies at this step
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    lora: int | None = None  # LoRA rank (perparam.finetune.lora); None: full fine-tuning
    lora_alpha: float | None = None
    lora_targets: str | None = None
    qlora: bool = False
    export: list[str] | None = None  # --export paths (.gguf, .safetensors), written by rank 0 after training
    export_dtype: str = "f32"

    def __post_init__(self) -> None:
        if self.param_dtype is None:
            object.__setattr__(self, "param_dtype", "bf16" if self.qlora else "fp32")

    @classmethod
    def from_args(cls, args) -> JobConfig:
        """From an ``argparse.Namespace`` (or any object with these attributes; absent ones keep their
        defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


@dataclass
class Run:
    """The state ``setup`` builds and the later phases use."""

    rank: int
    world: int
    device: torch.device
    meshes: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    name: str
    params_total: int
    eval_rows: torch.Tensor
    micro: int
    loss_before: float
    first_step: int


def setup(cfg: JobConfig, data: PreparedData) -> Run:
    """Process group, meshes, model, tensor parallelism and ``fully_shard``, AdamW, held-out loss before,
    and ``--resume``."""
    rank, world, device = train.setup_distributed(cfg.pg_timeout)
    meshes = train.build_meshes(world, cfg.dp_replicate, cfg.tp, device.type)
    dims = meshes.dims
    lora_cfg = lora.config_from_args(cfg)
    if lora_cfg is None:  # only rank 0 reads the GGUF; the others build on the meta device
        model, llama_cfg, name = train.build_sharded_model(cfg, device, meshes)
    else:  # adapters in and everything else frozen before sharding (one group per layer). Every rank
        # reads the GGUF here: QLoRA's NF4-stored base would need load_full_state_dict to quantize on load.
        model, llama_cfg, name = train.build_model(cfg, device)
        lora.apply_lora(model, lora_cfg, cfg.seed)
        train.shard_model(model, meshes, train.PARAM_DTYPES[cfg.param_dtype], train.QUANT_DTYPES[cfg.quant],
                          lora.layer_policy(lora_cfg))
    params_total = sum(p.numel() for p in model.parameters())  # global sizes (DTensor.numel)
    optimizer = torch.optim.AdamW(lora.trainable_parameters(model), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    layout = f"{dims.dp_shard} shard ranks"
    if dims.dp_replicate > 1:
        layout = f"{dims.dp_replicate} replicas x {layout} (HSDP)"
    if dims.tp > 1:
        layout += f" x {dims.tp} tensor-parallel ranks"
    if rank == 0:
        print(f"model {name}: {params_total:,} parameters, {llama_cfg.n_layers} layers sharded over {world} "
              f"ranks ({device.type}; {layout}; compute {cfg.param_dtype}, all-gather of the layers' "
              f"Linear weights {'nf4' if cfg.qlora else cfg.quant if cfg.quant != 'none' else cfg.param_dtype}); text "
              f"{data.source}: {data.train.shape[0]} training rows and {data.heldout.shape[0]} held-out "
              f"rows of {data.seq_len} tokens", flush=True)
        if lora_cfg is not None:
            print(lora.describe(model, lora_cfg, params_total), flush=True)
    eval_rows = rank_slice(data.heldout, meshes.dp_rank, meshes.dp_size)
    micro = max(1, cfg.batch_size // meshes.dp_size)
    loss_before = train.heldout_loss(model, eval_rows, device, micro)
    if rank == 0:
        print(f"held-out loss before: {loss_before:.4f}", flush=True)
    first_step = resume_from(cfg, model, optimizer, rank)
    return Run(rank, world, device, meshes, model, optimizer, name, params_total, eval_rows, micro, loss_before,
               first_step)


@dataclass(frozen=True)
class LoopResult:
    train_losses: list[float]
    comm_per_step: dict[str, int]  # bytes per rank and step of perparam's collectives
    train_s: float


def training_loop(cfg: JobConfig, run: Run, data: PreparedData) -> LoopResult:
    """The optimizer steps from ``run.first_step`` to ``cfg.steps``; stops every rank on a non-finite loss."""
    from perparam import CommCounter

    stream = BatchStream(data.train, cfg.batch_size, cfg.seed)
    progress = train.Progress(run.rank == 0, cfg.steps)
    losses, start = [], time.perf_counter()
    tokens_per_step = cfg.batch_size * data.seq_len
    with CommCounter() as comm:  # perparam's collectives of the training steps (not tp's, not eval's)
        for step in range(run.first_step, cfg.steps):
            if cfg.crash_at_step is not None and step == cfg.crash_at_step and run.rank == run.world - 1:
                os._exit(17)  # test hook: a worker dying mid-run
            # [B / dp, seq]: this data-parallel rank's slice; the ranks of one tp group read the same rows
            inputs, targets = (t.to(run.device)
                               for t in stream.rank_batch(step, run.meshes.dp_rank, run.meshes.dp_size))
            run.optimizer.zero_grad(set_to_none=True)
            loss = next_token_loss(run.model(inputs), targets)
            loss.backward()
            run.optimizer.step()
            losses.append(train._mean_over_ranks(loss))
            if not math.isfinite(losses[-1]):  # the same mean on every rank: all stop here
                raise FinetuneInputError(f"the training loss became {losses[-1]} at step {step + 1}/{cfg.steps}: "
                                         f"pass a smaller --lr (this run: {cfg.lr})")
            elapsed = time.perf_counter() - start
            lifecycle.step_done(step + 1, cfg.steps)  # before the display: what is shown is already recorded
            progress.update(step + 1, losses[-1], tokens_per_step * (step + 1 - run.first_step) / elapsed, elapsed)
            save_if_due(cfg, run.model, run.optimizer, step + 1, run.rank)
    progress.close()
    steps_run = cfg.steps - run.first_step
    comm_per_step = {kind: comm.bytes(kind) // steps_run if steps_run else 0
                     for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    return LoopResult(losses, comm_per_step, time.perf_counter() - start)


def report(cfg: JobConfig, run: Run, data: PreparedData, loop: LoopResult, launched: float,
           exported: dict | None = None) -> dict:
    """Held-out loss after, model-state bytes per rank against ZeRO-3 (``perparam.memory``), the summary."""
    from perparam.memory.measure import model_state_bytes, zero3_state_bytes

    dims = run.meshes.dims
    state_bytes = model_state_bytes(run.model, run.optimizer).as_dict()  # the last step's grads are alive
    per_unshard = train.all_gather_bytes_per_unshard(run.model)
    unsharded, zero3 = zero3_state_bytes(run.model)
    by_mode = None
    if dims.tp == 1:  # full / LoRA / QLoRA side by side (planned per parameter: 1D or HSDP only)
        from perparam.finetune import lora_memory

        by_mode = lora_memory.mode_comparison(run.model, run.optimizer, dims.dp_shard, lora.config_from_args(cfg))
    loss_after = train.heldout_loss(run.model, run.eval_rows, run.device, run.micro)
    per_rank: list = [None] * run.world
    dist.all_gather_object(per_rank, state_bytes)
    label = train.zero3_label(dims.dp_replicate, dims.dp_shard, dims.tp)
    steps_run = cfg.steps - run.first_step
    summary = {
        "world_size": run.world, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
        "param_dtype": cfg.param_dtype, "quant": cfg.quant,
        "steps": cfg.steps, "model": run.name, "params_total": run.params_total,
        "param_tensors": len(list(run.model.parameters())),
        "seq_len": data.seq_len, "global_batch_size": cfg.batch_size, "lr": cfg.lr, "seed": cfg.seed,
        "text": data.source, "heldout_rows": data.heldout.shape[0],
        "heldout_loss_before": run.loss_before, "heldout_loss_after": loss_after,
        "train_losses": loop.train_losses,
        "tokens_per_s": cfg.batch_size * data.seq_len * steps_run / loop.train_s if steps_run else 0.0,
        "first_step": run.first_step, "checkpoint": cfg.save,
        "export": exported,  # {"dtype", "gather_s", "files": {path: {"bytes", "seconds"}}}; None without --export
        # bytes per rank and step of perparam's collectives (CommCounter's convention: an all-gather
        # counts its gathered output, a reduce-scatter its input); rank 0's, the same on every rank
        "comm_bytes_per_step": loop.comm_per_step,
        "all_gather_bytes_per_unshard": per_unshard,
        # the largest rank's live bytes (rank 0: torch.chunk puts any remainder rows first); grads
        # include the reduce-scatter padding, optimizer AdamW's step counters
        "model_state_bytes_per_rank": {k: max(r[k] for r in per_rank) for k in ("params", "grads", "optimizer")},
        "model_state_bytes_by_rank": per_rank,
        "model_state_bytes_unsharded": unsharded,
        "model_state_bytes_zero3_formula": zero3,
        "zero3_formula_k": label,
        "device": run.device.type,
        "lora": lora.checkpoint_extra(cfg)["lora"],
        "model_state_bytes_by_mode": by_mode,
    }
    if run.rank == 0:
        print(f"held-out loss after:  {loss_after:.4f} (before {run.loss_before:.4f})", flush=True)
        train.print_memory_table(per_rank, unsharded, zero3, label, run.params_total)
        if by_mode is not None:
            lora_memory.print_mode_table(by_mode)
        print("perparam collectives per step and rank: "
              + ", ".join(f"{k} {v / 1024 ** 2:.2f} MiB" for k, v in loop.comm_per_step.items()), flush=True)
    summary["wall_s"] = time.time() - launched
    if run.rank == 0 and cfg.summary_json:
        out = Path(cfg.summary_json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"summary written to {out}", flush=True)
    return summary


def run_job(cfg: JobConfig, data: PreparedData) -> dict:
    """``setup``, ``training_loop``, ``report``; then frees the sharded model before the process group."""
    import gc
    import sys

    launched = float(os.environ.get("PERPARAM_LAUNCH_TIME", time.time()))  # wall_s: from launch
    run = None
    try:
        run = setup(cfg, data)
        loop = training_loop(cfg, run, data)
        exported = None
        if cfg.export:  # every rank gathers (collective), rank 0 writes
            from perparam.finetune.export import export_model

            merged = {} if cfg.lora is None else {"state_fn": lora.merged_state_dict}  # adapters merged in
            exported = export_model(run.model, run.model.cfg, cfg.export, cfg.export_dtype, cfg.gguf_path, **merged)
        return report(cfg, run, data, loop, launched, exported)
    finally:
        # free the sharded model (reference cycles: hooks <-> groups) before the process group goes;
        # kept into interpreter teardown it was seen to abort the process at exit
        run = None  # noqa: F841
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
