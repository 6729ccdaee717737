"""The main job's pieces in one process, no assets: model, byte tokenizer, text sources, batches."""

from __future__ import annotations

import pytest
import torch

from perparam.finetune.data import BatchStream, prepare_data, split_heldout, text_documents, to_rows
from perparam.finetune.errors import FinetuneInputError
from perparam.finetune.model import Llama, LlamaConfig, next_token_loss
from perparam.finetune.tokenizer import ByteTokenizer

pytestmark = pytest.mark.fast


def test_smollm2_config_counts_134_5m_params():
    cfg = LlamaConfig.smollm2_135m()
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.num_params() == 134_515_008
    with torch.device("meta"):
        model = Llama(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_meta_build_then_to_empty_and_init_matches_direct_build():
    cfg = LlamaConfig.tiny()
    direct = Llama(cfg)
    torch.manual_seed(3)
    direct.reset_parameters()
    meta = Llama(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters()) and not list(meta.buffers())
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.reset_parameters()
    for (name, a), b in zip(direct.named_parameters(), meta.parameters(), strict=True):
        assert torch.equal(a, b), name
    tokens = torch.randint(0, cfg.vocab_size, (3, 10))
    logits = meta(tokens)
    assert logits.shape == (3, 10, cfg.vocab_size)
    # random init predicts about uniformly: loss on random targets near ln(vocab)
    targets = torch.randint(0, cfg.vocab_size, (3, 10))
    assert abs(next_token_loss(logits, targets).item() - torch.log(torch.tensor(256.0)).item()) < 0.3


def test_attention_is_causal():
    model = Llama(LlamaConfig.tiny())
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8])


def test_untied_config_has_its_own_head():
    cfg = LlamaConfig(**{**LlamaConfig.tiny().__dict__, "tie_embeddings": False})
    model = Llama(cfg)
    assert model.lm_head is not None and model.lm_head_weight is model.lm_head.weight
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    for text in ["", "  Leading spaces\nand\r\nnewlines", "naïve — 日本語 🙂"]:
        assert tok.decode(tok.encode(text)) == text


def test_rows_and_batches_are_deterministic_and_split_by_rank():
    rows = to_rows([list(range(50)), list(range(100, 150))], seq_len=9, eos_id=999)
    assert rows.shape == (10, 10) and rows.flatten()[50] == 999  # 50 + eos + 50 tokens -> 10 rows of 10
    assert torch.equal(rows.flatten()[:50], torch.arange(50))
    stream = BatchStream(rows, batch_size=4, seed=7)
    again = BatchStream(rows, batch_size=4, seed=7)
    for step in range(5):  # crosses epochs (10 rows, 4 per step)
        x, y = stream.global_batch(step)
        assert torch.equal(x, again.global_batch(step)[0])
        assert x.shape == y.shape == (4, 9) and torch.equal(x[:, 1:], y[:, :-1])
        parts = [stream.rank_batch(step, r, 2)[0] for r in range(2)]
        assert torch.equal(torch.cat(parts), x)
    epoch0 = torch.cat([stream.global_batch(s)[0] for s in (0, 1)] + [stream.global_batch(2)[0][:2]])
    assert len({tuple(r.tolist()) for r in epoch0}) == 10  # one epoch visits every row once


def test_text_sources_and_heldout_split(tmp_path):
    (tmp_path / "b.txt").write_text("second work\n" * 20)
    (tmp_path / "a.txt").write_text("first work\n" * 20)
    (tmp_path / ".hidden").write_text("skip me")
    docs = text_documents(tmp_path)
    assert [n for n, _ in docs] == ["a.txt", "b.txt"]
    train, held = split_heldout(docs)
    assert [n for n, _ in train] == ["a.txt"] and [n for n, _ in held] == ["b.txt"]
    train, held = split_heldout(docs[:1])
    assert train[0][1] + held[0][1] == docs[0][1] and held[0][1].startswith("first")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FinetuneInputError, match="no non-empty text"):
        text_documents(empty)
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(FinetuneInputError, match="not UTF-8"):
        text_documents(tmp_path)


def test_prepare_data_sizes_and_too_small_for_world():
    docs = [("a", "x" * 2000), ("b", "y" * 700)]
    data = prepare_data(docs, (), ByteTokenizer(), seq_len=63, world=2, eval_tokens=200, source="t")
    assert data.train.shape == (31, 64) and data.heldout.shape == (4, 64)  # 4 = ceil(200/63) -> even
    with pytest.raises(FinetuneInputError, match="larger than the data allows"):
        prepare_data(docs, (), ByteTokenizer(), seq_len=63, world=16, eval_tokens=200, source="t")


def test_the_job_config_is_built_once_from_the_command_line():
    import argparse

    from perparam.finetune.cli import add_arguments
    from perparam.finetune.config import JobConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", "tiny", "--steps", "3", "--save", "x", "--quant", "nf4"])
    cfg = JobConfig.from_args(args)
    assert (cfg.config, cfg.steps, cfg.save, cfg.quant, cfg.resume) == ("tiny", 3, "x", "nf4", None)
    assert cfg.batch_size == args.batch_size and cfg.lr == args.lr
    assert cfg.memory_budget is None and cfg.param_dtype == "fp32"
    with pytest.raises(KeyError):  # every flag is read: a Namespace without one is a bug, not a default
        JobConfig.from_args(argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "tp"}))
    budget = JobConfig.from_args(parser.parse_args(["--memory-budget", "1.5GiB"])).memory_budget
    assert budget == 3 * 2 ** 29  # parsed to bytes once, at the boundary
