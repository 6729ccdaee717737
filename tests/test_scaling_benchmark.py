"""``benchmarks/scaling.py`` and ``benchmarks/harness/fits.py``: which configurations a size runs, the flags,
and the table (pure: no process is started)."""

from __future__ import annotations

import pytest

from benchmarks.harness.fits import GB, fitting, job_bytes, state_bytes_per_rank
from benchmarks.harness.model import SIZES, count_params
from benchmarks.scaling import markdown, parse_args

N350 = count_params(SIZES["350m"])


def test_sizes_are_27m_110m_and_350m_parameters():
    assert [round(count_params(SIZES[s]) / 1e6) for s in ("27m", "110m", "350m")] == [27, 112, 344]


def test_state_per_rank_follows_ddp_and_zero3_formulas_with_ddp_buckets():
    n = 1000
    assert state_bytes_per_rank("bound", n, 4) == 16 * n
    assert state_bytes_per_rank("ddp", n, 4) == 20 * n  # plus its gradient buckets
    assert state_bytes_per_rank("perparam", n, 4) == state_bytes_per_rank("fsdp2", n, 4) == 4 * n


def test_ddp_at_350m_is_skipped_with_the_bytes_it_needs_and_the_sharded_configs_kept():
    names, skipped = fitting(["ddp", "fsdp2", "perparam"], N350, 2, available=20 * GB)
    assert names == ["fsdp2", "perparam"]
    assert list(skipped) == ["ddp"] and skipped["ddp"].startswith("skipped: needs ")
    assert "with perparam, fsdp2 on 2 ranks" in skipped["ddp"] and "20.0 GB available" in skipped["ddp"]
    assert job_bytes(names, N350, 2) <= 20 * GB


def test_everything_fits_when_memory_allows_and_nothing_when_perparam_alone_does_not():
    assert fitting(["ddp", "fsdp2", "perparam"], N350, 2,
                   available=10**12) == (["ddp", "fsdp2", "perparam"], {})
    names, skipped = fitting(["ddp", "fsdp2", "perparam"], N350, 2, available=GB)
    assert names == [] and set(skipped) == {"ddp", "fsdp2", "perparam"}


@pytest.mark.parametrize("argv, flag", [(["--sizes", "27m,1b"], "--sizes"), (["-K", "1"], "--worlds"),
                                        (["--configs", "ddp,fsdp2"], "--configs"),
                                        (["--steps", "0"], "--steps")])
def test_bad_flags_name_the_flag_before_anything_starts(argv, flag, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert flag in capsys.readouterr().err.splitlines()[-1]


def test_table_row_names_a_skipped_ddp_and_why():
    ok = {"status": "ok", "step_time_s": {"median": 2.0}, "cpu_per_token_s": 1e-3,
          "training_peak_over_baseline_bytes": 3 << 20}
    pp = {**ok, "paired_ratio_vs_fsdp2": 0.7, "cpu_ratio_vs_fsdp2": 0.8,
          "model_state_bytes_per_rank": [8 << 20], "state_vs_model": 1.0,
          "comm_sent_bytes_per_rank": 6 << 20, "sent_vs_model": 0.95}
    run = {"size": "350m", "params": N350, "world": 2, "status": "ok", "steps": 4, "warmup": 1,
           "configs": {"fsdp2": ok, "perparam": pp}, "skipped": {"ddp": "skipped: needs 25.7 GB"},
           "loadavg": {"mean": 2.5, "min": 2.0, "max": 3.0}}
    text = markdown([run])
    row = text.splitlines()[2]
    assert row.startswith("| 350m (344.4M) | 2 | 4+1 | 0.70 (0.80) | - (-) | 2.00 / 2.00 / skipped |")
    assert "8.0 (1.000)" in row and "6.0 (0.950)" in row and row.endswith("| 2.50 (2.00-3.00) |")
    assert "350m K=2 ddp: skipped: needs 25.7 GB" in text


def test_quick_size_runs_end_to_end_with_figures_against_the_zero3_formulas(tmp_path, capsys):
    import json

    from benchmarks.scaling import main

    out = tmp_path / "scaling.json"
    main(["--sizes", "quick", "-K", "2", "--configs", "fsdp2,perparam", "--steps", "1", "--warmup", "0",
          "--no-rss", "--json", str(out)])  # one launch; the memory jobs are step_time.py's smoke test's
    run = json.loads(out.read_text())["runs"][0]
    assert run["status"] == "ok" and run["skipped"] == {} and run["tokens_per_rank"] == 16
    pp, fsdp2 = run["configs"]["perparam"], run["configs"]["fsdp2"]
    assert pp["state_model"] == "ZeRO-3" and abs(pp["state_vs_model"] - 1) < 0.01  # + AdamW's step counters
    # the kept [ln_f, head] group is gathered once: a little under 3 (K-1)/K P
    assert 0.9 < pp["sent_vs_model"] < 1 and fsdp2["sent_vs_model"] <= pp["sent_vs_model"]
    assert pp["cpu_per_token_s"] > 0 and pp["paired_ratio_vs_fsdp2"] > 0 and pp["paired_ratio_vs_ddp"] is None
    assert run["loadavg"]["mean"] >= 0
    row = next(line
               for line in capsys.readouterr().out.splitlines()
               if line.startswith("| quick (0.1M) | 2 | 1+0 |"))
    assert row.endswith(f"| - / - / - | {run['loadavg']['mean']:.2f} ({run['loadavg']['min']:.2f}-"
                        f"{run['loadavg']['max']:.2f}) |")


@pytest.mark.parametrize("filename, funcname, expected", [
    ("~", "<built-in method torch._C._nn.linear>", "compute"),
    ("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>", "compute"),
    ("~", "<built-in method torch.split_with_sizes_copy>", "copies"),
    ("~", "<method 'copy_' of 'torch._C.TensorBase' objects>", "copies"),
    ("~", "<built-in method torch._chunk_cat>", "copies"),
    ("~", "<built-in method torch.empty>", "allocation"),
    ("~", "<built-in method torch._C._distributed_c10d.all_to_all_single>", "collectives"),
    ("~", "<built-in method torch._C._distributed_c10d.wait>", "collectives"),
    ("~", "<built-in method builtins.isinstance>", "python: builtins"),
    ("/x/perparam/runtime/group.py", "start_unshard", "python: perparam"),
    ("/x/torch/distributed/tensor/_dispatch.py", "dispatch", "python: DTensor"),
    ("/x/torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "init", "python: FSDP2"),
    ("/x/torch/optim/adamw.py", "step", "python: torch.optim"),
])
def test_profile_categories_put_each_function_where_its_cpu_time_belongs(filename, funcname, expected):
    from benchmarks.harness.step_categories import category

    assert category(filename, funcname) == expected


def test_memory_guard_kills_the_jobs_processes_when_memory_runs_short():
    import subprocess
    import time

    from benchmarks.harness.fits import MemoryGuard, mem_available

    child = subprocess.Popen(["sleep", "30"])
    with MemoryGuard(floor=mem_available() + 10**15, interval=0.05) as guard:
        time.sleep(0.3)
    assert child.wait(timeout=5) == -9
    assert guard.tripped.startswith("killed: MemAvailable fell to ")
