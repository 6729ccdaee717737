"""Building blocks of the ``perparam finetune`` worker; the worker itself is :mod:`perparam.finetune.job`
(its entry point ``run_job``, three phases from a typed ``JobConfig``), which calls these. No block calls
back into the job.

The blocks: the process group (gloo on CPU, NCCL on CUDA, with a timeout so a rank blocked on a dead peer
fails instead of hanging), one named mesh ``(dp_replicate, dp_shard, tp)`` over all ranks (:mod:`mesh`),
the model (GGUF weights, or a random ``tiny`` one), tensor parallelism inside each decoder layer when
``--tp`` > 1, ``fully_shard`` per decoder layer then on the root over the data-parallel mesh (1D, or 2D for
HSDP); rank 0's progress display and its table of per-rank model-state bytes. The held-out loss is in
:mod:`perparam.finetune.evaluation`.

Layout: rank ``r`` of the world mesh has tp coordinate ``r % T`` and data-parallel rank ``r // T`` (of
``R * S``). The global batch and the held-out rows are split over the data-parallel ranks only; the ``T``
ranks of one tensor-parallel group read the same rows.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from perparam import quant as _quant
from perparam.finetune.errors import FinetuneInputError
from perparam.finetune.model import Llama, LlamaConfig
from perparam.memory.measure import shard_factor  # noqa: F401 (re-exported for the job's tests)

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig

#: ``--param-dtype``: the dtype of the all-gathered parameters used in forward and backward (stored
#: shards, gradients and optimizer state stay fp32; gradients are reduced in fp32).
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: ``--quant``: the quantizer (``perparam.quant``) of the decoder layers' Linear weights on the all-gather
#: wire (communication only: the stored shards, the compute and the gradients are unchanged); nf4 sends
#: 0.5625 bytes per element (4-bit codes + an fp32 scale per 64).
QUANT_DTYPES = {"none": None, **{name: name for name in _quant.names()}}  # the registry's names
#: The Linear weights of one decoder layer, named relative to the layer (the module of one
#: ``fully_shard`` call): ``attn.{q,k,v,o}_proj.weight`` and ``mlp.{gate,up,down}_proj.weight``. Used only
#: on the layers' calls (the root's call holds the embedding and final norm, which it would not match).
LAYER_LINEAR_WEIGHTS = "*_proj.weight"
#: ``--grad-quant``'s kinds: the gradient reduce-scatter's wire format (``ParamPolicy.grad_quant``, ZeRO++
#: qgZ)
GRAD_QUANT_KINDS = ("none", "int8", "bf16")


def parse_grad_quant(spec: str | None) -> tuple[str, str] | None:
    """``--grad-quant``: ``KIND`` (the decoder layers' Linear weights, as ``--quant``) or ``PATTERN=KIND``
    (fnmatch on the names inside a decoder layer, e.g. ``mlp.*=int8``) -> ``(pattern, kind)``; ``None`` for
    ``none``. Raises ``FinetuneInputError`` for another kind or an empty pattern."""
    if spec is None:
        return None
    pattern, sep, kind = spec.rpartition("=")
    if not sep:
        pattern = LAYER_LINEAR_WEIGHTS
    if kind not in GRAD_QUANT_KINDS or not pattern:
        raise FinetuneInputError(f"--grad-quant {spec}: expected one of {', '.join(GRAD_QUANT_KINDS)}, or "
                                 f"PATTERN=KIND (e.g. '{LAYER_LINEAR_WEIGHTS}=int8')")
    return None if kind == "none" else (pattern, kind)
#: Tensor-parallel plan of one decoder layer: q/k/v and gate/up split their output features (heads,
#: MLP width) over the tp axis, o/down their input features; each layer's output is whole again.
TP_COLWISE = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
TP_ROWWISE = ("attn.o_proj", "mlp.down_proj")


def build_meshes(world: int, dp_replicate: int, tp: int, device_type: str):
    """The world mesh ``(dp_replicate, dp_shard, tp)`` and its sub-meshes (``mesh.Meshes``); collective.

    ``dp_shard`` takes the rest of the world. Raises :class:`FinetuneInputError` for sizes that do not
    multiply to ``world``.
    """
    import mesh

    try:
        dims = mesh.ParallelDims(dp_replicate=dp_replicate, dp_shard=-1, tp=tp, world_size=world)
    except mesh.MeshError as exc:
        raise FinetuneInputError(f"--dp-replicate {dp_replicate} and --tp {tp} do not fit {world} ranks "
                                 f"({exc})") from None
    return dims.build(device_type)


def tp_plan() -> dict:
    """``parallelize_module``'s plan for one :class:`~perparam.finetune.model.DecoderLayer`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {**{name: ColwiseParallel() for name in TP_COLWISE},
            **{name: RowwiseParallel() for name in TP_ROWWISE}}


