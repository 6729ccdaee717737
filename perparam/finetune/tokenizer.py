"""Tokenizers: the byte-level BPE stored in a GGUF file's metadata, and a plain byte tokenizer for tests.

Both expose ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` and ``eos_id`` (or None),
and both round-trip exactly: ``decode(encode(s)) == s`` for any string.

The GGUF keeps the BPE as ``tokenizer.ggml.tokens`` (id -> token string, in GPT-2's byte-to-unicode alphabet,
e.g. ``"Ġthe"`` for ``" the"``), ``tokenizer.ggml.merges`` (``"Ġ t"`` pairs in priority order) and
``tokenizer.ggml.pre`` (the name of the pre-tokenizer regex). We rebuild a ``tokenizers.Tokenizer`` from them.
"""

from __future__ import annotations

from perparam.finetune.errors import FinetuneInputError

# llama.cpp's name of the pre-tokenizer -> split digits one by one before the GPT-2 byte-level regex?
# ("smollm": SmolLM/SmolLM2; "gpt2" and friends: the plain GPT-2 regex.)
DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact"}
PLAIN_GPT2_PRE = {"gpt2", "default", "gpt-2", "", None}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values of special tokens


class ByteTokenizer:
    """One token per UTF-8 byte (vocab 256, no special tokens): the tokenizer of the ``tiny`` config."""

    vocab_size = 256
    eos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class GGUFTokenizer:
    """A byte-level BPE tokenizer rebuilt from GGUF metadata (``tokenizer.ggml.model == "gpt2"``)."""

    def __init__(self, tokenizer, eos_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id = eos_id

    @classmethod
    def from_reader(cls, reader, path: str = "GGUF") -> GGUFTokenizer:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        from perparam.finetune.gguf_loader import field_value

        kind = field_value(reader, "tokenizer.ggml.model")
        pre = field_value(reader, "tokenizer.ggml.pre")
        if kind != "gpt2" or (pre not in DIGIT_SPLITTING_PRE and pre not in PLAIN_GPT2_PRE):
            raise FinetuneInputError(f"{path!r} has a {kind!r} tokenizer with pre-tokenizer {pre!r}; only "
                                     "GPT-2 style byte-level BPE is supported: pass --gguf PATH to such a "
                                     "model")
        tokens = list(field_value(reader, "tokenizer.ggml.tokens"))
        merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges", [])]
        types = list(field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
        vocab = {tok: i for i, tok in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in DIGIT_SPLITTING_PRE:
            digits = pre_tokenizers.Digits(individual_digits=True)
            tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        specials = [AddedToken(t, special=True, normalized=False)
                    for t, k in zip(tokens, types, strict=False) if k in (CONTROL, USER_DEFINED)]
        tok.add_special_tokens(specials)
        eos = field_value(reader, "tokenizer.ggml.eos_token_id")
        return cls(tok, None if eos is None else int(eos))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(path) -> GGUFTokenizer:
    """The tokenizer stored in the GGUF file at ``path``."""
    from perparam.finetune.gguf_loader import open_gguf

    return GGUFTokenizer.from_reader(open_gguf(path), str(path))
