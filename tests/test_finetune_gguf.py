"""GGUF loading without the downloaded assets: a tiny LLaMA written with ``gguf.GGUFWriter`` the way
llama.cpp's converter writes one (q/k rows permuted, byte-level BPE vocabulary), read back by our loader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from perparam.finetune.errors import FinetuneInputError
from perparam.finetune.gguf_loader import load_llama, open_gguf, read_config, unpermute_rows
from perparam.finetune.model import Llama, apply_rotary, rotary_cos_sin
from perparam.finetune.tokenizer import GGUFTokenizer
from tests.finetune_helpers import converter_permute, tiny_gguf_config, write_tiny_gguf

pytestmark = pytest.mark.fast

gguf = pytest.importorskip("gguf")

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Llama]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


def test_unpermute_inverts_the_converter_permutation():
    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)  # 4 heads of head_dim 8
    back = unpermute_rows(torch.from_numpy(converter_permute(w, 4)), 4)
    assert torch.equal(back, torch.from_numpy(w))


def test_rotate_half_on_unpermuted_rows_equals_interleaved_rotary_on_gguf_rows():
    """Attention scores are the same either way: the loader's un-permutation matches the rotary layout."""
    torch.manual_seed(0)
    heads, hd, seq, dim = 2, 8, 5, 6
    wq, x = torch.randn(heads * hd, dim), torch.randn(seq, dim)
    cos, sin = rotary_cos_sin(seq, hd, 10000.0, torch.device("cpu"))
    q_half = apply_rotary((x @ wq.T).view(seq, heads, hd).transpose(0, 1), cos, sin)  # [heads, seq, hd]
    # interleaved ("GPT-J") rotary on the converter's row order: pairs (2j, 2j+1) rotate by angle j
    q_pairs = (x @ torch.from_numpy(converter_permute(wq.numpy(), heads)).T).view(seq, heads, hd // 2, 2)
    angle = torch.outer(torch.arange(seq).float(), 10000.0 ** (-torch.arange(0, hd, 2).float() / hd))
    c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [seq, 1, hd/2]
    a, b = q_pairs[..., 0], q_pairs[..., 1]
    q_inter = torch.stack([a * c - b * s, a * s + b * c], dim=-1).transpose(0, 1)  # [heads, seq, hd/2, 2]
    scores_half = q_half @ q_half.transpose(1, 2)
    scores_inter = q_inter.flatten(2) @ q_inter.flatten(2).transpose(1, 2)
    torch.testing.assert_close(scores_half, scores_inter, rtol=1e-5, atol=1e-5)


def test_loads_config_and_weights(tiny_gguf):
    path, original = tiny_gguf
    model, cfg = load_llama(path)
    assert cfg == tiny_gguf_config()
    expected = original.state_dict()
    for name, value in model.state_dict().items():
        tol = 0.02 if "mlp." in name and name.endswith("proj.weight") else 0.0  # Q8_0 vs exact F32
        torch.testing.assert_close(value, expected[name], rtol=0, atol=tol, msg=name)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), original(tokens), rtol=0, atol=0.05)


def test_gguf_tokenizer_round_trips_and_merges(tiny_gguf):
    tok = GGUFTokenizer.from_reader(open_gguf(tiny_gguf[0]))
    assert tok.eos_id == tok.vocab_size - 1
    ids = tok.encode(" the")
    assert [tok.tokenizer.id_to_token(i) for i in ids] == ["Ġthe"]
    for text in ["", " the theatre\n\n  a", "2024 ünïcødé ✓\ttab", "<|endoftext|> after"]:
        assert tok.decode(tok.encode(text)) == text


def test_missing_truncated_and_foreign_files_raise_one_line_errors(tmp_path, tiny_gguf):
    with pytest.raises(FinetuneInputError, match="does not exist"):
        open_gguf(tmp_path / "nope.gguf")
    data = tiny_gguf[0].read_bytes()
    for cut in (10, len(data) // 2, len(data) - 7):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(FinetuneInputError, match="truncated or corrupt") as info:
            open_gguf(bad)
        assert "\n" not in str(info.value)
    other = tmp_path / "gpt2.gguf"
    write_tiny_gguf(other, arch="gpt2", quantize_ffn=False)
    with pytest.raises(FinetuneInputError, match="architecture 'gpt2'"):
        read_config(open_gguf(other), other)
