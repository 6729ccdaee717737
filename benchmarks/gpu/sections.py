"""The sections of ``benchmarks/gpu/check.py``: each is ``section(out, args)``, writes its figures into the
dict ``out`` as it goes (what it measured before a failure stays there) and raises on failure; the runner
isolates them. ``args`` is ``check.py``'s parsed command line (``device``, ``quick``, ``steps``, ``warmup``,
``batch``, ``sim_world``, ``sim_rank``, ``sim_steps``); ``args.device == "cpu"`` runs the same code on a
gloo world of one on CPU (what the test suite runs), ``"cuda"`` on NCCL and GPU 0.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist

from benchmarks.harness.configs import seeded_full_init, wrap_units
from benchmarks.harness.model import GPT, GPTConfig, make_batches

#: torch APIs perparam (or this check) uses that are private or recent: each probed by the environment
#: section, so a torch without one is named before the sections that need it fail
PROBED_APIS = (
    "torch.distributed.tensor._dtensor_spec.DTensorSpec", "torch.distributed.tensor._dtensor_spec.TensorMeta",
    "torch.distributed.tensor.placement_types._StridedShard",
    "torch.distributed._composable.contract.REGISTRY_KEY",
    "torch.distributed._composable.contract.RegistryItem", "torch._C._current_graph_task_id",
    "torch._C._functorch.peek_interpreter_stack", "torch.distributed.distributed_c10d._world",
    "torch.distributed.distributed_c10d._get_default_store", "torch.nn.utils.get_total_norm",
    "torch.nn.utils.clip_grads_with_norm_", "torch.utils.swap_tensors", "torch._chunk_cat",
    "torch.split_with_sizes_copy", "torch._foreach_copy_",
    "torch.optim.optimizer.register_optimizer_step_pre_hook",
    "torch.optim.optimizer.register_optimizer_step_post_hook",
    "torch.nn.modules.module.register_module_parameter_registration_hook",
    "torch.nn.modules.module.register_module_module_registration_hook", "torch.compiler.is_compiling",
    "torch.get_device_module", "torch.utils.weak.WeakIdKeyDictionary", "torch.distributed.fsdp.fully_shard",
    "torch.distributed.fsdp.MixedPrecisionPolicy",
    "torch.distributed.checkpoint.state_dict.set_model_state_dict",
    "torch.distributed.checkpoint.state_dict.StateDictOptions", "torch.distributed.pipelining.PipelineStage",
    "torch.distributed.device_mesh.init_device_mesh",
    "torch.testing._internal.distributed.fake_pg.FakeStore", "torch.cuda.set_sync_debug_mode",
    "torch.optim.Optimizer.register_state_dict_pre_hook", "torch.distributed.get_backend_config",
)

#: what one GPU cannot show, written by the environment section
NOT_CHECKED = [
    "world size 1 skips every collective (perparam copies; FSDP2's NCCL calls run on one rank): no NCCL-path "
    "defect (buffer reuse, stream order, a rank-dependent reduction) can show in the NCCL sections",
    "NCCL refuses two ranks on one GPU (ncclInvalidUsage, 'Duplicate GPU detected'), so there is no 2-rank "
    "NCCL run here; the two_ranks section runs 2 processes on gloo with the tensors on the GPU instead: "
    "perparam's CUDA-tensor paths at K = 2 and the communicator order, not NCCL's streams",
    "the deadlock of two NCCL communicators issued in a rank-dependent order (needs 2+ GPUs, ideally with "
    "CUDA_DEVICE_MAX_CONNECTIONS=1)",
    "the simulated 8-rank mesh (fake process group) completes collectives instantly and moves no data: its "
    "peak memory lacks the buffers in flight of a real all-gather/reduce-scatter overlap",
    "communication/computation overlap and the step time at K > 1",
]


def model_config(args) -> GPTConfig:
    return GPTConfig.quick() if args.quick else GPTConfig()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_port() -> str:
    """A TCP port of 127.0.0.1 nothing listens on now, as ``MASTER_PORT`` wants it (a string): the sections'
    stores (fixed ports collided with another run on a shared machine: ``EADDRINUSE``, the section failed)."""
    from benchmarks.harness.ports import free_port as pick

    return str(pick())


@contextlib.contextmanager
def world_of_one(device: str, port: str | None = None):
    """A 1-rank process group (NCCL on GPU 0 for ``"cuda"``, gloo for ``"cpu"``; ``MASTER_PORT`` ``port``,
    a free one by default); yields its 1D mesh; destroys the group (after ``gc.collect()``) on the way out."""
    import gc

    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port or free_port()
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield init_device_mesh(device, (1,))
    finally:
        gc.collect()
        dist.destroy_process_group()


def _resolve(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def environment(out: dict, args) -> None:
    """torch, CUDA, NCCL, the c10d names chosen, which ``PROBED_APIS`` this torch lacks, and
    ``NOT_CHECKED``."""
    from perparam.comm import c10d

    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    if args.device == "cuda":
        version = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    out["c10d_names"] = dict(c10d.NAMES)
    out["missing_apis"] = [name for name in PROBED_APIS if not _resolve(name)]
    out["not_checked"] = NOT_CHECKED


def _mp_bf16():
    import perparam

    return perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_perparam(model: GPT, mesh, mp_policy=None, **kwargs) -> list:
    """``perparam.fully_shard`` as ``configs.wrap_units`` wraps; returns each call's ``ParamGroup``."""
    import perparam
    from perparam.runtime.group import group_of

    groups = []
    for modules, raf in wrap_units(model):
        perparam.fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                             reshard_after_forward=raf, mp_policy=mp_policy, **kwargs)
        groups.append(group_of(modules[0]))
    return groups


