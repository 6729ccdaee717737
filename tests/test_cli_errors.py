"""Bad input to every subcommand: found before anything runs, one line that says what is accepted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from perparam.cli import main
from perparam.finetune.errors import FinetuneInputError
from tests.finetune_helpers import REPO, assert_one_line_error, subprocess_env, write_tiny_gguf


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> list[str]:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("Shall I compare thee to a summer's day?\n" * 200)
    (text / "b.txt").write_text("Thou art more lovely and more temperate.\n" * 50)
    return ["--config", "tiny", "--text", str(text)]


def test_finetune_sizes_and_paths_are_refused_before_any_worker(capsys, tmp_path, tiny):
    assert_one_line_error(capsys, [*tiny, "--batch-size", "0"], "--batch-size 0 must be at least 1")
    assert_one_line_error(capsys, [*tiny, "--lr", "inf"], "--lr inf must be a positive finite number")
    assert_one_line_error(capsys, [*tiny, "--lr", "nan"], "must be a positive finite number")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert_one_line_error(capsys, [*tiny, "--summary-json", str(a_file / "sub" / "s.json")],
                          f"{a_file} is a file, not a folder")
    assert_one_line_error(capsys, [*tiny, "--summary-json", str(tmp_path)], "is a folder")


OUTPUT_FLAGS = {"--summary-json": "s.json", "--plot": "p.png", "--save": "ckpt", "--export": "m.safetensors"}


def _unwritable(kind: str, tmp_path: Path) -> Path:
    """A folder no output can be written under: one ``/proc`` refuses, a regular file, a read-only folder."""
    if kind == "proc":
        return Path("/proc/none")
    if kind == "under_a_file":
        (tmp_path / "a_file").write_text("x")
        return tmp_path / "a_file" / "sub"
    if os.geteuid() == 0:
        pytest.skip("as root a read-only folder accepts writes: permission bits refuse nothing")
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    return folder / "sub"


@pytest.mark.parametrize("kind", ["proc", "under_a_file", "read_only"])
@pytest.mark.parametrize("flag", list(OUTPUT_FLAGS))
def test_every_output_flag_refuses_an_unwritable_path_before_any_worker(capsys, tmp_path, tiny, flag, kind):
    target = _unwritable(kind, tmp_path) / OUTPUT_FLAGS[flag]
    before = sorted(tmp_path.rglob("*"))
    assert main(["finetune", *tiny, "--steps", "1", flag, str(target)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"perparam finetune: error: {flag} {target} "), err
    assert "cannot be written" in lines[0] and "Traceback" not in err, err
    assert sorted(tmp_path.rglob("*")) == before  # nothing created, nothing left


def test_proving_an_output_path_leaves_nothing_behind(tmp_path):
    """The check creates what will be written (folders, the file) and removes exactly what it created."""
    from perparam.finetune.errors import check_output_path

    check_output_path("--summary-json", tmp_path / "a" / "b" / "s.json")
    check_output_path("--save", tmp_path / "c" / "ckpt", folder=True)
    assert list(tmp_path.iterdir()) == []
    kept = tmp_path / "kept"
    kept.mkdir()
    old = kept / "s.json"
    old.write_text("old summary")
    stamp = old.stat().st_mtime_ns
    check_output_path("--summary-json", old)
    check_output_path("--save", kept, folder=True)
    assert [p.name for p in kept.iterdir()] == ["s.json"]
    assert old.read_text() == "old summary" and old.stat().st_mtime_ns == stamp
    with pytest.raises(FinetuneInputError, match="--save .* is a file: pass a folder"):
        check_output_path("--save", old, folder=True)


def test_a_gguf_flag_pointing_at_a_text_file_is_called_not_a_gguf(capsys, tmp_path, tiny):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    assert_one_line_error(capsys, ["--gguf", str(mine), *tiny[2:]], "is not a GGUF file")
    good = tmp_path / "good.gguf"
    write_tiny_gguf(good, quantize_ffn=False)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    main(["finetune", "--gguf", str(cut), *tiny[2:]])
    err = capsys.readouterr().err
    assert "truncated" in err and "delete" not in err, err  # never advise deleting a file the user passed


def test_a_non_finite_loss_stops_the_run(tiny):
    proc = subprocess.run([sys.executable, "-m", "perparam.cli", "finetune", *tiny, "--nproc", "1", "--steps",
                           "6", "--seq-len", "16", "--batch-size", "1", "--eval-tokens", "32", "--lr",
                           "1e30"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=subprocess_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "the training loss became nan at step" in lines[0], proc.stderr


def test_memory_params_say_what_is_accepted(capsys):
    for bad in ("-5", "abc", "0"):
        with pytest.raises(SystemExit) as exc:
            main(["memory", "--params", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "pass a positive number such as 1.5e9, 1.5B" in err and "parse_count" not in err, err


def test_plan_model_that_cannot_be_imported_says_what_model_takes(capsys):
    assert main(["plan", "--model", "nonexistent.module:factory", "--world", "4"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--model takes package.module:factory, importable" in err[0], err
    assert main(["plan", "--model", "perparam.memory.presets:no_such_factory", "--world", "4"]) != 0
    assert "has no attribute 'no_such_factory'" in capsys.readouterr().err


def test_no_subcommand_is_a_usage_error(capsys):
    assert main([]) == 2
    assert "usage: perparam" in capsys.readouterr().err
    assert main(["--help"]) == 0


def test_plan_on_an_80_column_terminal_never_cuts_a_number(monkeypatch):
    import io

    from rich.console import Console

    from perparam.memory import render

    out = io.StringIO()
    con = Console(file=out, width=80, highlight=False, no_color=True)
    monkeypatch.setattr(render, "console", lambda: con)
    assert main(["plan", "--preset", "gpt2-xl", "--world", "64"]) == 0
    text = out.getvalue()
    assert "…" not in text, text
    for number in ("389,421,600", "24,921,779,200", "18.691334", "+0.005%", "vs formula"):
        assert number in text, (number, text)
    assert "plan: rank 0" in text


@pytest.mark.fast
def test_plan_budget_flags_are_checked_before_planning_in_one_line(capsys, tmp_path):
    plan = ["plan", "--preset", "gpt2-tiny", "--world", "4"]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for extra, expect in [
        (["--budget", "1e6", "--write-policy", str(tmp_path / "missing" / "p.json")], "does not exist"),
        (["--budget", "1e6", "--write-policy", str(a_file / "p.json")], "does not exist"),
        (["--budget", "1e6", "--write-policy", str(tmp_path)], "is a folder"),
        (["--write-policy", str(tmp_path / "p.json")], "add --budget BYTES"),
        (["--offload-dir", str(tmp_path)], "add --budget BYTES"),
        (["--budget", "1e6", "--json"], "drop --json"),
    ]:
        assert main([*plan, *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("perparam plan: ") and expect in err[0], (extra, err)
    assert not list(tmp_path.glob("**/p.json"))
    with pytest.raises(SystemExit) as exc:
        main([*plan, "--budget", "-1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "a byte count must be >= 0" in err and "parse_bytes" not in err, err