def with_grad_quant(layer, layer_policy: dict | None, pattern: str, kind: str) -> dict:
    """``layer_policy`` (patterns relative to a decoder layer, first match wins) with ``grad_quant=kind``
    added to the policy of each parameter of ``layer`` that ``pattern`` matches
    (:func:`with_policy_fields`)."""
    return with_policy_fields(layer, layer_policy, pattern, grad_quant=kind)


def with_policy_fields(layer, layer_policy: dict | None, pattern: str, **fields) -> dict:
    """``layer_policy`` (patterns relative to a decoder layer, first match wins) with ``fields`` (e.g.
    ``grad_quant="int8"``, ``update="owner"``) set in the policy of each parameter of ``layer`` that
    ``pattern`` matches, as exact names ahead of the patterns, so such a parameter keeps what its first
    matching pattern gave it (``--quant``'s all-gather, QLoRA's NF4) instead of losing it to ``pattern``
    (``--quant int8 --grad-quant 'mlp.*=int8'`` used to drop the MLP weights' int8 all-gather). A
    ``pattern`` matching nothing is left as a pattern, for ``fully_shard`` to name."""
    import dataclasses
    import fnmatch

    from perparam import ParamPolicy

    policies = layer_policy or {}
    hits = [n for n, _ in layer.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
    if not hits:
        return {pattern: ParamPolicy(**fields), **policies}

    def own(name: str):
        return next((pp for pat, pp in policies.items() if fnmatch.fnmatchcase(name, pat)), None)

    exact = {n: dataclasses.replace(own(n) or ParamPolicy(), **fields) for n in hits}
    return {**exact, **{k: v for k, v in policies.items() if k not in exact}}


def shard_model(model: Llama, meshes, param_dtype: torch.dtype = torch.float32,
                quant: str | torch.dtype | None = None, layer_policy: dict | None = None,
                zero_stage: int = 3, offload=None, grad_quant: str | None = None,
                owner: str | None = None) -> Llama:
    """Tensor-parallelise each decoder layer (when the tp axis has more than one rank), then
    ``fully_shard`` each layer and the root over the data-parallel mesh; in place, returns ``model``.

    ``param_dtype`` other than fp32: ``MixedPrecisionPolicy(param_dtype, reduce_dtype=fp32)`` on every
    call. ``quant``: int8/fp8/nf4 all-gather of the layers' Linear weights (:data:`LAYER_LINEAR_WEIGHTS`).
    ``layer_policy``: more ``param_policy`` entries for the layers' calls (QLoRA's NF4 base weights,
    :func:`perparam.finetune.lora.layer_policy`). ``zero_stage``: ``ParamPolicy.zero_stage`` of every
    parameter (``--zero-stage``).
    ``offload``: an :class:`~perparam.finetune.offload_flags.OffloadChoice` (``--offload``,
    ``--memory-budget``). ``grad_quant``: ``--grad-quant`` (:func:`parse_grad_quant`): the layers' parameters
    it names reduce-scatter their gradients as int8 blocks or bf16 (``ParamPolicy.grad_quant``,
    ``docs/grad-quant.md``). ``owner``: a pattern inside a decoder layer whose parameters get
    ``ParamPolicy(update="owner")`` (``--optimizer muon``: the projection matrices Muon steps whole,
    ``docs/whole-matrix-optimizers.md``).
    """
    from perparam import MixedPrecisionPolicy, ParamPolicy, QuantPolicy, fully_shard

    mp = None
    if param_dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_policy = {**({LAYER_LINEAR_WEIGHTS: ParamPolicy(quant=QuantPolicy(quant))} if quant is not None
                       else {}),
                    **(layer_policy or {})} or None
    wire = parse_grad_quant(grad_quant)
    if wire is not None:  # merged into what each parameter it names gets from the other patterns
        layer_policy = with_grad_quant(model.layers[0], layer_policy, *wire)
    if owner is not None:  # likewise kept beside the other patterns' fields
        layer_policy = with_policy_fields(model.layers[0], layer_policy, owner, update="owner")
    root_policy = None
    if zero_stage != 3:  # every parameter: the patterns' policies, then a catch-all, all with the stage
        import dataclasses

        layer_policy = {**{k: dataclasses.replace(v, zero_stage=zero_stage)
                           for k, v in (layer_policy or {}).items()},
                        "*": ParamPolicy(zero_stage=zero_stage)}
        root_policy = {"*": ParamPolicy(zero_stage=zero_stage)}
    if offload is not None and offload.active:  # planned on the unsharded model, before any call
        layer_policy, root_policy = offload.policy(model, layer_policy), offload.policy(model, root_policy)
    tp = meshes.tp_mesh.size()
    for layer in model.layers:
        if tp > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(layer, meshes.tp_mesh, tp_plan())
        fully_shard(layer, mesh=meshes.dp_mesh, mp_policy=mp, param_policy=layer_policy)
    fully_shard(model, mesh=meshes.dp_mesh, mp_policy=mp, param_policy=root_policy)
    return model


def setup_distributed(timeout_s: float) -> tuple[int, int, torch.device]:
    """Init the default process group from the launcher's environment (unless done already); ``(rank,
    world, device)``."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    kwargs = {}
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
        kwargs["device_id"] = device  # NCCL's world communicator created here, on every rank alike
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # one core per rank; the launcher also sets OMP_NUM_THREADS=1
        backend = "gloo"
    if not dist.is_initialized():  # on a store of its own per restart of torch's elastic agent
        from perparam.session import init_process_group

        init_process_group(backend, timeout=timedelta(seconds=timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size(), device


def build_model(cfg: JobConfig, device: torch.device) -> tuple[Llama, LlamaConfig, str]:
    """``(model, model_cfg, name)``: the tiny random model (seeded, same on every rank) or the GGUF's
    weights (``cfg``: the job's ``config``, ``seed``, ``gguf_path``)."""
    if cfg.config == "tiny":
        torch.manual_seed(cfg.seed)
        model_cfg = LlamaConfig.tiny()
        model, name = Llama(model_cfg), "tiny (random init)"
    else:
        from perparam.finetune.gguf_loader import load_llama

        model, model_cfg = load_llama(cfg.gguf_path)
        name = Path(cfg.gguf_path).name
    return model.to(device), model_cfg, name


def owner_pattern(cfg: JobConfig) -> str | None:
    """The decoder-layer pattern of the parameters stepped whole by an owner rank: ``--optimizer muon``'s
    matrices, else none."""
    from perparam.finetune.optimizers import MUON_WEIGHTS

    return MUON_WEIGHTS if cfg.optimizer == "muon" else None


def build_sharded_model(cfg: JobConfig, device: torch.device, meshes, param_dtype: torch.dtype | None = None,
                        quant: str | None = None, offload=None) -> tuple[Llama, LlamaConfig, str]:
    """``(model, model_cfg, name)``: the model, sharded by :func:`shard_model`; collective.

    ``tiny``: the seeded random init on every rank, then sharded. GGUF: only rank 0 reads the file. Its
    :class:`LlamaConfig` is broadcast, every rank builds the model on the meta device and shards it, then
    rank 0 dequantises the weights and ``perparam.checkpoint.load_full_state_dict`` broadcasts them one tensor
    at a time, each rank keeping its shard (the model has no buffers to recompute: the rotary angles are made
    in every forward). ``param_dtype``/``quant`` default to ``cfg.param_dtype``/``cfg.quant``; ``offload``:
    see
    :func:`shard_model`.
    """
    from perparam.checkpoint import load_full_state_dict

    param_dtype = PARAM_DTYPES[cfg.param_dtype] if param_dtype is None else param_dtype
    quant = QUANT_DTYPES[cfg.quant] if quant is None else quant
    if cfg.config == "tiny":
        model, model_cfg, name = build_model(cfg, device)
        return (shard_model(model, meshes, param_dtype, quant, zero_stage=cfg.zero_stage, offload=offload,
                            grad_quant=cfg.grad_quant, owner=owner_pattern(cfg)), model_cfg, name)
    from perparam.finetune.gguf_loader import load_state_dict, open_gguf, read_config

    reader, box = None, [None]
    if dist.get_rank() == 0:
        reader = open_gguf(cfg.gguf_path)
        box = [read_config(reader, cfg.gguf_path)]
    dist.broadcast_object_list(box, src=0)
    model_cfg = box[0]
    model = shard_model(Llama(model_cfg, device="meta"), meshes, param_dtype, quant,
                        zero_stage=cfg.zero_stage, offload=offload, grad_quant=cfg.grad_quant,
                        owner=owner_pattern(cfg))
    load_full_state_dict(model, load_state_dict(reader, model_cfg) if reader is not None else None)
    return model, model_cfg, Path(cfg.gguf_path).name


class Progress:
    """Rank 0's progress display: a rich progress bar on a terminal (step, loss, learning rate, gradient norm,
    tokens/s, elapsed time and ETA), one plain line per step otherwise (``step N/T  loss ...``)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total, self.bar = enabled, total, None
        if enabled:
            from rich.console import Console

            self.console = Console(stderr=False)
            if self.console.is_terminal:
                from rich.progress import (
                    BarColumn,
                    Progress,
                    TextColumn,
                    TimeElapsedColumn,
                    TimeRemainingColumn,
                )

                self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                    TextColumn("loss {task.fields[loss]:.4f}"),
                                    TextColumn("lr {task.fields[lr]}"), TextColumn("{task.fields[norm]}"),
                                    TextColumn("{task.fields[tps]:,.0f} tok/s"), TimeElapsedColumn(),
                                    TextColumn("ETA"), TimeRemainingColumn(), console=self.console)
                self.task = self.bar.add_task("train", total=total, loss=float("nan"), tps=0.0, lr="-",
                                          norm="")
                self.bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, elapsed_s: float, lr: float | None = None,
               grad_norm: float | None = None, eta_s: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, loss=loss, tps=tokens_per_s,
                            lr="-" if lr is None else f"{lr:.2e}",
                            norm="" if grad_norm is None else f"grad-norm {grad_norm:.3f}")
        elif self.enabled:
            line = f"step {step}/{self.total}  loss {loss:.4f}"
            if lr is not None:
                line += f"  lr {lr:.2e}"
            if grad_norm is not None:
                line += f"  grad-norm {grad_norm:.3f}"
            line += f"  {tokens_per_s:,.0f} tok/s  {elapsed_s:.1f} s"
            if eta_s is not None:
                line += f"  ETA {eta_s:.0f} s"
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def zero3_label(dp_replicate: int, dp_shard: int, tp: int) -> str:
    """What ``K`` is in the memory table's ZeRO-3 row ``(P+G+O)/K``."""
    label = f"K = {dp_shard} shard ranks"
    if tp > 1:
        label = (f"K = {dp_shard} shard x {tp} tp ranks for the tensor-parallel weights, {dp_shard} for the "
                 "rest")
    if dp_replicate > 1:
        label += f"; each of the {dp_replicate} replicas holds a copy"
    return label


def all_gather_bytes_per_unshard(model: Llama) -> dict[str, int]:
    """Bytes one all-gather of each group moves (this rank, ``CommCounter``'s convention): ``layers``, all
    decoder layers once each (the groups ``--quant`` applies to), and ``root`` (embedding and final norm).
    A training step gathers each layer twice (forward, and again in backward) and the root once."""
    from perparam import CommCounter

    with CommCounter() as layers:
        for layer in model.layers:
            layer.unshard()
            layer.reshard()
    with CommCounter() as root:
        model.unshard()
        model.reshard()
    return {"layers": layers.bytes("all_gather"), "root": root.bytes("all_gather")}


def print_memory_table(per_rank: list[dict[str, int]], unsharded: dict[str, int], zero3: dict[str, float],
                       label: str, params_total: int) -> None:
    """Rank 0: the rich table of live per-rank bytes against unsharded and ZeRO-3 ``(P+G+O)/K``."""
    from rich.console import Console
    from rich.table import Table

    mib = 1024 ** 2
    keys = ("params", "grads", "optimizer")
    table = Table(title=f"Model state per rank (MiB), {len(per_rank)} ranks, {params_total:,} parameters",
                  caption="ranks: measured live storage, with the reduce-scatter padding (grads) and "
                  f"AdamW's step counters (optimizer); ZeRO-3: {label}")
    table.add_column("rank")
    for key in (*keys, "total"):
        table.add_column(key, justify="right")
    for r, row in enumerate(per_rank):
        table.add_row(str(r), *(f"{row[k] / mib:.2f}" for k in keys),
                      f"{sum(row[k] for k in keys) / mib:.2f}")
    table.add_row("unsharded (1 rank)", *(f"{unsharded[k] / mib:.2f}" for k in keys),
                  f"{sum(unsharded.values()) / mib:.2f}", style="dim")
    table.add_row("ZeRO-3 (P+G+O)/K", *(f"{zero3[k] / mib:.2f}" for k in keys),
                  f"{sum(zero3.values()) / mib:.2f}", style="bold")
    Console().print(table)

