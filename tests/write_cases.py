"""The write-kind table of ``tests/test_writes_seen.py``: every way a user or a library writes a parameter's
values (``METHODS``) against every way perparam keeps unsharded storage across that write (``MODES``). A cell
runs ``Linear(3, 5) -> Linear(5, 2)`` (uneven and, over 3-4 ranks, empty shards), each Linear and the root
sharded, fills the kept storage, writes ``model[0]`` (or steps every parameter), and returns the next
forward's output, or the type name of the error that refused the write."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

#: storage kept across the write, and how it is filled before it; and hpZ's rows kept after a forward
#: (``reshard_after_forward=2``: on 4 ranks only)
MODES = ("stage3", "stage1", "stage2", "kept_after_forward", "kept_after_backward", "eval_kept", "offload")
HPZ = "hpz"
METHODS = ("mul_", "foreach_mul_", "ema_foreach_lerp_", "data_full", "data_dtensor", "data_mul_", "copy_",
           "init_normal_", "init_trunc_normal_", "reset_parameters", "load_state_dict",
           "set_model_state_dict", "sgd_foreach", "adam_fused", "adamw_for_loop", "averaged_model",
           "to_local", "to_local_marked")
#: the cells a write is refused in (a write into ``to_local()`` under a stage-1/2 kept copy, which no count
#: shared by every rank sees: the fp32 shard is a view of the copy's own rows, so this rank's rows change, but
#: the peers' copies would not; refused whatever it wrote), by ranks whose shard of ``model[0].weight`` has
#: rows; every other cell is
#: seen: the next forward uses the written values (stage-3 kept storage sees ``to_local()`` writes by the
#: local shard's version, which every rank bumps alike when every rank writes)
REFUSED = {("to_local", "stage1"), ("to_local", "stage2")}


def _value(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a full tensor, the same on every rank) as ``like`` holds values: a DTensor of its ``Shard(0)``
    placement over a 1D mesh (this rank's ``torch.chunk`` rows, no communication), or ``t`` itself."""
    if not isinstance(like, DTensor):
        return t
    import torch.distributed as dist

    chunks, rank = t.chunk(like.device_mesh.size(), dim=0), dist.get_rank()
    piece = chunks[rank] if rank < len(chunks) else t[:0]
    return DTensor.from_local(piece.clone(), like.device_mesh, like.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _write(model: nn.Module, method: str, sharded: bool) -> None:
    w = model[0].weight
    target = torch.linspace(-1, 1, w.numel()).view(w.shape)
    if method in ("sgd_foreach", "adam_fused", "adamw_for_loop"):
        make = {"sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.5, foreach=True),
                "adam_fused": lambda p: torch.optim.Adam(p, lr=0.5, fused=True),
                "adamw_for_loop": lambda p: torch.optim.AdamW(p, lr=0.5, foreach=False)}[method]
        opt = make(model.parameters())
        opt.step()
        return
    if method == "load_state_dict":
        model.load_state_dict({k: 0.5 * _full(v) for k, v in model.state_dict().items()})
        return
    if method == "set_model_state_dict":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {k: 0.5 * _full(v) for k, v in model.state_dict().items()}
        if sharded:
            set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        else:
            model.load_state_dict(full)
        return
    with torch.no_grad():
        if method == "mul_":
            w.mul_(0.5)
        elif method == "foreach_mul_":
            torch._foreach_mul_([w], 0.5)
        elif method == "ema_foreach_lerp_":  # timm's EMA, AveragedModel's multi_avg_fn
            torch._foreach_lerp_([p.detach() for p in model.parameters()],
                                 [_value(torch.ones(p.shape), p) for p in model.parameters()], 0.5)
        elif method == "data_full":
            w.data = target
        elif method == "data_dtensor":
            w.data = _value(target, w)
        elif method == "data_mul_":
            w.data.mul_(0.5)
        elif method == "copy_":
            w.copy_(_value(target, w))
        elif method == "init_normal_":
            torch.manual_seed(3)
            nn.init.normal_(w)
        elif method == "init_trunc_normal_":
            torch.manual_seed(3)
            nn.init.trunc_normal_(w, std=0.5)
        elif method == "reset_parameters":
            torch.manual_seed(3)
            model[0].reset_parameters()
        elif method in ("to_local", "to_local_marked"):
            (w.to_local() if sharded else w).mul_(0.5)
            if sharded and method == "to_local_marked":
                model.mark_shards_written()
        else:
            raise ValueError(method)


def cell(rank: int, world_size: int, method: str, mode: str):
    """One cell: ``(out, issued)``: the output of the forward after the write (``[4, 2]``) or the refusing
    error's type name, and the collectives (kind, bytes, group size) issued from the write to the end of
    that forward. ``world_size == 0``: one process (the reference)."""
    comm = _Issued()
    try:
        out = _cell(world_size, method, mode, comm)
    finally:
        comm.stop()
    return out, comm.records


class _Issued:
    def __init__(self) -> None:
        self.records: list = []
        self.counter = None

    def start(self) -> None:
        import perparam

        self.counter = perparam.CommCounter().__enter__()

    def stop(self) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
            self.records = [(r.kind, r.nbytes, r.group_size) for r in self.counter.records]
            self.counter = None


def _cell(world_size: int, method: str, mode: str, comm: _Issued):
    import perparam
    from perparam import ParamPolicy
    from perparam.finetune.evaluation import parameters_kept_gathered

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))
    x = torch.linspace(-1, 1, 12).view(4, 3)
    ema = None
    if method == "averaged_model":  # torch.optim.swa_utils' EMA model, built before sharding, sharded alike
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.5))
    if world_size:
        from torch.distributed.device_mesh import init_device_mesh

        kw = {"mesh": init_device_mesh("cpu", (world_size,))}
        if mode in ("stage1", "stage2"):
            kw["param_policy"] = ParamPolicy(zero_stage=int(mode[-1]))
        if mode == "kept_after_forward":
            kw["reshard_after_forward"] = False
        if mode == "offload":
            kw["offload_policy"] = "cpu"
        for root in (model,) if ema is None else (model, ema.module):
            for sub in root:  # hpz: the Linears keep 2-rank rows after forward (4 ranks)
                perparam.fully_shard(sub, **kw, **({"reshard_after_forward": 2} if mode == "hpz" else {}))
            perparam.fully_shard(root, **kw)
    if ema is not None:  # evaluated between updates
        model(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.5).step()
        with torch.no_grad():
            ema(x)
        comm.start()
        ema.update_parameters(model)
        with torch.no_grad():
            return ema(x)
    model(x).sum().backward()  # gradients for the optimizer steps (every rank the same batch)
    try:
        if mode == "eval_kept" and world_size:
            with parameters_kept_gathered(model), torch.no_grad():
                model(x)
                comm.start()
                _write(model, method, True)
                out = model(x)
                comm.stop()
                return out
        if mode == "kept_after_backward":
            if world_size:
                model.set_reshard_after_backward(False)
            model.zero_grad()
            model(x).sum().backward()
        else:
            with torch.no_grad():
                model(x)  # fills the kept storage
        comm.start()
        _write(model, method, bool(world_size))
        with torch.no_grad():
            return model(x)
    except perparam.ShardingError as e:
        return type(e).__name__


def cells(rank: int, world_size: int, table: list) -> list:
    return [cell(rank, world_size, method, mode)[0] for method, mode in table]
