"""``perparam finetune --invariant-units U``: the rule (a power of two that --nproc divides, a batch of whole
units) and the flags the mode refuses are one-line errors before any worker starts; the global batch is cut
into the same units whatever the number of ranks, each rank taking its contiguous U/K of them, at every
step of the stream."""

from __future__ import annotations

import pytest
import torch

from perparam.finetune import invariant_flags
from perparam.finetune.data import BatchStream
from tests.finetune_helpers import TINY, assert_one_line_error


@pytest.mark.parametrize("flags,expect", [
    (["--invariant-units", "3"], "--invariant-units 3 must be a power of two"),
    (["--invariant-units", "0"], "--invariant-units 0 must be a power of two"),
    (["--invariant-units", "2", "--nproc", "4"], "--invariant-units 2 is not divisible by --nproc 4"),
    (["--invariant-units", "8", "--nproc", "2"], "--batch-size 4 cannot be cut into --invariant-units 8"),
    (["--invariant-units", "4", "--nproc", "2", "--tp", "2"], "--invariant-units with --tp 2: tensor parallelism"),
    (["--invariant-units", "4", "--nproc", "2", "--grad-quant", "int8"],
     "--invariant-units with --grad-quant int8: quantized gradient reduction"),
])
def test_invariant_units_rule_and_refused_flags_are_one_line_errors(capsys, text_dir, flags, expect):
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), *flags], expect)


def test_invariant_units_without_the_library_mode_are_refused_not_run_silently(capsys, text_dir, monkeypatch):
    monkeypatch.setattr(invariant_flags, "MODE_MODULE", "perparam.no_such_mode")
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), "--invariant-units", "4", "--nproc", "2"],
                          "no K-invariant mode (perparam.no_such_mode")
    monkeypatch.undo()  # with the library's mode present: still refused until the job runs through it
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), "--invariant-units", "4", "--nproc", "2"],
                          "does not run its steps through perparam.InvariantUnits yet")


def test_the_global_batch_is_cut_into_the_same_units_on_1_2_and_4_ranks():
    rows = torch.arange(40 * 9).reshape(40, 9)
    stream = BatchStream(rows, batch_size=8, seed=3)
    for step in (0, 4, 7):  # 5 steps per epoch: 7 is in the second permutation
        inputs, _ = stream.global_batch(step)
        units = invariant_flags.units(inputs, 4)
        assert [u.shape[0] for u in units] == [2] * 4 and torch.equal(torch.cat(units), inputs)
        for world in (1, 2, 4):
            taken = [i for r in range(world) for i in invariant_flags.rank_units(4, r, world)]
            assert taken == [0, 1, 2, 3]  # contiguous U/K units per rank, in rank order
            for rank in range(world):
                mine = torch.cat([units[i] for i in invariant_flags.rank_units(4, rank, world)])
                assert torch.equal(mine, stream.rank_batch(step, rank, world)[0])  # the rank's usual rows
    with pytest.raises(ValueError, match="cannot be cut into 3 equal units"):
        invariant_flags.units(rows[:8], 3)
