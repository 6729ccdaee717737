"""The fault matrix's representative cases (the whole matrix: ``python -m benchmarks.fault_matrix``): the
main job on 4 ranks, ``--invariant-units 8 --max-restarts 1``, one worker SIGKILLed or SIGSTOPped from
outside in a chosen phase (``benchmarks/harness/fault_traps.py``), respawned by torch's agent: the final
parameters, AdamW state, GGUF and reported losses are the uninterrupted run's bit for bit, no committed step
is lost, and the restart's record (``restart_times``) holds its detection, start, restore and first step in
that order. The record's pieces are checked without processes."""

from __future__ import annotations

import time

import pytest

from benchmarks.fault_matrix import cases, parse_args
from benchmarks.harness.finetune_faults import Case, Job, from_snapshot, uninterrupted, write_text
from perparam.finetune import restart_times

JOB = Job(bound=5.0)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    text = write_text(out / "text")
    return out, text, uninterrupted(JOB, text, out)["fingerprint"]


def _recovered(case: Case, straight) -> dict:
    pytest.importorskip("gguf")
    out, text, want = straight
    got = from_snapshot(case, JOB, text, out, want)
    assert got["exit"] == 0, got.get("error")
    assert got["bits"] == {"params": True, "optimizer": True, "gguf": True, "reported": True, "differing": []}
    assert got["restarts"] == 1 and got["lost"] == 0
    seconds = got["seconds"]
    assert None not in seconds.values(), seconds  # every mark recorded, in order (no figure is asserted)
    assert min(seconds.values()) >= 0 and seconds["total"] == pytest.approx(
        sum(seconds[k] for k in ("detection", "restart", "restore", "first_step")), abs=0.01)
    return got


@pytest.mark.slow
def test_rank_0_killed_in_the_snapshot_commit_ends_on_the_uninterrupted_bits(straight):
    got = _recovered(Case("SIGKILL", 0, "commit", 7), straight)
    # the torn slot of step 7 is never loaded: step 6 is, and step 7 is run again
    assert got["restored_at_step"] == 6 and got["recomputed"] == 1


@pytest.mark.slow
def test_last_rank_stopped_in_the_disk_save_ends_on_the_uninterrupted_bits(straight):
    got = _recovered(Case("SIGSTOP", JOB.nproc - 1, "save", 8), straight)
    assert got["restored_at_step"] >= 8  # the save of step 8 was written after its snapshot


def test_a_restart_is_detected_at_the_earliest_stop_its_failed_group_noted(tmp_path):
    restart_times.note_stop(tmp_path, "2", 0)
    first = time.time()
    restart_times.note_stop(tmp_path, "1", 1)
    restart_times.note_stop(None, "3", 0)  # no folder: nothing, no error
    (tmp_path / restart_times.STOPS_FILE).open("a").write("garbled\n")
    noted = restart_times.detected(tmp_path, 0)
    assert noted is not None and noted <= first
    assert restart_times.detected(tmp_path, 1) >= noted and restart_times.detected(tmp_path, 2) is None


def test_the_process_start_is_before_now_and_the_clock_keeps_its_first_marks():
    clock = restart_times.StartClock()
    assert clock.started <= time.time()
    clock.first_step()
    kept = clock.first_step_at
    clock.first_step()
    assert clock.record() == {"started": clock.started, "ready": None, "first_step": kept}


def test_the_quick_matrix_has_the_representative_cases_and_the_full_one_every_case():
    quick = cases(parse_args(["--quick"]), JOB)
    assert Case("SIGKILL", 0, "commit", 7) in quick and Case("SIGSTOP", 3, "save", 8) in quick
    full = cases(parse_args([]), JOB)
    assert len(full) == 2 * 3 * 5 and {c.victim for c in full} == {0, 2, 3}