def _full(cfg: GPTConfig) -> dict:
    """The seeded weights, a fresh dict each time (``set_model_state_dict`` changes the one it is given)."""
    return seeded_full_init(cfg, 0).state_dict()


def _perparam_model(cfg: GPTConfig, mesh, mp_policy=None, **kwargs) -> GPT:
    from perparam.full_state import load_full_state_dict

    with torch.device("meta"):
        model = GPT(cfg)
    shard_perparam(model, mesh, mp_policy, **kwargs)
    load_full_state_dict(model, _full(cfg))
    return model


def _fsdp2_model(cfg: GPTConfig, mesh, device: str, bf16: bool) -> GPT:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = GPT(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for modules, raf in wrap_units(model):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, reshard_after_forward=raf,
                    mp_policy=mp)
    model.to_empty(device=device)
    set_model_state_dict(model, _full(cfg),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def _ddp_model(cfg: GPTConfig, device: str):
    model = seeded_full_init(cfg, 0).to(device)
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if device == "cuda" else None)


def train_step(model, opt, x, y, autocast: str | None = None):
    """One training step (grads cleared, forward under ``autocast`` when given, backward, the optimizer
    step): the loss."""
    opt.zero_grad(set_to_none=True)
    with torch.autocast(autocast, torch.bfloat16) if autocast else contextlib.nullcontext():
        loss = model(x, y)
    loss.backward()
    opt.step()
    return loss


def parity(out: dict, args, steps: int = 3) -> None:
    """perparam vs FSDP2, fp32, world of one, the same weights and batch, ``steps`` AdamW steps: the largest
    parameter difference and the loss differences (fp32; the bar is 1e-5)."""
    cfg = model_config(args)
    with world_of_one(args.device) as mesh:
        x, y = (t.to(args.device) for t in make_batches(cfg, 1, args.batch)[0])
        pp = _perparam_model(cfg, mesh)
        f2 = _fsdp2_model(cfg, mesh, args.device, bf16=False)
        losses = {}
        for name, model in (("perparam", pp), ("fsdp2", f2)):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            losses[name] = [float(train_step(model, opt, x, y)) for _ in range(steps)]
        out["losses"] = losses
        want = {n: p.full_tensor() for n, p in f2.named_parameters()}
        diffs = {n: float((p.full_tensor() - want[n]).abs().max()) for n, p in pp.named_parameters()}
        out["max_param_diff"] = max(diffs.values())
        out["worst_param"] = max(diffs, key=diffs.get)
        out["max_loss_diff"] = max(abs(a - b) for a, b in zip(losses["perparam"], losses["fsdp2"]))
        out["within_1e-5"] = out["max_param_diff"] <= 1e-5 and out["max_loss_diff"] <= 1e-5


