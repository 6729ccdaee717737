"""The worker of ``perparam finetune``: its entry point :func:`run_job` runs three phases, as torchtitan
splits its trainer: ``setup`` (process group, meshes, model, ``fully_shard``, optimizer, resume),
``training_loop`` (the steps, checkpoints) and ``report`` (held-out loss, bytes, the summary), over the
building blocks of :mod:`~perparam.finetune.train`, :mod:`~perparam.finetune.evaluation`,
:mod:`~perparam.finetune.steps` and the others (none of which calls back here). ``JobConfig``
(:mod:`~perparam.finetune.config`) is the typed configuration, built once from the command line
(:meth:`JobConfig.from_args`); the phases and every helper they call read it, never ``argparse`` attributes.

Run by the launcher in :mod:`perparam.finetune.cli` (or by ``torchrun``) with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist

from perparam.finetune import (
    invariant_steps,
    lifecycle,
    lora,
    offload_flags,
    optimizers,
    peers,
    restart_times,
    snapshots,
    steps,
    throughput,
    train,
)
from perparam.finetune.checkpointing import finish_saves, optimizers_saved, resume_from, save_if_due
from perparam.finetune.config import JobConfig
from perparam.finetune.data import PreparedData, rank_slice
from perparam.finetune.errors import FinetuneInputError, write_output
from perparam.finetune.evaluation import heldout_loss, mean_over_ranks
from perparam.finetune.generate import Samples


@dataclass
class Run:
    """The state ``setup`` builds and the later phases use."""

    rank: int
    world: int
    device: torch.device
    meshes: object
    model: torch.nn.Module
    optimizer: optimizers.JobOptimizers  # AdamW, or Muon + AdamW (--optimizer)
    name: str
    params_total: int
    eval_rows: torch.Tensor
    micro: int
    loss_before: float
    first_step: int
    scheduler: object = None  # optimizers.JobSchedule: the learning-rate LambdaLR (schedule.py) on each
    model_cfg: object = None  # the model's LlamaConfig
    offload: object = None  # offload_flags.OffloadChoice: --offload / --memory-budget
    iu: object = None  # perparam.InvariantUnits under --invariant-units (invariant_steps.py), else None
    snapshots: object = None  # snapshots.JobSnapshots when the agent may restart the workers, else None
    clock: object = None  # restart_times.StartClock: this start's marks (began, ready, first step)


def evaluate(cfg: JobConfig, run: Run) -> float:
    """The held-out loss of the model now (a collective): summed in a K-independent order under
    ``--invariant-units`` (``invariant_steps.heldout_loss``), else over the ranks' micro-batches."""
    if run.iu is None:
        return heldout_loss(run.model, run.eval_rows, run.device, run.micro)
    unit_rows = cfg.batch_size // cfg.invariant_units  # chunks of a training unit's rows
    return invariant_steps.heldout_loss(run.model, run.eval_rows, run.device, unit_rows, cfg.invariant_units,
                                        run.meshes.dp_rank, run.meshes.dp_size, run.meshes.dp_group)


