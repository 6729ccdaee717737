"""What perparam refuses and FSDP2 accepts (``docs/fsdp2-differences.md``) is refused with an error that is
both perparam's (``ShardingError``) and the builtin type torch raises for that kind of change, so code
written for FSDP2 or plain torch catches it; the message names the parameter and the fix."""

from __future__ import annotations

import torch
from torch import nn

import perparam
from tests.distributed import run_distributed


def _caught(call, *types) -> str:
    """``"TypeName: message"`` if ``call()`` raised an error that is an instance of every type in ``types``."""
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
