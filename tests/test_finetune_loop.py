"""``perparam finetune``'s training loop, samples and plot on the tiny config: ``--grad-accum 2 --batch-size
4`` takes the steps of ``--batch-size 8``; the learning-rate schedule's values, also across ``--resume``; the
``--plot`` PNG holds the run's series; samples are stored and are the same on 1 and 2 ranks; bad values of the
new flags stop with one line before any worker starts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from perparam.cli import main
from perparam.finetune import schedule
from perparam.finetune.model import Llama, LlamaConfig
from perparam.finetune.plot import read_series, series, write_plot
from tests.finetune_helpers import TINY, assert_one_line_error, run_finetune

LOOP = ("--warmup-steps", "1", "--min-lr", "3e-4", "--max-grad-norm", "1.0", "--eval-every", "2")
PROMPTS = ("ROMEO:", "Enter KING")
GENERATE = ("--generate", PROMPTS[0], "--generate", PROMPTS[1], "--max-new-tokens", "12")


def _run(folder: Path, text: Path, *flags: str, nproc: int = 2, ok: bool = True):
    out = folder / "summary.json"
    proc = run_finetune(*TINY, *LOOP, "--text", str(text), "--nproc", str(nproc), *flags, "--summary-json",
                        str(out))
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, (json.loads(out.read_text()) if ok else None)


@pytest.fixture(scope="module")
def accum_run(tmp_path_factory, text_dir):
    """2 ranks, 2 micro-batches of 4 sequences per step, samples, a plot and checkpoints at steps 2 and 4: the
    run the others compare to."""
    folder = tmp_path_factory.mktemp("accum")
    proc, summary = _run(folder, text_dir, "--grad-accum", "2", *GENERATE, "--plot", str(folder / "loss.png"),
                         "--save", str(folder / "ckpt"), "--save-every", "2")
    return folder, proc, summary


def _close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol


def test_grad_accum_2_of_batch_4_equals_batch_8_and_samples_match_on_one_rank(tmp_path, text_dir, accum_run):
    _, proc, accum = accum_run
    _, plain = _run(tmp_path, text_dir, "--batch-size", "8", *GENERATE, nproc=1)
    assert accum["grad_accum"] == 2 and plain["grad_accum"] == 1 and len(accum["train_losses"]) == 4
    assert _close(accum["train_losses"], plain["train_losses"]), (accum["train_losses"],
                                                                  plain["train_losses"])
    assert _close(accum["grad_norms"], plain["grad_norms"]) and len(accum["grad_norms"]) == 4
    assert _close([x for _, x in accum["heldout_losses"]], [x for _, x in plain["heldout_losses"]])
    assert accum["lrs"] == plain["lrs"] == [schedule.lr_at(s, 3e-3, 4, 1, 3e-4) for s in range(4)]
    # one reduce-scatter per step, not per micro-batch: every parameter's fp32 bytes with its rows padded to
    # 2 ranks, plus the used flags (one int32 per tensor and rank)
    params = list(Llama(LlamaConfig.tiny()).parameters())
    padded = sum(-(-p.shape[0] // 2) * 2 * p[0].numel() * 4 for p in params)
    assert accum["comm_bytes_per_step"]["reduce_scatter"] == padded + 4 * 2 * len(params)
    # samples: the same text before fine-tuning on 1 and 2 ranks (same init, same --sample-seed)
    assert [s["prompt"] for s in accum["samples"]] == list(PROMPTS)
    assert [s["before"] for s in accum["samples"]] == [s["before"] for s in plain["samples"]]
    # 12 bytes each, printable or not
    assert all(len(s["before"]) and len(s["after"]) for s in accum["samples"])
    assert accum["sampling_all_gathers_per_generation"] == 3  # 2 layers + root, once for 12 forwards
    assert accum["mfu"] > 0 and accum["matmul_peak_flops"] > 0 and accum["tokens_per_s"] > 0
    assert "step 1/4  loss" in proc.stdout and "grad-norm" in proc.stdout and "Samples (" in proc.stdout
    assert "held-out loss at step 2:" in proc.stdout


def test_plot_png_holds_the_runs_series(accum_run):
    folder, _, summary = accum_run
    png = folder / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = read_series(png)
    assert data["train_loss"] == [[s + 1, x] for s, x in enumerate(summary["train_losses"])]
    assert data["lr"] == [[s + 1, x] for s, x in enumerate(summary["lrs"])]
    assert [s for s, _ in data["heldout_loss"]] == [0, 2, 4]  # before, --eval-every 2, after
    assert data["heldout_loss"][0][1] == summary["heldout_loss_before"]
    assert data["heldout_loss"][-1][1] == summary["heldout_loss_after"]


@pytest.mark.slow
def test_resume_mid_schedule_continues_the_same_learning_rates(tmp_path, text_dir, accum_run, capsys,
                                                               monkeypatch):
    folder, _, straight = accum_run
    mid_schedule = folder / "ckpt" / "step-000002"  # after the warmup, 2 steps into the cosine decay
    _, resumed = _run(tmp_path, text_dir, "--grad-accum", "2", "--resume", str(mid_schedule))
    assert resumed["first_step"] == 2
    assert resumed["lrs"] == straight["lrs"][2:]
    assert resumed["train_losses"] == straight["train_losses"][2:]  # same world, fp32: bitwise
    assert resumed["grad_norms"] == straight["grad_norms"][2:]
    # "before" is the resumed model: its held-out loss is the straight run's at step 2
    assert resumed["heldout_losses"] == [h for h in straight["heldout_losses"] if h[0] >= 2]
    assert resumed["heldout_loss_before"] == straight["heldout_losses"][1][1]
    # another data order: refused by the launcher, before any worker starts (checked in this process)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [*TINY, *LOOP, "--text", str(text_dir), "--grad-accum", "1", "--resume", str(mid_schedule)]
    assert main(["finetune", *argv]) == 2
    err = capsys.readouterr().err
    assert "--grad-accum 2" in err and len(err.strip().splitlines()) == 1, err


def test_learning_rate_schedule_values_and_lambda_lr_state_round_trip():
    lr, min_lr, steps, warmup = 1e-3, 1e-4, 10, 2
    want = [lr / 2, lr] + [min_lr + (lr - min_lr) * (1 + math.cos(math.pi * k / 8)) / 2 for k in range(1, 9)]
    assert [schedule.lr_at(s, lr, steps, warmup, min_lr)
            for s in range(steps)] == pytest.approx(want, rel=1e-12)
    assert schedule.lr_at(steps - 1, lr, steps, warmup, min_lr) == pytest.approx(min_lr, rel=1e-12)
    assert [schedule.lr_at(s, lr, steps) for s in range(steps)] == [lr] * steps  # default: constant

    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)

    opt = optimizer()
    sched = schedule.build_scheduler(opt, lr, steps, warmup, min_lr)
    seen = []
    for s in range(steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        if s == 4:
            state = json.loads(json.dumps(sched.state_dict()))  # as the checkpoint's extra stores it
    assert seen == [schedule.lr_at(s, lr, steps, warmup, min_lr) for s in range(steps)]
    opt2 = optimizer()
    sched2 = schedule.build_scheduler(opt2, lr, steps, warmup, min_lr)
    schedule.restore(sched2, state, 5, lr)
    assert opt2.param_groups[0]["lr"] == seen[5] and sched2.get_last_lr() == [seen[5]]
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == seen[6]


def test_plot_round_trip_of_written_series(tmp_path):
    data = series([3.0, 2.5, 2.0], 0, [(0, 3.1), (3, 2.2)], [1e-3, 5e-4, 1e-4])
    write_plot(tmp_path / "sub" / "p.png", data)
    assert read_series(tmp_path / "sub" / "p.png") == json.loads(json.dumps(data))


def test_bad_loop_sample_and_plot_flags_give_one_line_errors(capsys, tmp_path, text_dir, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = ["--config", "tiny", "--text", str(text_dir), "--steps", "4"]
    (tmp_path / "dir.png").mkdir()
    (tmp_path / "file.txt").write_text("x")
    for flags, expect in (
            (["--grad-accum", "0"], "--grad-accum 0 must be at least 1"),
            (["--max-grad-norm", "0"], "--max-grad-norm 0.0 must be a positive"),
            (["--max-grad-norm", "nan"], "--max-grad-norm nan"),
            (["--warmup-steps", "-1"], "--warmup-steps -1 must be 0 or more"),
            (["--warmup-steps", "4"], "--warmup-steps 4 must be below --steps 4"),
            (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1.0 is above --lr 0.1"),
            (["--min-lr", "-1"], "--min-lr -1.0 must be a finite number >= 0"),
            (["--eval-every", "-2"], "--eval-every -2 must be between 1 and --steps 4"),
            (["--eval-every", "5"], "--eval-every 5 must be between 1 and --steps 4"),
            (["--step-timeout", "0"], "--step-timeout 0.0 must be a positive number of seconds"),
            (["--step-timeout", "nan"], "--step-timeout nan must be a positive number of seconds"),
            (["--generate", ""], "--generate '' is empty"),
            (["--generate", "x", "--max-new-tokens", "0"], "--max-new-tokens 0 must be at least 1"),
            (["--generate", "x", "--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0"),
            (["--generate", "x", "--top-k", "-1"], "--top-k -1 must be 0"),
            (["--generate", "x" * 1000, "--max-new-tokens", "40"], "exceed the model's context of 1024"),
            (["--plot", str(tmp_path / "loss.jpg")], "pass a path ending in .png"),
            (["--plot", str(tmp_path / "dir.png")], "is a folder"),
            (["--plot", str(tmp_path / "file.txt" / "loss.png")], "is a file, not a folder")):
        assert_one_line_error(capsys, [*tiny, *flags], expect)


def test_model_flops_per_token_follow_palm_6n_plus_12lhqt():
    from perparam.finetune.model import LlamaConfig
    from perparam.finetune.throughput import flops_per_token, matmul_weights, mfu

    cfg = LlamaConfig.smollm2_135m()
    n = 134_515_008 - (30 * 2 * 576 + 576)  # every parameter but the norms (the tied embedding is the head)
    assert matmul_weights(cfg) == n
    assert flops_per_token(cfg, 128) == 6 * n + 12 * 30 * 9 * 64 * 128 == 833_421_312
    assert flops_per_token(cfg, 128, 134_515_008, 134_515_008) == 833_421_312  # full fine-tuning
    # LoRA: 1000 adapter weights trained, the rest frozen (4 FLOPs per weight and token, not 6)
    assert flops_per_token(cfg, 128, 134_515_008 + 1000, 1000) == 833_421_312 + 6 * 1000 - 2 * n
    assert mfu(100.0, 833_421_312, 833_421_312 * 200.0) == 0.5
