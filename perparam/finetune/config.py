"""``JobConfig``: what one worker of ``perparam finetune`` runs, typed, built once from the command line
(:meth:`JobConfig.from_args`). Every phase of :mod:`~perparam.finetune.job` and every building block it calls
reads it, never ``argparse`` attributes. A leaf: it imports only :mod:`~perparam.finetune.lora`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from perparam.finetune import lora


@dataclass(frozen=True)
class JobConfig:
    """What one worker runs (the ``perparam finetune`` flags, after the launcher's checks)."""

    steps: int
    seq_len: int
    batch_size: int
    lr: float
    seed: int
    optimizer: str = "adamw"  # --optimizer: adamw, or muon (perparam.finetune.optimizers)
    config: str = "gguf"  # "gguf" or "tiny"
    gguf_path: str | None = None
    summary_json: str | None = None
    param_dtype: str | None = "fp32"  # None: bf16 under --qlora, else fp32
    param_dtype_by_default: bool = False  # not given on the command line: bf16 may become fp32 (job.py)
    quant: str = "none"
    grad_quant: str | None = None  # --grad-quant: KIND or PATTERN=KIND (train.parse_grad_quant)
    zero_stage: int = 3
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
    # where parameters' state lives (offload_flags.py)
    offload: list[str] | None = None
    memory_budget: int | str | None = None
    offload_dir: str | None = None

    def __post_init__(self) -> None:
        if self.param_dtype is None:
            object.__setattr__(self, "param_dtype", "bf16" if self.qlora else "fp32")
            object.__setattr__(self, "param_dtype_by_default", True)

    @classmethod
    def from_args(cls, args) -> JobConfig:
        """From an ``argparse.Namespace`` (or any object with these attributes; absent ones keep their
        defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def lora_config(self) -> lora.LoraConfig | None:
        """The adapters' :class:`~perparam.finetune.lora.LoraConfig` (None: full fine-tuning)."""
        return lora.lora_config(self.lora, self.lora_alpha, self.lora_targets, self.qlora, self.tp,
                                self.quant)