def setup(cfg: JobConfig, data: PreparedData) -> Run:
    """Process group, meshes, model, tensor parallelism and ``fully_shard``, the optimizers (AdamW, or
    Muon + AdamW), held-out loss before, and ``--resume``."""
    clock = restart_times.StartClock()
    rank, world, device = train.setup_distributed(cfg.pg_timeout)
    peers.record_roster()  # who is who, to name a peer that dies
    meshes = train.build_meshes(world, cfg.dp_replicate, cfg.tp, device.type)
    dims = meshes.dims
    lora_cfg = cfg.lora_config()
    offload = offload_flags.OffloadChoice(cfg.offload, cfg.memory_budget, cfg.offload_dir, dims.dp_shard,
                                          meshes.dp_mesh.get_coordinate()[-1])
    if lora_cfg is None:  # only rank 0 reads the GGUF; the others build on the meta device
        model, llama_cfg, name = train.build_sharded_model(cfg, device, meshes, offload=offload)
    else:  # adapters in and everything else frozen before sharding (one group per layer). Every rank
        # reads the GGUF here: QLoRA's NF4-stored base would need load_full_state_dict to quantize on load.
        model, llama_cfg, name = train.build_model(cfg, device)
        lora.apply_lora(model, lora_cfg, cfg.seed)
        train.shard_model(model, meshes, train.PARAM_DTYPES[cfg.param_dtype], train.QUANT_DTYPES[cfg.quant],
                          lora.layer_policy(lora_cfg), zero_stage=cfg.zero_stage, offload=offload,
                          grad_quant=cfg.grad_quant)
    params_total = sum(p.numel() for p in model.parameters())  # global sizes (DTensor.numel)
    iu = None
    if cfg.invariant_units is not None:  # the groups reduce in the units' tree order from here on
        iu = invariant_steps.build(model, cfg.invariant_units, cfg.grad_accum, cfg.seed)
    optimizer = optimizers.build(cfg.optimizer, model, lora.trainable_parameters(model), cfg.lr)
    scheduler = optimizers.JobSchedule(optimizer, cfg.lr, cfg.steps, cfg.warmup_steps, cfg.min_lr)
    layout = f"{dims.dp_shard} shard ranks"
    if dims.dp_replicate > 1:
        layout = f"{dims.dp_replicate} replicas x {layout} (HSDP)"
    if dims.tp > 1:
        layout += f" x {dims.tp} tensor-parallel ranks"
    if rank == 0:
        print(f"model {name}: {params_total:,} parameters, {llama_cfg.n_layers} layers sharded over {world} "
              f"ranks ({device.type}; {layout}; compute {cfg.param_dtype}, all-gather of the layers' "
              "Linear weights "
              f"{'nf4' if cfg.qlora else cfg.quant if cfg.quant != 'none' else cfg.param_dtype}"
              f"{'' if not cfg.grad_quant else f', gradient reduce-scatter {cfg.grad_quant}'}); text "
              f"{data.source}: {data.train.shape[0]} training rows and {data.heldout.shape[0]} held-out "
              f"rows of {data.seq_len} tokens", flush=True)
        if lora_cfg is not None:
            print(lora.describe(model, lora_cfg, params_total, cfg.param_dtype), flush=True)
        if cfg.optimizer != "adamw":
            print(f"optimizers: {optimizer.describe()}", flush=True)
        if offload.plan_line:
            print(offload.plan_line, flush=True)
    eval_rows = rank_slice(data.heldout, meshes.dp_rank, meshes.dp_size)
    micro = max(1, cfg.batch_size // meshes.dp_size)
    first_step = resume_from(cfg, model, optimizer, rank, scheduler)
    snaps = snapshots.JobSnapshots(cfg, model, optimizers_saved(optimizer)) if snapshots.enabled() else None
    restored = snaps.restore(cfg, model, optimizer, scheduler, rank, first_step) if snaps is not None else 0
    run = Run(rank, world, device, meshes, model, optimizer, name, params_total, eval_rows, micro,
              float("nan"), restored or first_step, scheduler, llama_cfg, offload, iu, snaps, clock)
    # "before" is the model this run starts from: the pretrained one, or the resumed checkpoint's (as the
    # samples "before" are); after a restart, the one the job started from (kept in the snapshot)
    from_snapshot = restored and snaps.fell_back is None  # not the --save checkpoint fallen back to
    run.loss_before = snaps.state.loss_before if from_snapshot else evaluate(cfg, run)
    first_step = run.first_step
    if rank == 0:
        # after a restart the value is the job's start's (kept in the snapshot), not this step's
        at = " (the job's start, kept in the snapshot)" if from_snapshot else (
            f" (step {first_step}, resumed)" if first_step else "")
        print(f"held-out loss before{at}: {run.loss_before:.4f}", flush=True)
    clock.ready()
    return run


@dataclass(frozen=True)
class LoopResult:
    train_losses: list[float]
    comm_per_step: dict[str, int]  # bytes per rank and step of perparam's collectives
    train_s: float
    lrs: list[float] = field(default_factory=list)  # the learning rate of each step run
    grad_norms: list[float] = field(default_factory=list)  # before clipping, per step (--max-grad-norm only)
    # (step, held-out loss): 0 and every --eval-every
    evals: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0  # training tokens per second of the optimizer steps (not evaluations, saves)
    throughput: dict = field(default_factory=dict)  # flops_per_token, matmul_peak_flops, mfu (throughput.py)


def training_loop(cfg: JobConfig, run: Run, data: PreparedData) -> LoopResult:
    """The optimizer steps from ``run.first_step`` to ``cfg.steps`` (``steps.optimizer_step``: gradient
    accumulation, clipping, the schedule); held-out loss every ``--eval-every`` steps; stops every rank on a
    non-finite loss."""
    from perparam import CommCounter
    from perparam.elastic import StepWatchdog

    stream = steps.step_stream(data.train, cfg.batch_size, cfg.grad_accum, cfg.seed)
    peak, _ = throughput.machine_peak(run.device, train.PARAM_DTYPES[cfg.param_dtype])  # FLOP/s, all ranks
    progress = train.Progress(run.rank == 0, cfg.steps)
    losses, lrs, norms, start, step_s = [], [], [], time.perf_counter(), 0.0
    evals = [(run.first_step, run.loss_before)]  # the held-out loss of the model this run starts from
    if run.snapshots is not None and run.snapshots.state.restored_at_step:  # a restart: what ran before it
        kept = run.snapshots.state
        losses, lrs, norms, evals = (list(kept.losses), list(kept.lrs), list(kept.norms),
                                     [tuple(e) for e in kept.evals])
    tokens_per_step = cfg.batch_size * cfg.grad_accum * data.seq_len
    # a stopped or hung rank is named and killed within --step-timeout (a dead one's path: the agent's)
    watchdog = StepWatchdog(cfg.step_timeout)
    with CommCounter() as comm, watchdog:  # perparam's collectives of the training steps (not tp's, eval's)
        for step in range(run.first_step, cfg.steps):
            if (cfg.crash_at_step is not None and step == cfg.crash_at_step and run.rank == run.world - 1
                    and not snapshots.restarts()):
                os._exit(17)  # test hook: a worker dying mid-run
            began = time.perf_counter()
            if run.iu is not None:  # the step's global rows, cut into the same units at every --nproc
                result = invariant_steps.optimizer_step(run.model, run.optimizer, run.scheduler, run.iu,
                                                        *stream.global_batch(step), step, run.device,
                                                        cfg.max_grad_norm)
                losses.append(float(result.loss))  # the units' tree mean: already the same on every rank
            else:  # [B / dp, seq] each: this rank's slices; the ranks of one tp group read the same rows
                batches = steps.micro_batches(stream, step, cfg.grad_accum, run.meshes.dp_rank,
                                              run.meshes.dp_size)
                result = steps.optimizer_step(run.model, run.optimizer, run.scheduler, batches, run.device,
                                              cfg.grad_accum, cfg.max_grad_norm)
                losses.append(mean_over_ranks(result.loss))
            step_s += time.perf_counter() - began
            watchdog.step()
            run.clock.first_step()
            if not math.isfinite(losses[-1]):  # the same mean on every rank: all stop here
                raise FinetuneInputError(f"the training loss became {losses[-1]} at step "
                                         f"{step + 1}/{cfg.steps}: pass a smaller --lr (this run: {cfg.lr})")
            lrs.append(result.lr)
            if result.grad_norm is not None:
                norms.append(result.grad_norm)
            done = step + 1 - run.first_step
            elapsed = time.perf_counter() - start
            lifecycle.step_done(step + 1, cfg.steps)  # before the display: what is shown is already recorded
            progress.update(step + 1, losses[-1], tokens_per_step * done / step_s, elapsed, lr=result.lr,
                            grad_norm=result.grad_norm, eta_s=elapsed / done * (cfg.steps - step - 1))
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                issued = len(comm.records)
                with watchdog.paused():  # not a step: its own (first_timeout) bound
                    evals.append((step + 1, evaluate(cfg, run)))
                del comm.records[issued:]  # the evaluation's all-gathers are not the training step's
                if run.rank == 0:
                    print(f"held-out loss at step {step + 1}: {evals[-1][1]:.4f}", flush=True)
            issued = len(comm.records)
            # in memory, every --snapshot-every steps: what a restart continues from
            if run.snapshots is not None:
                run.snapshots.commit(losses, lrs, norms, evals, run.loss_before, run.scheduler, run.clock)
            with watchdog.paused():
                save_if_due(cfg, run.model, run.optimizer, step + 1, run.rank, run.scheduler)
            del comm.records[issued:]  # nor a checkpoint's (Muon's momentum sent to its rows' ranks)
        finish_saves(cfg, run.rank)  # the last checkpoint, written while the loop went on
    progress.close()
    steps_run = cfg.steps - run.first_step
    kinds = ("all_gather", "reduce_scatter", "all_reduce",
             *(("all_to_all",) if cfg.optimizer == "muon" else ()))
    comm_per_step = {kind: comm.bytes(kind) // steps_run if steps_run else 0 for kind in kinds}  # all_to_all:
    # the owner path's exchange of the matrices Muon steps (gradient and parameter rows in, updated rows out)
    tokens_per_s = tokens_per_step * steps_run / step_s if steps_run else 0.0
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)  # global sizes (DTensor)
    flops = throughput.flops_per_token(run.model_cfg, data.seq_len, run.params_total, trainable)
    rates = {"flops_per_token": flops, "matmul_peak_flops": peak,
             "mfu": throughput.mfu(tokens_per_s, flops, peak)}
    if run.rank == 0 and steps_run:
        print(f"throughput: {tokens_per_s:,.0f} tokens/s, model FLOPs utilisation {100 * rates['mfu']:.1f}% "
              f"({rates['flops_per_token'] / 1e6:.0f} MFLOP/token against a measured matmul peak of "
              f"{peak / 1e9:.1f} GFLOP/s over {run.world} ranks)", flush=True)
    return LoopResult(losses, comm_per_step, time.perf_counter() - start, lrs, norms, evals, tokens_per_s,
                      rates)


def report(cfg: JobConfig, run: Run, data: PreparedData, loop: LoopResult, launched: float,
           exported: dict | None = None, extra: dict | None = None) -> dict:
    """Held-out loss after, model-state bytes per rank against ZeRO-3 (``perparam.memory``), the
    ``--plot``, the summary (with ``extra``'s keys added)."""
    from perparam.memory.measure import model_state_bytes, zero3_state_bytes

    dims = run.meshes.dims
    state_bytes = model_state_bytes(run.model, run.optimizer).as_dict()  # the last step's grads are alive
    per_unshard = train.all_gather_bytes_per_unshard(run.model)
    unsharded, zero3 = zero3_state_bytes(run.model)
    by_mode = None
    if dims.tp == 1:  # full / LoRA / QLoRA side by side (planned per parameter: 1D or HSDP only)
        from perparam.finetune import lora_memory

        by_mode = lora_memory.mode_comparison(run.model, run.optimizer, dims.dp_shard, cfg.lora_config(),
                                              cfg.zero_stage, train.PARAM_DTYPES[cfg.param_dtype])
    loss_after = evaluate(cfg, run)
    per_rank: list = [None] * run.world
    dist.all_gather_object(per_rank, state_bytes)
    label = train.zero3_label(dims.dp_replicate, dims.dp_shard, dims.tp)
    summary = {
        "world_size": run.world, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp,
        "param_dtype": cfg.param_dtype, "quant": "nf4 (stored)" if cfg.qlora else cfg.quant,
        "grad_quant": cfg.grad_quant or "none",
        "zero_stage": cfg.zero_stage, "optimizer": cfg.optimizer, "invariant_units": cfg.invariant_units,
        "steps": cfg.steps, "model": run.name, "params_total": run.params_total,
        "param_tensors": len(list(run.model.parameters())),
        "seq_len": data.seq_len, "global_batch_size": cfg.batch_size, "lr": cfg.lr, "seed": cfg.seed,
        "text": data.source, "heldout_rows": data.heldout.shape[0],
        "heldout_loss_before": run.loss_before, "heldout_loss_after": loss_after,
        "train_losses": loop.train_losses,
        "tokens_per_s": loop.tokens_per_s, **loop.throughput,
        "grad_accum": cfg.grad_accum, "step_batch_size": cfg.batch_size * cfg.grad_accum,
        "lrs": loop.lrs, "grad_norms": loop.grad_norms,
        "heldout_losses": [[s, x] for s, x in loop.evals] + [[cfg.steps, loss_after]],
        "first_step": run.first_step, "checkpoint": cfg.save,
        # {"dtype", "gather_s", "files": {path: {"bytes", "seconds"}}}; None without --export
        "export": exported,
        # bytes per rank and step of perparam's collectives (CommCounter's convention: an all-gather
        # counts its gathered output, a reduce-scatter its input); rank 0's, the same on every rank
        "comm_bytes_per_step": loop.comm_per_step,
        "all_gather_bytes_per_unshard": per_unshard,
        # the largest rank's live bytes (rank 0: torch.chunk puts any remainder rows first); grads
        # include the reduce-scatter padding, optimizer AdamW's step counters
        "model_state_bytes_per_rank": {k: max(r[k] for r in per_rank)
                                       for k in ("params", "grads", "optimizer")},
        "model_state_bytes_by_rank": per_rank,
        "model_state_bytes_unsharded": unsharded,
        "model_state_bytes_zero3_formula": zero3,
        "zero3_formula_k": label,
        "device": run.device.type,
        "lora": lora.record(cfg.lora_config()),
        "model_state_bytes_by_mode": by_mode,
    }
    if run.offload is not None and run.offload.active:  # every rank: a collective
        import perparam.offload

        perparam.offload.flush()
        by_rank: list = [None] * run.world
        dist.all_gather_object(by_rank, run.offload.summary())
        summary["offload"] = {"by_rank": by_rank, **perparam.offload.stats()}
    if run.rank == 0:
        print(f"held-out loss after:  {loss_after:.4f} (before {run.loss_before:.4f})", flush=True)
        train.print_memory_table(per_rank, unsharded, zero3, label, run.params_total)
        if by_mode is not None:
            lora_memory.print_mode_table(by_mode)
        for r, entry in enumerate(summary.get("offload", {}).get("by_rank", [])):
            tiers = sorted(set(entry["planned_bytes"]) | set(entry["measured_bytes"]))
            print(f"offload rank {r}: "
                  + ", ".join(f"{t} planned {entry['planned_bytes'].get(t, 0):,} bytes, measured "
                              f"{entry['measured_bytes'].get(t, 0):,}" for t in tiers), flush=True)
        print("perparam collectives per step and rank: "
              + ", ".join(f"{k} {v / 1024 ** 2:.2f} MiB" for k, v in loop.comm_per_step.items()), flush=True)
    summary.update(extra or {})
    summary["start_times"] = run.clock.record()  # this start's (restart_times.py)
    if run.snapshots is not None:
        summary.update(run.snapshots.summary())
    if run.rank == 0 and cfg.plot:
        from perparam.finetune.plot import write_run_plot

        print(f"plot written to {write_run_plot(cfg.plot, summary)}", flush=True)
    summary["wall_s"] = time.time() - launched
    if run.rank == 0 and cfg.summary_json:
        text = json.dumps(summary, indent=2) + "\n"
        write_output("--summary-json", cfg.summary_json, lambda tmp: Path(tmp).write_text(text))
        print(f"summary written to {cfg.summary_json}", flush=True)
    return summary


def hardware_compute_dtype(cfg: JobConfig) -> JobConfig:
    """``cfg`` with the compute dtype the hardware supports: ``--qlora``'s default bf16 becomes fp32 where
    bf16 matmuls are emulated (``throughput.compute_dtype``; one line says so). Starts the process group;
    a collective when the compute dtype is bf16 (every rank times a tiny bf16 and fp32 matmul)."""
    rank, _, device = train.setup_distributed(cfg.pg_timeout)
    if cfg.param_dtype != "bf16":
        return cfg
    dtype, line = throughput.compute_dtype(cfg.param_dtype, cfg.param_dtype_by_default,
                                           throughput.bf16_slowdown(device))
    if line and rank == 0:
        print(line, flush=True)
    return replace(cfg, param_dtype=dtype)


def run_job(cfg: JobConfig, data: PreparedData) -> dict:
    """The whole worker: ``setup``, ``training_loop``, ``--export``, ``report``; then frees the sharded
    model before the process group. Returns the summary dict (every rank; rank 0 writes the files)."""
    import contextlib
    import gc
    import sys

    from perparam.checkpoint import background as checkpoint_background

    launched = float(os.environ.get("PERPARAM_LAUNCH_TIME", time.time()))  # wall_s: from launch
    run = None
    try:
        cfg = hardware_compute_dtype(cfg)
        run = setup(cfg, data)
        samples = Samples(cfg, run)  # --generate (generate.py): sampled before training here, after it below
        loop = training_loop(cfg, run, data)
        exported = None
        if cfg.export:  # every rank gathers (collective), rank 0 writes
            from perparam.finetune.export import export_model

            merged = {} if cfg.lora is None else {"state_fn": lora.merged_state_dict}  # adapters merged in
            exported = export_model(run.model, run.model.cfg, cfg.export, cfg.export_dtype, cfg.gguf_path,
                                    **merged)
        summary = report(cfg, run, data, loop, launched, exported, samples.after())
        if run.snapshots is not None:  # the job is done: its snapshots leave this node's memory
            run.snapshots.close()
        return summary
    finally:
        # free the sharded model (reference cycles: hooks <-> groups) before the process group goes;
        # kept into interpreter teardown it was seen to abort the process at exit
        run = None  # noqa: F841
        with contextlib.suppress(Exception):  # on a failure's way out: a background write still running
            checkpoint_background.release()  # waited for (and its group dropped) before the groups go
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()

