"""The hardware decides --qlora's compute dtype: bf16 by default becomes fp32 where bf16 matmuls are emulated
(slower than fp32), a bf16 the user asked for stays, and the benchmark's table marks emulated bf16 rows. The
matmul timing is injected: no timing is asserted."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks.harness.report import bf16_note, row_name
from perparam.finetune import job, throughput, train
from perparam.finetune.cli import _worker_argv, add_arguments
from perparam.finetune.config import JobConfig

pytestmark = pytest.mark.fast

EMULATED, NATIVE = 11.3, 0.4  # bf16 time over fp32 time: this 2-core AVX2 host, a CPU with AMX


@pytest.mark.parametrize("slowdown,by_default,want", [
    (EMULATED, True, "fp32"), (EMULATED, False, "bf16"), (NATIVE, True, "bf16"), (NATIVE, False, "bf16"),
    (throughput.BF16_EMULATED_ABOVE, True, "bf16"),  # as fast as fp32: not emulated
])
def test_default_bf16_becomes_fp32_only_where_bf16_matmuls_are_slower_than_fp32(slowdown, by_default, want):
    dtype, line = throughput.compute_dtype("bf16", by_default, slowdown)
    assert dtype == want
    if slowdown > throughput.BF16_EMULATED_ABOVE:  # one line either way, with the figure and the way out
        assert (line is not None and "\n" not in line and "emulates bf16" in line
                and f"{slowdown:.1f}x" in line)
        assert ("--param-dtype bf16 forces it" in line) == by_default
    else:
        assert line is None
    assert throughput.compute_dtype("fp32", by_default, slowdown) == ("fp32", None)


def _job(monkeypatch, slowdown: float, capsys, **flags) -> tuple[str, str]:
    monkeypatch.setattr(train, "setup_distributed", lambda timeout_s: (0, 1, torch.device("cpu")))
    monkeypatch.setattr(throughput, "bf16_slowdown", lambda device: slowdown)
    cfg = job.hardware_compute_dtype(JobConfig(steps=1, seq_len=8, batch_size=1, lr=1e-3, seed=0, lora=4,
                                               **flags))
    return cfg.param_dtype, capsys.readouterr().out


def test_the_worker_computes_qlora_in_fp32_on_emulated_bf16_unless_bf16_was_asked_for(monkeypatch, capsys):
    dtype, out = _job(monkeypatch, EMULATED, capsys, qlora=True, param_dtype=None)
    assert dtype == "fp32" and out.count("\n") == 1 and "compute in fp32, not --qlora's default bf16" in out
    dtype, out = _job(monkeypatch, EMULATED, capsys, qlora=True, param_dtype="bf16")
    assert dtype == "bf16" and "as asked" in out
    assert _job(monkeypatch, NATIVE, capsys, qlora=True, param_dtype=None) == ("bf16", "")


def test_the_launcher_hands_an_unchosen_compute_dtype_to_the_workers_to_settle():
    def argv(*given: str) -> list[str]:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        cfg = JobConfig.from_args(parser.parse_args(["--config", "tiny", "--lora", "4", "--qlora", *given]))
        assert cfg.param_dtype == (given[-1] if given else "bf16")
        return _worker_argv(cfg, "data.pt")

    assert "--param-dtype" not in argv()  # the worker's JobConfig fills it in again, by default
    chosen = argv("--param-dtype", "bf16")
    assert chosen[chosen.index("--param-dtype") + 1] == "bf16"


def test_the_benchmark_table_marks_bf16_rows_that_ran_emulated():
    emulated = {"bf16_emulated": True, "bf16_matmul_slowdown": EMULATED}
    assert (row_name("perparam_bf16", emulated) == "perparam_bf16 *"
            and row_name("perparam", emulated) == "perparam")
    assert "ran emulated" in bf16_note(emulated) and "11.3x" in bf16_note(emulated)
    native = {"bf16_emulated": False, "bf16_matmul_slowdown": NATIVE}
    assert row_name("fsdp2_bf16", native) == "fsdp2_bf16" and bf16_note(native) is None
