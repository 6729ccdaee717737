"""``perparam finetune --export PATH``: the fine-tuned model as a GGUF or a safetensors file.

Every rank calls :func:`export_model`; the unsharded weights are gathered to rank 0 one parameter at a time
by :func:`export_state` (by default ``perparam.checkpoint.full_state_dict``: plain CPU tensors under the
:class:`~perparam.finetune.model.Llama` names) and only rank 0 writes, into a temporary file next to
``PATH`` that is renamed over it when complete (a run killed mid-write leaves no partial ``PATH``).

- ``.gguf`` (``gguf.GGUFWriter``): every metadata field of the input GGUF (``general.*``, ``llama.*``, the
  ``tokenizer.*`` vocabulary and merges) except ``general.file_type``, which names the new tensor type;
  with ``--config tiny`` a minimal LLaMA set and the byte vocabulary (256 tokens in GPT-2's byte alphabet,
  no merges). Matrices in F32, F16 or BF16 (``--export-dtype``); 1-D norm weights stay F32, as llama.cpp's
  converter writes them. ``attn_q``/``attn_k`` rows are permuted back to llama.cpp's interleaved order
  (:func:`permute_rows`, the inverse of ``gguf_loader.unpermute_rows``).
- ``.safetensors`` (``safetensors.torch.save_file``): Hugging Face ``LlamaForCausalLM`` names
  (:data:`HF_LAYER_NAMES`), every tensor in the export dtype. q/k rows are stored as they are: the model's
  "rotate half" order is Hugging Face's (llama.cpp's converter applies :func:`permute_rows` to HF weights).
  A tied model has no ``lm_head.weight`` (as Hugging Face saves it). The header's metadata holds
  ``format: pt`` and ``config``: a Hugging Face ``config.json`` as a JSON string.

LoRA and other adapters: :func:`export_model` takes ``state_fn(model) -> {name: tensor} | None``; a run
with adapters passes one that merges them into the base weights and returns the base model's names
(``embed.weight``, ``layers.N.attn.q_proj.weight``, ...), plain CPU tensors on rank 0 and ``None`` elsewhere.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from perparam.finetune.errors import FinetuneInputError, write_output
from perparam.finetune.gguf_loader import LAYER_TENSORS, TOP_TENSORS
from perparam.finetune.model import LlamaConfig

SUFFIXES = (".gguf", ".safetensors")
EXPORT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
#: parameter name inside ``layers.{i}.`` -> Hugging Face name inside ``model.layers.{i}.``
HF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
}
HF_TOP_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "lm_head.weight": "lm_head.weight"}
#: ``general.file_type`` (llama.cpp's ``LLAMA_FTYPE``) of a file whose matrices are in that dtype
GGUF_FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}


def check_export_args(paths, dtype: str = "f32") -> None:
    """Launcher-side checks of ``--export`` (before any worker starts), one line each: the suffix, one file
    per suffix. (That each path can be written is proven with the other output paths:
    ``perparam.finetune.cli.check_outputs``.)"""
    seen: dict[str, str] = {}
    for path in paths or ():
        suffix = Path(path).suffix.lower()
        if suffix not in SUFFIXES:
            raise FinetuneInputError(f"--export {path}: unknown suffix {suffix or '(none)'!r}: pass a path "
                                     "ending in .gguf or .safetensors")
        if suffix in seen:
            raise FinetuneInputError(f"--export {path}: a {suffix} file is already exported to "
                                     f"{seen[suffix]}: pass one path per suffix")
        seen[suffix] = path
    if dtype not in EXPORT_DTYPES:
        raise FinetuneInputError(f"--export-dtype {dtype}: pass one of {', '.join(EXPORT_DTYPES)}")


def export_state(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The unsharded weights to export: ``perparam.checkpoint.full_state_dict(model)`` (every rank calls it;
    rank 0 gets ``{name: CPU tensor}``, the others ``None``)."""
    from perparam.checkpoint import full_state_dict

    return full_state_dict(model)


def export_model(model: torch.nn.Module, cfg: LlamaConfig, paths, dtype: str = "f32",
                 source_gguf: str | None = None,
                 state_fn: Callable[[torch.nn.Module], dict | None] = export_state) -> dict | None:
    """Gather the weights with ``state_fn`` (a collective: every rank calls this) and write each of
    ``paths`` on rank 0. Returns ``{"dtype", "gather_s", "files": {path: {"bytes", "seconds"}}}`` on rank 0
    (seconds of wall time), None elsewhere. ``source_gguf``: the input GGUF whose metadata and tokenizer a
    ``.gguf`` export copies (None: ``--config tiny``). Raises :class:`FinetuneInputError` when a file cannot
    be written."""
    start = time.perf_counter()
    state = state_fn(model)
    if state is None:
        return None
    info: dict = {"dtype": dtype, "gather_s": time.perf_counter() - start, "files": {}}
    for path in paths:
        t0 = time.perf_counter()
        if Path(path).suffix.lower() == ".gguf":
            write_gguf(path, state, cfg, dtype, source_gguf)
        else:
            write_safetensors(path, state, cfg, dtype)
        done = info["files"][str(path)] = {"bytes": Path(path).stat().st_size,
                                           "seconds": time.perf_counter() - t0}
        print(f"exported {path} ({dtype}, {done['bytes'] / 1e6:.1f} MB) in {done['seconds']:.1f} s",
              flush=True)
    return info


