"""``fully_shard`` marks the modules it manages as torch's FSDP2 does (``_is_fsdp_managed_module``,
``_fsdp_use_orig_params``): Hugging Face's ``generate`` keeps ranks in step for such a model
(tests/test_huggingface.py), and code that asks the question FSDP2 answers gets the same answer."""

from __future__ import annotations

import pytest
import torch

from perparam.module import FSDP_MANAGED_ATTRS
from tests.distributed import run_distributed
from tests.models import TinyNet

pytestmark = pytest.mark.fast


def marks(rank: int, world: int) -> list[list[str]]:
    from torch.distributed.fsdp import fully_shard as fsdp2_shard

    from perparam import fully_shard

    out = []
    for shard in (fully_shard, fsdp2_shard):
        torch.manual_seed(0)
        model = TinyNet(n_blocks=2)
        before = [n for n, m in model.named_modules()
                  if any(getattr(m, a, False) for a in FSDP_MANAGED_ATTRS)]
        assert before == []
        shard(model.blocks[0])
        shard(model)
        out.append([n for n, m in model.named_modules() if all(getattr(m, a, False) is True
                                                                for a in FSDP_MANAGED_ATTRS)])
    return out


def test_fully_shard_marks_the_modules_it_manages_as_fsdp2_does():
    ours, fsdp2 = run_distributed(marks, 2)[0]
    assert ours == fsdp2
    assert ours == ["", "embed", "blocks", "blocks.0", "blocks.0.norm", "blocks.0.fc1", "blocks.0.fc2",
                    "blocks.1", "blocks.1.norm", "blocks.1.fc1", "blocks.1.fc2", "head"]