def interleaved_steps(runs: dict, warmup: int, steps: int, device: str, after_step=None,
                      after_warmup=None) -> None:
    """``warmup + steps`` rounds of each run's ``step()``, the order reversed every other round (pairing);
    appends the seconds of each step after the warm-up to ``run["times"]`` (synchronised on CUDA)."""
    for r in range(warmup + steps):
        for run in (list(runs.values()) if r % 2 == 0 else list(runs.values())[::-1]):
            _sync(device)
            t0 = time.perf_counter()
            run["step"]()
            _sync(device)
            if r >= warmup:
                run["times"].append(time.perf_counter() - t0)
            if after_step is not None:
                after_step(run)
        if r == warmup - 1 and after_warmup is not None:
            after_warmup()


def _streams_of_one_step(step) -> dict:
    """CUDA streams the kernels of ``step()`` ran on: {stream id: {"nccl": n, "compute": n}}."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    streams: dict = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        sid = str(getattr(e, "stream", None) or getattr(getattr(e, "kineto_info", None), "stream", "?"))
        kind = "nccl" if "nccl" in e.name.lower() else "compute"
        streams.setdefault(sid, {"nccl": 0, "compute": 0})[kind] += 1
    return streams


def step_time(out: dict, args) -> None:
    """perparam vs FSDP2 (both bf16 params, fp32 reduce) vs DDP (fp32 params under bf16 autocast), world of
    one, interleaved steps: median seconds, ratios, and (CUDA) the streams of one step."""
    cfg = model_config(args)
    with world_of_one(args.device) as mesh:
        x, y = (t.to(args.device) for t in make_batches(cfg, 1, args.batch)[0])
        models = {"perparam_bf16": (_perparam_model(cfg, mesh, _mp_bf16()), None),
                  "fsdp2_bf16": (_fsdp2_model(cfg, mesh, args.device, bf16=True), None),
                  "ddp_autocast_bf16": (_ddp_model(cfg, args.device), args.device)}
        runs = {}
        for name, (model, autocast) in models.items():
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            runs[name] = {"step": lambda m=model, o=opt, a=autocast: train_step(m, o, x, y, a), "times": []}
        interleaved_steps(runs, args.warmup, args.steps, args.device)
        for name, run in runs.items():
            out[name] = {"step_time_s": statistics.median(run["times"]), "final_loss": float(run["step"]())}
        out["ratio_perparam_vs_fsdp2"] = (out["perparam_bf16"]["step_time_s"]
                                          / out["fsdp2_bf16"]["step_time_s"])
        out["ratio_perparam_vs_ddp"] = (out["perparam_bf16"]["step_time_s"]
                                        / out["ddp_autocast_bf16"]["step_time_s"])
        if args.device == "cuda":
            for name, run in runs.items():
                out[name]["streams"] = _streams_of_one_step(run["step"])


def host_syncs(out: dict, args) -> None:
    """Host syncs of one step (after a warm-up step), forward + backward, ``clip_grad_norm_`` (perparam's;
    torch's for FSDP2; the norm not read) and the optimizer step apart, for perparam and FSDP2 (bf16): the
    calls that read device values or upload host data (``benchmarks/harness/host_syncs.py``, by site) and, on
    CUDA, the warnings of ``torch.cuda.set_sync_debug_mode("warn")``."""
    from benchmarks.harness.host_syncs import HostSyncCounter
    from perparam import clip_grad_norm_ as perparam_clip

    cfg = model_config(args)
    with world_of_one(args.device) as mesh:
        x, y = (t.to(args.device) for t in make_batches(cfg, 1, args.batch)[0])
        for name, model in (("perparam_bf16", _perparam_model(cfg, mesh, _mp_bf16())),
                            ("fsdp2_bf16", _fsdp2_model(cfg, mesh, args.device, bf16=True))):
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            clip = perparam_clip if name.startswith("perparam") else torch.nn.utils.clip_grad_norm_
            train_step(model, opt, x, y)
            clip(model.parameters(), 1.0)  # the warm-up's: perparam reads each mesh's axes at its first clip
            _sync(args.device)
            row = out[name] = {}
            for phase, run in (("forward_backward", lambda m=model: m(x, y).backward()),
                               # norm unread
                               ("clip_grad_norm", lambda m=model, c=clip: c(m.parameters(), 1.0)),
                               ("optimizer_step", lambda o=opt: (o.step(), o.zero_grad(set_to_none=True)))):
                with warnings.catch_warnings(record=True) as caught, HostSyncCounter() as counted:
                    warnings.simplefilter("always")
                    if args.device == "cuda":
                        torch.cuda.set_sync_debug_mode("warn")
                    try:
                        run()
                        _sync(args.device)
                    finally:
                        if args.device == "cuda":
                            torch.cuda.set_sync_debug_mode(0)
                row[phase] = {"counted": counted.total, "sites": dict(counted.sites),
                              "sync_debug_warnings": sum("synchroniz" in str(w.message) for w in caught)}


def cpu_tier(out: dict, args) -> None:
    """perparam with AdamW state in (pinned) host memory vs on the device, world of one, interleaved steps:
    step times, device memory between steps, bitwise parameters, copy waits. On CPU the tier is a no-op."""
    import perparam
    from perparam import OffloadPolicy

    cfg = model_config(args)
    with world_of_one(args.device) as mesh:
        x, y = (t.to(args.device) for t in make_batches(cfg, 1, args.batch)[0])
        runs = {}
        for name, offload in (("device", None), ("cpu_optimizer", OffloadPolicy("cpu", "optimizer"))):
            model = _perparam_model(cfg, mesh, _mp_bf16(), offload_policy=offload)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            runs[name] = {"model": model, "opt": opt, "step": lambda m=model, o=opt: train_step(m, o, x, y),
                          "times": [], "allocated": 0}
        perparam.offload.reset_stats()

        def after(run):
            run["allocated"] = torch.cuda.memory_allocated() if args.device == "cuda" else 0

        interleaved_steps(runs, args.warmup, args.steps, args.device, after_step=after,
                          after_warmup=perparam.offload.reset_stats)
        io = perparam.offload.stats()
        for name, run in runs.items():
            out[name] = {"step_time_s": statistics.median(run["times"]),
                         "allocated_bytes_between_steps": run["allocated"]}
        out["ratio_cpu_vs_device"] = out["cpu_optimizer"]["step_time_s"] / out["device"]["step_time_s"]
        out["offloaded_bytes"] = perparam.offload.offloaded_bytes().get("cpu", 0)
        out["allocated_fall_bytes"] = (out["device"]["allocated_bytes_between_steps"]
                                       - out["cpu_optimizer"]["allocated_bytes_between_steps"])
        params = {name: {n: p.full_tensor() for n, p in run["model"].named_parameters()}
                  for name, run in runs.items()}
        out["params_bitwise_equal"] = all(torch.equal(params["device"][n], t)
                                          for n, t in params["cpu_optimizer"].items())
        out["copy_wait_s_per_step"] = io["wait_s"] / args.steps
        out["copy_back_s_per_step"] = io["evict_s"] / args.steps
        # the offloaded state read between steps must read its values, not freed device memory: first as a
        # logging loop reads it (optimizer.state[p][key], host copies there), then through state_dict() (which
        # brings it in); each time whether each tensor's storage holds its bytes (no kernel runs), then, only
        # where every one does, the values against the run without offload
        def entries(opt):
            return [v.to_local() if hasattr(v, "to_local") else v for p in opt.param_groups[0]["params"]
                    for v in opt.state[p].values() if torch.is_tensor(v) and v.dim() > 0]

        def held(state):
            return [t.untyped_storage().nbytes() >= t.numel() * t.element_size() for t in state]

        direct = entries(runs["cpu_optimizer"]["opt"])
        out["state_entries_without_storage_between_steps"] = held(direct).count(False)
        if all(held(direct)):
            out["state_entries_equal_between_steps"] = all(
                torch.equal(a.cpu(), b.cpu()) for a, b in zip(direct, entries(runs["device"]["opt"])))
        state = [v.to_local() if hasattr(v, "to_local") else v
                 for s in runs["cpu_optimizer"]["opt"].state_dict()["state"].values() for v in s.values()
                 if torch.is_tensor(v)]
        out["state_tensors_without_storage_between_steps"] = held(state).count(False)
        if all(held(state)):
            out["state_finite_between_steps"] = all(bool(torch.isfinite(t).all()) for t in state)
