"""``perparam finetune --export``: the trained model as GGUF and safetensors, read back exactly.

One tiny run on 2 ranks under ``--tp 2`` saves a checkpoint and exports both files; the checkpoint loaded
into one process is the reference. A second run loads the exported GGUF (``--gguf``, HSDP layout) for zero
steps and exports it again as safetensors: its held-out loss equals the first run's after training.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.finetune_helpers import TINY, assert_one_line_error, run_finetune

gguf = pytest.importorskip("gguf")
safetensors_torch = pytest.importorskip("safetensors.torch")

from perparam.finetune import export  # noqa: E402
from perparam.finetune.gguf_loader import load_llama, unpermute_rows  # noqa: E402
from perparam.finetune.model import Llama, LlamaConfig  # noqa: E402

FLAGS = [a for a in TINY if a not in ("--config", "tiny")]  # the same sizes, for a --gguf run


def _run(text: Path, summary: Path, *flags: str) -> dict:
    proc = run_finetune(*flags, "--text", str(text), "--nproc", "2", "--summary-json", str(summary))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def exported(tmp_path_factory, text_dir) -> dict:
    out = tmp_path_factory.mktemp("export")
    trained = _run(text_dir, out / "a.json", *TINY, "--tp", "2", "--save", str(out / "ckpt"),
                   "--export", str(out / "a.gguf"), "--export", str(out / "a.safetensors"))
    reloaded = _run(text_dir, out / "b.json", *FLAGS, "--steps", "0", "--dp-replicate", "2",
                    "--gguf", str(out / "a.gguf"), "--export", str(out / "b.safetensors"))
    from perparam import checkpoint

    model = Llama(LlamaConfig.tiny())
    checkpoint.load(checkpoint.latest(out / "ckpt"), model)  # the trained weights, in one process
    return {"out": out, "trained": trained, "reloaded": reloaded, "model": model}


def test_exported_gguf_holds_the_trained_tensors_and_gives_the_same_heldout_loss(exported):
    out, reference = exported["out"], exported["model"].state_dict()
    loaded, cfg = load_llama(out / "a.gguf")  # the main job's own loader (q/k rows un-permuted)
    assert cfg == LlamaConfig.tiny()
    state = loaded.state_dict()
    assert state.keys() == reference.keys()
    for name, value in reference.items():
        assert torch.equal(state[name], value), name
    reader = gguf.GGUFReader(out / "a.gguf")  # any GGUF reader: types and the byte vocabulary
    assert {t.tensor_type for t in reader.tensors} == {gguf.GGMLQuantizationType.F32}
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 256
    before, after = exported["reloaded"]["heldout_loss_before"], exported["trained"]["heldout_loss_after"]
    assert abs(before - after) <= 1e-5, (before, after)
    info = exported["trained"]["export"]
    assert info["files"][str(out / "a.gguf")]["bytes"] == (out / "a.gguf").stat().st_size
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_exported_safetensors_have_hugging_face_names_and_the_exact_values(exported):
    out, reference = exported["out"], exported["model"].state_dict()
    tensors = safetensors_torch.load_file(out / "a.safetensors")
    assert "model.layers.1.self_attn.q_proj.weight" in tensors and "lm_head.weight" not in tensors  # tied
    assert tensors.keys() == export.hf_state(reference).keys()
    for name, value in export.hf_state(reference).items():
        assert torch.equal(tensors[name], value), name
    again = safetensors_torch.load_file(out / "b.safetensors")  # GGUF -> HSDP model -> safetensors
    assert all(torch.equal(again[k], v) for k, v in tensors.items())
    from safetensors import safe_open

    with safe_open(out / "a.safetensors", "pt") as f:
        config = json.loads(f.metadata()["config"])
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (2, True)
    assert os.stat(out / "a.safetensors").st_mode & 0o044  # readable as any file the user creates


def _load_on_ranks(rank: int, world: int, path: str, tp: int) -> tuple[int, dict | None]:
    """Rank ``rank`` of the main job's GGUF loading: how often it opened the file, and rank 0's gathered
    state."""
    from perparam.checkpoint import full_state_dict
    from perparam.finetune import gguf_loader
    from perparam.finetune.train import build_meshes, build_sharded_model

    opened, real_open = [], gguf_loader.open_gguf
    gguf_loader.open_gguf = lambda *a, **k: opened.append(a) or real_open(*a, **k)
    from perparam.finetune.config import JobConfig

    # the job's own config (every field the job reads has its default; a stand-in would miss new fields)
    args = JobConfig(steps=0, seq_len=8, batch_size=1, lr=0.0, seed=0, config="gguf", gguf_path=path)
    model, _, _ = build_sharded_model(args, torch.device("cpu"), build_meshes(world, 1, tp, "cpu"))
    return len(opened), full_state_dict(model)


@pytest.mark.parametrize("tp", [1, 2])
def test_only_rank_0_reads_the_gguf_and_the_sharded_model_holds_its_weights(tmp_path, tp):
    from tests.distributed import run_distributed
    from tests.finetune_helpers import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)  # q/k rows permuted, Q8_0 MLP weights
    (opened0, state), (opened1, _) = run_distributed(_load_on_ranks, 2, str(path), tp)
    assert (opened0, opened1) == (1, 0)
    reference, _ = load_llama(path)  # the old path: every weight read and dequantised in one process
    assert state.keys() == reference.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())


def _tiny_state() -> tuple[dict[str, torch.Tensor], LlamaConfig]:
    torch.manual_seed(0)
    cfg = LlamaConfig.tiny()
    return {k: v.detach().clone() for k, v in Llama(cfg).state_dict().items()}, cfg


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_precision_exports_equal_torch_casts(tmp_path, dtype):
    state, cfg = _tiny_state()
    cast = export.EXPORT_DTYPES[dtype]
    export.write_gguf(tmp_path / "m.gguf", state, cfg, dtype)
    export.write_safetensors(tmp_path / "m.safetensors", state, cfg, dtype)
    loaded, _ = load_llama(tmp_path / "m.gguf")
    for name, value in loaded.state_dict().items():
        expected = state[name] if state[name].dim() == 1 else state[name].to(cast).float()  # norms stay F32
        assert torch.equal(value, expected), name
    tensors = safetensors_torch.load_file(tmp_path / "m.safetensors")
    for name, value in export.hf_state(state).items():
        assert tensors[name].dtype == cast and torch.equal(tensors[name], value.to(cast)), name
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    assert reader.fields["general.file_type"].contents() == export.GGUF_FILE_TYPES[dtype]


def test_permute_rows_inverts_the_loaders_unpermutation():
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(4 * 8, 3)  # 4 heads of head_dim 8
    assert torch.equal(unpermute_rows(export.permute_rows(w, 4), 4), w)
    assert torch.equal(export.permute_rows(unpermute_rows(w, 4), 4), w)


def test_bad_export_paths_stop_before_any_worker_starts(capsys, tmp_path, text_dir, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = ["--config", "tiny", "--text", str(text_dir)]
    assert_one_line_error(capsys, [*tiny, "--export", str(tmp_path / "m.bin")], "unknown suffix '.bin'")
    assert_one_line_error(capsys, [*tiny, "--export", str(tmp_path)], "unknown suffix")
    (tmp_path / "dir.gguf").mkdir()
    assert_one_line_error(capsys, [*tiny, "--export", str(tmp_path / "dir.gguf")], "is a folder")
    (tmp_path / "file").write_text("")
    assert_one_line_error(capsys, [*tiny, "--export", str(tmp_path / "file" / "m.gguf")],
                          "is a file, not a folder")
    assert_one_line_error(capsys,
                          [*tiny, "--export", str(tmp_path / "a.gguf"), "--export",
                           str(tmp_path / "b.gguf")], "pass one path per suffix")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_one_line_error(capsys, [*tiny, "--export", str(locked / "m.gguf")], "no permission")
