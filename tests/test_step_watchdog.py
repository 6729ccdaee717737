"""A rank stopped from outside (SIGSTOP) in forward, backward or the optimizer step is found by
``perparam.elastic.StepWatchdog`` within its bound (without it: gloo's 30-minute timeout), killed, and the
survivors end as for a dead peer (``PeerLostError``, exit 1): one line names the stopped rank, its host and
pid and why; no process is left stopped. Real processes, real signals (``benchmarks/harness/faults.py``);
the bound's derivation is checked without processes."""

from __future__ import annotations

import re
import signal
import sys

import pytest

from benchmarks.harness.faults import run_fault
from perparam.elastic import StepWatchdog

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BOUND = 6.0  # seconds: the watchdog's bound in these runs (set, not derived; a loaded 2-core machine: slack)


def _check(world: int, phase: str, victim: int) -> None:
    fault = run_fault(world, phase, signal.SIGSTOP, victim=victim, watchdog=BOUND)
    assert not fault.left_stopped
    assert fault.codes[victim] == -signal.SIGKILL, fault.err[victim]  # killed by a survivor's watchdog
    said = [line for rank in range(world) for line in fault.err[rank].splitlines() if "was stopped:" in line
            and not line.startswith("[rank")]
    assert len(said) == 1, said  # one line, by one survivor
    assert re.fullmatch(rf"perparam: rank {victim} \(host \S+, pid {fault.victim_pid}\) was stopped: rank \d "
                        r"saw no step "
                        rf"for [\d.]+ s, over the step watchdog's bound of {BOUND} s \(set\); killed it",
                        said[0]), said
    for rank in range(world):
        if rank != victim:
            assert fault.codes[rank] == 1, fault.err[rank]
            assert ("perparam.PeerLostError" in fault.error_line(rank)
                    and "was stopped" in fault.error_line(rank))
            assert fault.detected_s[rank] is not None  # its seconds: benchmarks/peer_faults.py


@pytest.mark.parametrize("phase", ["forward", "backward", "step"])
def test_a_stopped_rank_is_found_within_the_bound_killed_and_named_in_one_line(phase):
    _check(2, phase, victim=1)


@pytest.mark.slow  # 3 processes
def test_a_stopped_middle_rank_of_three_is_found_and_killed():
    _check(3, "backward", victim=1)


def test_the_bound_is_derived_from_the_median_step_with_a_floor():
    wd = StepWatchdog(factor=8.0, floor=2.0, warmup=2, first_timeout=300.0)  # one process: no thread
    assert wd.bound() == 300.0  # before the steps are measured
    wd.durations, wd.steps = [0.5, 0.1, 0.1, 0.2], 4
    assert wd.bound() == 2.0  # 8 x the median 0.15 s is under the floor
    wd.durations = [1.0] * 4
    assert wd.bound() == 8.0
    with wd.paused():
        assert wd.bound() == 300.0
    assert StepWatchdog(timeout=5.0).bound() == 5.0
    with pytest.raises(ValueError, match="must be a positive number of seconds"):
        StepWatchdog(timeout=0)
