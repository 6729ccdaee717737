"""Input that used to fail at the first forward is refused by ``fully_shard`` (``ShardingError``, one line
naming the field and the fix): fp8 compute, reduce, output or master dtypes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import perparam
from perparam import MixedPrecisionPolicy, ParamPolicy

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "output_dtype", "master_dtype"])
def test_fp8_policy_dtypes_are_refused_at_fully_shard(fake_mesh, field):
    fp8 = torch.float8_e4m3fn
    with pytest.raises(perparam.ShardingError, match=rf"MixedPrecisionPolicy.{field} is {fp8}.*QuantPolicy"):
        perparam.fully_shard(nn.Linear(4, 4), mesh=fake_mesh, mp_policy=MixedPrecisionPolicy(**{field: fp8}))
    if field != "output_dtype":  # ParamPolicy has no output_dtype
        with pytest.raises(perparam.ShardingError, match=rf"{field} of 'weight' is {fp8}.*QuantPolicy"):
            perparam.fully_shard(nn.Linear(4, 4), mesh=fake_mesh,
                                 param_policy={"weight": ParamPolicy(**{field: fp8})})
