"""Helpers shared by the finetune tests: the command line in a subprocess (``run_finetune``), the tiny run's
flags (``TINY``), the one-line error check (``assert_one_line_error``) and a tiny GGUF file written the way
llama.cpp's converter writes one (``write_tiny_gguf``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from perparam.cli import main
from perparam.finetune.export import llama_hyperparameters
from perparam.finetune.model import Llama, LlamaConfig

REPO = Path(__file__).resolve().parents[1]


def subprocess_env() -> dict:
    env = dict(os.environ)
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def run_finetune(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "perparam.cli", "finetune", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=subprocess_env())


#: the tiny runs of the finetune tests share these flags, so their losses and bytes compare one to one
TINY = ("--config", "tiny", "--steps", "4", "--seq-len", "32", "--batch-size", "4", "--lr", "3e-3",
        "--eval-tokens", "128")


def assert_one_line_error(capsys, argv: list[str], expect: str) -> None:
    code = main(["finetune", *argv])
    err = capsys.readouterr().err
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("perparam finetune: error: "), err
    assert expect in lines[0], lines[0]


MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a")]


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (printable latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def converter_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation, rows ``[heads * head_dim, in]`` -> interleaved rotary pairs per head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=256 + len(MERGES) + 1, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       ffn_dim=64, max_seq_len=256, rope_theta=10000.0, norm_eps=1e-5)


def write_tiny_gguf(path: Path, arch: str = "llama", quantize_ffn: bool = True) -> Llama:
    """Write a random tiny LLaMA to ``path`` as a GGUF file; returns the model it holds."""
    cfg = tiny_gguf_config()
    torch.manual_seed(1)
    model = Llama(cfg)
    with torch.no_grad():  # make the norms non-trivial so a wrong mapping shows
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    import gguf  # the finetune extra; tests that call this skip without it

    writer = gguf.GGUFWriter(str(path), arch)
    llama_hyperparameters(writer, cfg)
    alphabet = byte_alphabet()
    tokens = alphabet + ["".join(m) for m in MERGES] + ["<|endoftext|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_eos_token_id(len(tokens) - 1)
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["embed.weight"])
    writer.add_tensor("output_norm.weight", sd["norm.weight"])
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "attn_norm.weight"])
        q, k = sd[p + "attn.q_proj.weight"], sd[p + "attn.k_proj.weight"]
        writer.add_tensor(f"blk.{i}.attn_q.weight", converter_permute(q, cfg.n_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", converter_permute(k, cfg.n_kv_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "mlp_norm.weight"])
        for gname, name in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            w = sd[p + f"mlp.{name}.weight"]
            if quantize_ffn:
                q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(f"blk.{i}.{gname}.weight", q, raw_shape=q.shape,
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                writer.add_tensor(f"blk.{i}.{gname}.weight", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def count_tracebacks(err: str) -> int:
    return sum("Traceback" in line for line in err.splitlines())
