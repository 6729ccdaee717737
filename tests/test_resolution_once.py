"""Each parameter's policy is picked and resolved exactly once per ``fully_shard`` call: the one
``ParamResolution`` of ``perparam.sharding.resolution`` is what ``ShardedParam`` and the group use."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import perparam
from perparam.runtime import param as runtime_param
from perparam.runtime.group import group_of
from perparam.sharding import policy, resolution
from tests.distributed import run_distributed

pytestmark = pytest.mark.fast

#: the functions that pick, resolve or lay out one parameter, by module, keyed by the parameter they serve
COUNTED = [(resolution, "pick_policy"), (resolution, "resolve"), (resolution, "resolve_param"),
           (resolution, "check_zero_stage"), (resolution, "shard_layout"), (runtime_param, "shard_layout")]


def entries_per_parameter(rank: int, world_size: int) -> dict:
    counts: collections.Counter = collections.Counter()
    originals = [getattr(module, attr) for module, attr in COUNTED]
    for module, attr in COUNTED:
        original = getattr(module, attr)

        def counted(*args, _original=original, _attr=attr, **kwargs):
            out = _original(*args, **kwargs)
            counts[_attr, args[0] if isinstance(args[0], str) else tuple(args[0])] += 1
            return out

        setattr(module, attr, counted)
    picked: collections.Counter = collections.Counter()

    def param_policy(name, p):
        picked[name] += 1
        return perparam.ParamPolicy(placement="auto",
                                    quant=perparam.QuantPolicy("int8") if p.dim() == 2 else None)

    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        perparam.fully_shard(model, param_policy=param_policy,
                             mp_policy=perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        layouts_resolved = {sp.fqn: sp.layout for sp in group_of(model).params}
    finally:
        for (module, attr), original in zip(COUNTED, originals):
            setattr(module, attr, original)
    return {"counts": dict(counts), "picked": dict(picked), "shapes": shapes,
            "layouts": sorted(layouts_resolved)}


def test_each_parameter_is_picked_and_resolved_once_per_fully_shard_call():
    for out in run_distributed(entries_per_parameter, 2):
        assert out["picked"] == {name: 1 for name in out["shapes"]}
        for name in out["shapes"]:
            for attr in ("pick_policy", "resolve", "resolve_param", "check_zero_stage"):
                assert out["counts"][attr, name] == 1, (attr, name, out["counts"])
        # laid out once, in resolution.resolve_params; ShardedParam takes that layout (distinct shapes here)
        assert sorted(k[1] for k in out["counts"] if k[0] == "shard_layout") == sorted(out["shapes"].values())
        assert all(v == 1 for k, v in out["counts"].items() if k[0] == "shard_layout")
        assert out["layouts"] == sorted(out["shapes"])


def test_mixed_precision_policy_fields_are_checked_in_one_place():
    import pytest

    for bad, match in ((perparam.MixedPrecisionPolicy(param_dtype=torch.int8), "floating-point"),
                       (perparam.MixedPrecisionPolicy(reduce_dtype="bf16"), "must be a torch.dtype"),
                       (perparam.MixedPrecisionPolicy(output_dtype=torch.float8_e4m3fn), "cannot compute"),
                       (perparam.MixedPrecisionPolicy(cast_forward_inputs=1), "True or False")):
        with pytest.raises(policy.PolicyError, match=match):
            policy.as_mp_policy(bad, "mp_policy")
