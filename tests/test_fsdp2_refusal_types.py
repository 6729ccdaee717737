"""What perparam refuses and FSDP2 accepts (``docs/fsdp2-differences.md``) is refused with an error that is
both perparam's (``ShardingError``) and the builtin type torch raises for that kind of change, so code
written for FSDP2 or plain torch catches it; the message names the parameter and the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import perparam
from tests.distributed import run_distributed


def _caught(call, *types) -> str:
    """``"TypeName: message"`` if ``call()`` raised an error that is an instance of every type in
    ``types``."""
    try:
        call()
    except Exception as e:  # every kind is reported, the test asserts on it
        ok = all(isinstance(e, t) for t in types)
        return f"{'' if ok else 'WRONG TYPE '}{type(e).__name__}: {e}"
    return "no error"


def refusals(rank: int, world_size: int) -> dict:
    model = nn.Sequential(nn.Linear(4, 2))
    perparam.fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()

    def slot_replaced():  # what no registration hook sees: refused at the next forward
        sharded = model[0]._parameters["bias"]
        model[0]._parameters["bias"] = nn.Parameter(torch.zeros(2))
        try:
            model(torch.randn(2, 4))
        finally:
            model[0]._parameters["bias"] = sharded

    return {
        "to_dtype": _caught(lambda: model.to(torch.float8_e4m3fn), perparam.ShardingError, TypeError),
        "assign": _caught(lambda: setattr(model[0], "weight", nn.Parameter(torch.zeros(2, 4))),
                          perparam.ShardingError, RuntimeError),
        "slot": _caught(slot_replaced, perparam.ShardingError, RuntimeError),
        "still_trains": bool(model(torch.randn(2, 4)).sum().backward() is None),
    }


def test_refusals_of_what_fsdp2_accepts_are_sharding_errors_of_the_builtin_kind():
    for got in run_distributed(refusals, 2):
        assert got["to_dtype"].startswith("StoredDtypeChangeError") and "float8_e4m3fn" in got["to_dtype"]
        assert got["assign"].startswith("ShardedTreeChangeError") and "'0.weight'" in got["assign"]
        assert got["slot"].startswith("ReplacedAfterShardingError") and "0.bias" in got["slot"]
        assert got["still_trains"]


def applied_twice(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    out = {}
    for name, shard in (("perparam", perparam.fully_shard), ("fsdp2", fsdp2_shard)):
        model = nn.Sequential(nn.Linear(4, 2))
        shard(model)
        try:
            shard(model, reshard_after_forward=False)  # a changed setting: refused by both
            out[name] = "no error"
        except Exception as e:  # the types differ: ShardingError (a ValueError), FSDP2's AssertionError
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_fully_shard_applied_twice_is_refused_as_fsdp2_refuses_it_naming_the_setters_and_the_rebuild():
    got = run_distributed(applied_twice, 2)[0]
    assert got["fsdp2"].startswith("AssertionError") and "only be applied to a module once" in got["fsdp2"]
    message = got["perparam"]
    assert message.startswith("ShardingError") and "already applied to this Sequential" in message, message
    assert "set_reshard_after_forward" in message and "full_state_dict" in message, message


class Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        return x * self.scale


def fsdp2_types(rank: int, world_size: int) -> dict:
    """The refusals FSDP2 users catch by type (FSDP2 2.13: ``ValueError`` for a mesh of 3 axes and for a
    scalar parameter, ``RuntimeError`` for a parameter still on meta at lazy init; ``NotImplementedError`` for
    a non-contiguous parameter, which perparam shards)."""
    from torch.distributed.device_mesh import init_device_mesh

    def meta_forward():
        with torch.device("meta"):
            m = nn.Linear(4, 3)
        perparam.fully_shard(m)
        m(torch.randn(2, 4))

    torch.manual_seed(0)
    transposed = nn.Linear(4, 3)
    transposed.weight = nn.Parameter(torch.randn(4, 3).t())  # non-contiguous: [3, 4] with strides (1, 3)
    want = transposed(torch.ones(2, 4)).detach()
    perparam.fully_shard(transposed)
    return {
        "mesh_3d": _caught(lambda: perparam.fully_shard(nn.Linear(2, 2),
                                                        mesh=init_device_mesh("cpu", (1, 1, 2))),
                           perparam.ShardingError, ValueError),
        "scalar": _caught(lambda: perparam.fully_shard(Scalar()), perparam.ShardingError, ValueError),
        "meta": _caught(meta_forward, perparam.ShardingError, RuntimeError),
        "non_contiguous": (transposed(torch.ones(2, 4)) - want).abs().max().item(),
    }


def test_refusals_fsdp2_shares_have_fsdp2s_exception_types():
    for got in run_distributed(fsdp2_types, 2):
        assert got["mesh_3d"].startswith("ShardingError") and "3D mesh" in got["mesh_3d"], got["mesh_3d"]
        assert got["scalar"].startswith("ShardingError") and "'scale'" in got["scalar"], got["scalar"]
        assert got["meta"].startswith("MetaParameterError") and "'weight'" in got["meta"], got["meta"]
        # FSDP2 refuses it (NotImplementedError); perparam shards it
        assert got["non_contiguous"] < 1e-6, got["non_contiguous"]


def train_a_deepcopy(rank: int, world_size: int) -> dict:
    """A TinyNet trained 2 AdamW steps, deep-copied, then the copy and the original 3 more each (the copy on
    other batches). Sharded (``world_size > 0``): the deepcopy of the sharded model is refused (FSDP2 refuses
    it too), and the fix the message gives (the full state loaded into a model sharded by its own calls)
    is the copy; ``world_size == 0``: plain ``copy.deepcopy`` in one process."""
    import copy

    from perparam.full_state import full_state_dict, load_full_state_dict
    from tests.models import full_params, make_batches, sharded_tiny, train_steps

    def build():
        return sharded_tiny(shard=bool(world_size))

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, make_batches(2, 12), rank, world_size)
    refusal = "no error"
    if world_size:
        refusal = _caught(lambda: copy.deepcopy(model), perparam.ShardingError, AssertionError)
        twin = build()
        load_full_state_dict(twin, full_state_dict(model))
    else:
        twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    train_steps(twin, twin_opt, make_batches(3, 12, seed=1), rank, world_size)
    train_steps(model, opt, make_batches(3, 12, seed=2), rank, world_size)
    return {"twin": full_params(twin), "model": full_params(model), "refusal": refusal}


def test_a_deepcopy_of_a_sharded_model_is_refused_with_fsdp2s_type_and_the_fix_trains_like_one_process():
    want = train_a_deepcopy(0, 0)
    # 3 ranks: empty shards of Embedding(5, 6)'s, Linear(6, 2)'s rows
    for got in run_distributed(train_a_deepcopy, 3):
        assert (got["refusal"].startswith("DeepcopyError")
                and "full_state_dict" in got["refusal"]), got["refusal"]
        for which in ("twin", "model"):
            for name, value in want[which].items():
                torch.testing.assert_close(got[which][name], value, rtol=0, atol=1e-5, msg=f"{which} {name}")


class Containers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 5)
        self.d = nn.ModuleDict({"a": nn.Linear(5, 4)})
        self.l = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])  # 2 rows: an empty shard on 3 ranks

    def forward(self, x):  # [batch, 3] -> [batch, 2]
        x = self.d["a"](torch.tanh(self.inp(x)))
        for layer in self.l:
            x = layer(torch.tanh(x))
        return x


def containers(rank: int, world_size: int) -> dict:
    """A ModuleList/ModuleDict given to fully_shard is refused (FSDP2's ValueError: no forward, so no hook
    would all-gather); the fix it names (its modules as a list) trains like one process (3 SGD steps)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = Containers()
    out = {}
    if world_size:
        out["list"] = _caught(lambda: perparam.fully_shard(model.l), perparam.ShardingError, ValueError)
        out["dict"] = _caught(lambda: perparam.fully_shard(model.d), perparam.ShardingError, ValueError)
        perparam.fully_shard(list(model.d.values()))
        perparam.fully_shard(list(model.l))
        perparam.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)
        if world_size:
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["params"] = {n: (p.full_tensor() if world_size else p).detach() for n, p in model.named_parameters()}
    return out


@pytest.mark.fast
def test_a_module_list_or_dict_given_as_a_module_is_refused_and_its_modules_as_a_list_match_one_process():
    want = containers(0, 0)["params"]
    for got in run_distributed(containers, 3):
        assert (got["list"].startswith("ShardingError")
                and "fully_shard(list(container))" in got["list"]), got["list"]
        assert (got["dict"].startswith("ShardingError")
                and "list(container.values())" in got["dict"]), got["dict"]
        for name, value in want.items():
            torch.testing.assert_close(got["params"][name], value, rtol=0, atol=1e-5, msg=name)