def permute_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's q/k row order from the model's: per head, first halves then second halves -> interleaved
    rotary pairs; row ``s * head_dim/2 + j`` of a head moves to row ``2j + s``. ``weight``
    ``[n_heads * head_dim, in]``; the inverse of ``gguf_loader.unpermute_rows``."""
    rows, cols = weight.shape
    half = rows // n_heads // 2
    return (weight.reshape(n_heads, 2, half, cols)  # [heads, 2 (x, y), head_dim/2, in]
            .transpose(1, 2)  # [heads, head_dim/2 pairs, 2, in]
            .reshape(rows, cols))


def _cast(t: torch.Tensor, dtype: str) -> torch.Tensor:
    return t.detach().to("cpu", EXPORT_DTYPES[dtype]).contiguous()


# ------------------------------------------------------------------------------------------------ safetensors


def hf_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` under Hugging Face LLaMA names (``model.layers.3.self_attn.q_proj.weight``); raises
    :class:`FinetuneInputError` for a name it does not know."""
    out = {}
    for name, value in state.items():
        parts = name.split(".", 2)
        if name in HF_TOP_NAMES:
            out[HF_TOP_NAMES[name]] = value
        elif len(parts) == 3 and parts[0] == "layers" and parts[2] in HF_LAYER_NAMES:
            out[f"model.layers.{parts[1]}.{HF_LAYER_NAMES[parts[2]]}"] = value
        else:
            raise FinetuneInputError(f"--export: the model has a tensor {name!r} that has no Hugging Face "
                                     "LLaMA name (merge adapters into the base weights before exporting)")
    return out


def hf_config(cfg: LlamaConfig, dtype: str) -> dict:
    """A Hugging Face ``config.json`` for ``LlamaForCausalLM`` with ``cfg``'s hyper-parameters."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
            "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
            "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False,
            "mlp_bias": False, "torch_dtype": {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[dtype]}


def write_safetensors(path, state: dict[str, torch.Tensor], cfg: LlamaConfig, dtype: str = "f32") -> None:
    """``state`` (model names) as a safetensors file with Hugging Face names, every tensor cast to
    ``dtype``."""
    from safetensors.torch import save_file

    tensors = {k: _cast(v, dtype) for k, v in hf_state(state).items()}
    metadata = {"format": "pt", "config": json.dumps(hf_config(cfg, dtype))}
    write_output("--export", path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


# ------------------------------------------------------------------------------------------------------- GGUF


def gguf_name(name: str) -> str:
    """``"layers.3.attn.q_proj.weight"`` -> ``"blk.3.attn_q.weight"`` (inverse of the loader's table)."""
    top = {v: k for k, v in TOP_TENSORS.items()}
    if name in top:
        return top[name]
    layer = {v: k for k, v in LAYER_TENSORS.items()}
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in layer:
        return f"blk.{parts[1]}.{layer[parts[2]]}"
    raise FinetuneInputError(f"--export: the model has a tensor {name!r} that has no GGUF name (merge "
                             "adapters into the base weights before exporting)")


def gguf_tensors(state: dict[str, torch.Tensor], cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor in the file's row order (q/k permuted), fp32; in the model's parameter order."""
    out = {}
    for name, value in state.items():
        key = gguf_name(name)
        if key.endswith("attn_q.weight"):
            value = permute_rows(value, cfg.n_heads)
        elif key.endswith("attn_k.weight"):
            value = permute_rows(value, cfg.n_kv_heads)
        out[key] = value
    return out


def byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte 0..255 (token id b is byte b, as ``ByteTokenizer``'s)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _copy_metadata(writer, source_gguf: str) -> None:
    """Every key of ``source_gguf`` but the reader's own (``GGUF.*``), the architecture (the writer sets
    it), the alignment (the writer's default) and the file type (set by the caller)."""
    import gguf

    reader = gguf.GGUFReader(source_gguf)
    skip = {"general.architecture", "general.alignment", "general.file_type"}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def _tiny_metadata(writer, cfg: LlamaConfig) -> None:
    """A minimal LLaMA metadata set and the byte vocabulary of ``--config tiny`` (no merges)."""
    writer.add_name("perparam tiny")
    llama_hyperparameters(writer, cfg)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_alphabet())
    writer.add_token_types([1] * 256)


def llama_hyperparameters(writer, cfg: LlamaConfig) -> None:
    """The ``llama.*`` keys of ``cfg`` (what ``gguf_loader.read_config`` reads back) on a ``GGUFWriter``."""
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.max_seq_len)
    writer.add_embedding_length(cfg.dim)
    writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(cfg.vocab_size)


def write_gguf(path, state: dict[str, torch.Tensor], cfg: LlamaConfig, dtype: str = "f32",
               source_gguf: str | None = None) -> None:
    """``state`` (model names, fp32) as a GGUF file: the metadata of ``source_gguf`` (or the tiny set),
    2-D tensors in ``dtype``, 1-D ones in F32, q/k rows in llama.cpp's order."""
    import gguf

    if source_gguf is None and cfg.vocab_size != 256:
        raise FinetuneInputError("--export .gguf without an input GGUF: only the byte vocabulary of --config "
                                 "tiny can be written; run from --gguf PATH")
    raw = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}

    def write(tmp: str) -> None:
        writer = gguf.GGUFWriter(tmp, "llama")
        if source_gguf is not None:
            _copy_metadata(writer, source_gguf)
        else:
            _tiny_metadata(writer, cfg)
        writer.add_file_type(GGUF_FILE_TYPES[dtype])
        for name, value in gguf_tensors(state, cfg).items():
            if value.dim() == 1 or dtype == "f32":
                writer.add_tensor(name, _cast(value, "f32").numpy())
            else:  # numpy has no bfloat16: hand over the bits, cast by torch (round to nearest even)
                bits = _cast(value, dtype).view(torch.int16).numpy()
                writer.add_tensor(name, bits, raw_dtype=raw[dtype])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    write_output("--export", path, write)
