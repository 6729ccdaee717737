"""``perparam finetune --generate PROMPT``: text sampled from the sharded model, before and after fine-tuning.

Sampling runs on the sharded model itself, inside ``evaluation.parameters_kept_gathered``: each group is
all-gathered once when a generation starts and kept (``set_reshard_after_forward(False)``), so the forwards
(one per new token) issue no all-gather at all; the groups are resharded (storage freed) when the
generation ends. There is no KV cache: each new token recomputes the
forward over the whole prefix (``[1, prompt + generated]`` tokens), which is cheap at these lengths.

Every rank runs the same forwards (they are collectives under tensor parallelism, and the hooks expect the
same modules called in the same order on every rank). The next token is drawn from rank 0's logits with a
CPU ``torch.Generator`` seeded by ``--sample-seed`` and broadcast to the other ranks, so all ranks extend the
same text; data parallelism does not change the forward's arithmetic, so 1, 2 or 4 ranks give the same text
for the same seed (tensor parallelism changes only the order of some sums: a token could differ only where
two candidates' cumulative probabilities meet within rounding).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from perparam.finetune.errors import FinetuneInputError
from perparam.finetune.evaluation import parameters_kept_gathered


@dataclass(frozen=True)
class SamplingConfig:
    """``--max-new-tokens`` (tokens), ``--temperature`` (0: greedy), ``--top-k`` (0: the whole vocabulary),
    ``--sample-seed``."""

    max_new_tokens: int = 40
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0


def check_sampling(prompts: list[str], sampling: SamplingConfig) -> None:
    """One-line :class:`FinetuneInputError` for a bad sampling flag (launcher, before any worker starts)."""
    for prompt in prompts:
        if not prompt:
            raise FinetuneInputError("--generate '' is empty: pass the text to continue, e.g. --generate "
                                     "'ROMEO:'")
    if sampling.max_new_tokens < 1:
        raise FinetuneInputError(f"--max-new-tokens {sampling.max_new_tokens} must be at least 1")
    if not (sampling.temperature >= 0 and sampling.temperature != float("inf")):
        raise FinetuneInputError(f"--temperature {sampling.temperature} must be a finite number >= 0 "
                                 "(0: greedy)")
    if sampling.top_k < 0:
        raise FinetuneInputError(f"--top-k {sampling.top_k} must be 0 (the whole vocabulary) or more")


def check_prompt_lengths(prompts: list[str], tokenizer, max_new_tokens: int, context: int) -> None:
    """Each prompt's tokens plus ``max_new_tokens`` must fit the model's ``context`` (tokens)."""
    for prompt in prompts:
        n = len(tokenizer.encode(prompt))
        if n + max_new_tokens > context:
            raise FinetuneInputError(f"--generate {prompt[:40]!r}...: {n} prompt tokens + --max-new-tokens "
                                     f"{max_new_tokens} exceed the model's context of {context}: pass a "
                                     "shorter prompt or fewer new tokens")


def next_token(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator) -> int:
    """One token id from ``logits`` ``[vocab]`` (fp32, CPU): argmax at temperature 0, else a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits when ``top_k`` > 0."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < logits.numel():
        kth = torch.topk(logits, sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: list[int], sampling: SamplingConfig, device: torch.device,
             eos_id: int | None = None) -> list[int]:
    """The new token ids (at most ``max_new_tokens``; stops at ``eos_id``, which is left out) continuing
    ``prompt_ids``.

    A collective: every rank calls it with the same arguments. The forwards see ``[1, prompt + generated]``
    token ids; the token is drawn on rank 0 and broadcast (one int64) from it.
    """
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens = torch.tensor([prompt_ids], dtype=torch.int64, device=device)  # [1, prompt]
    new: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with parameters_kept_gathered(model):
            for _ in range(sampling.max_new_tokens):
                logits = model(tokens)[0, -1].float().cpu()  # [vocab]
                chosen = torch.tensor([next_token(logits, sampling, generator)], dtype=torch.int64,
                                      device=device)
                if dist.is_initialized() and dist.get_world_size() > 1:
                    dist.broadcast(chosen, src=0)
                if eos_id is not None and int(chosen) == eos_id:
                    break
                new.append(int(chosen))
                tokens = torch.cat([tokens, chosen.view(1, 1)], dim=1)  # [1, prompt + len(new)]
    finally:
        model.train(was_training)
    return new


def from_rank_0(value):
    """``value`` as rank 0 holds it, on every rank (``broadcast_object_list``; as is without a group)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def load_tokenizer(config: str, gguf_path: str | None):
    """The tokenizer the worker decodes samples with: bytes for ``tiny``, the GGUF's BPE otherwise."""
    if config == "tiny":
        from perparam.finetune.tokenizer import ByteTokenizer

        return ByteTokenizer()
    from perparam.finetune.tokenizer import load_tokenizer as gguf_tokenizer

    return gguf_tokenizer(gguf_path)


def print_samples(prompts: list[str], before: list[str], after: list[str], sampling: SamplingConfig) -> None:
    """Rank 0: a rich table, one row per prompt, the text before and after fine-tuning side by side."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    how = "greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature:g}"
    if sampling.top_k and sampling.temperature:
        how += f", top-k {sampling.top_k}"
    table = Table(title=f"Samples ({sampling.max_new_tokens} new tokens, {how}, seed {sampling.seed})",
                  show_lines=True)
    table.add_column("prompt", style="bold")
    table.add_column("before fine-tuning")
    table.add_column("after fine-tuning")
    for prompt, b, a in zip(prompts, before, after, strict=True):
        table.add_row(escape(prompt), escape(prompt + b), escape(prompt + a))
    Console().print(table)


class Samples:
    """``--generate``: the prompts' continuations sampled from the sharded model when built (before
    training) and by :meth:`after` (which prints both side by side on rank 0); no prompts, no work.

    Only rank 0 reads the tokenizer (from the GGUF, as only it reads the weights): it encodes the prompts
    and decodes the samples, and the token ids and texts are broadcast from it.
    """

    def __init__(self, cfg, run) -> None:
        """``cfg``: the job's ``JobConfig``; ``run``: its ``Run`` (model, device, rank)."""
        self.cfg, self.run, self.prompts = cfg, run, list(cfg.generate or [])
        self.sampling = SamplingConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.sample_seed)
        self.seconds, self.all_gathers, self.before = 0.0, 0, []
        if not self.prompts:
            return
        self.tokenizer = load_tokenizer(cfg.config, cfg.gguf_path) if run.rank == 0 else None
        encoded = None
        if run.rank == 0:
            encoded = ([self.tokenizer.encode(p) for p in self.prompts], self.tokenizer.eos_id)
        self.prompt_ids, self.eos_id = from_rank_0(encoded)
        self.before = self._sample()

    def _sample(self) -> list[str]:
        """Every prompt's continuation (a collective); the texts as rank 0 decodes them."""
        from perparam import CommCounter

        began = time.perf_counter()
        with CommCounter() as comm:
            new = [generate(self.run.model, ids, self.sampling, self.run.device, self.eos_id)
                   for ids in self.prompt_ids]
        self.seconds += time.perf_counter() - began
        self.all_gathers += comm.count("all_gather")
        return from_rank_0([self.tokenizer.decode(ids) for ids in new] if self.run.rank == 0 else None)

    def after(self) -> dict:
        """The summary's ``samples`` (prompt, before, after) and ``sampling`` settings."""
        if not self.prompts:
            return {}
        after = self._sample()
        if self.run.rank == 0:
            print_samples(self.prompts, self.before, after, self.sampling)
        # perparam's all-gathers of one generation (of up to max_new_tokens forwards): one per group
        per_generation = self.all_gathers / (2 * len(self.prompts))
        return {"sampling": asdict(self.sampling), "sampling_s": self.seconds,
                "sampling_all_gathers_per_generation": per_generation,
                "samples": [{"prompt": p, "before": b, "after": a}
                            for p, b, a in zip(self.prompts, self.before, after, strict=True)]}
