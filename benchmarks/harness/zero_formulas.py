"""The formulas ``benchmarks/zero_stages.py`` sets its measurements against, per configuration, summed over
the benchmark GPT's parameters (fp32 weights and gradients, AdamW: P = G = 4 and O = 8 bytes per element).

Per parameter of ``n`` elements on K ranks, ``r = (K - 1) / K``:

* model state, Table 7-2 (ZeRO paper, Sec. 5): DDP ``16 n``, stage 1 ``4n + 4n + 8n/K``, stage 2
  ``4n + 12n/K``, stage 3 (and FSDP2) ``16n/K``; a stage-1/2 parameter's shard (the copy the optimizer
  updates) is a view of its kept whole copy in fp32, so it adds nothing (``docs/zero-stages.md``);
* bytes sent per step, the ZeRO paper (Sec. 7): DDP and stages 1/2 ``2 r G``, stage 3 ``r (G + 2P)``;
* bytes sent per step **as run**: stage 1 as perparam implements it (the gradient all-reduced, kept whole,
  plus the refresh all-gather: ``2 r G + r P``), and a stage-3 parameter in a call with
  ``reshard_after_forward=False`` (``[ln_f, head]`` in ``configs.wrap_units``; every call of
  ``fsdp2_keep``) gathered once per step: ``r (G + P)``.
"""

from __future__ import annotations

from fractions import Fraction

from torch import nn

P = G = 4  # fp32 bytes per element
OPT = 8  # AdamW: exp_avg and exp_avg_sq, fp32


def stages(name: str, model: nn.Module) -> dict[str, tuple[int, bool]]:
    """``{parameter name: (stage, gathered twice)}`` for configuration ``name`` (stage 0: DDP)."""
    from benchmarks.harness.configs import mix_stage, wrap_units

    kept = {id(p) for modules, raf in wrap_units(model) if not raf for m in modules for p in m.parameters()}
    out = {}
    for module_name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if name == "ddp":
                stage = 0
            elif name.startswith("perparam_stage"):
                stage = int(name[-1])
            elif name == "perparam_mix":
                stage = mix_stage(module_name, module)
            else:  # perparam, fsdp2, fsdp2_keep
                stage = 3
            twice = stage == 3 and id(p) not in kept and name != "fsdp2_keep"
            out[f"{module_name}.{pname}".lstrip(".")] = (stage, twice)
    return out


def _state(stage: int, n: int, k: int) -> Fraction:
    return {0: Fraction(16 * n), 1: 8 * n + Fraction(OPT * n, k), 2: P * n + Fraction((G + OPT) * n, k),
            3: Fraction((P + G + OPT) * n, k)}[stage]


def _sent_paper(stage: int, n: int, r: Fraction) -> Fraction:
    return r * (G + 2 * P) * n if stage == 3 else 2 * r * G * n


def _sent_as_run(stage: int, twice: bool, n: int, r: Fraction) -> Fraction:
    if stage == 1:
        return 2 * r * G * n + r * P * n
    if stage == 3:
        return r * (G + (2 if twice else 1) * P) * n
    return 2 * r * G * n  # DDP's all-reduce; stage 2: reduce-scatter + refresh all-gather (P = G)


def formulas(name: str, model: nn.Module, world: int) -> dict[str, float]:
    """``state`` (Table 7-2 bytes per rank), ``sent_paper`` and ``sent_as_run`` (bytes per rank and step) of
    configuration ``name`` on ``world`` ranks, summed over ``model``'s parameters."""
    r = Fraction(world - 1, world)
    numel = dict(model.named_parameters())
    state = sent_paper = sent_run = Fraction(0)
    for pname, (stage, twice) in stages(name, model).items():
        n = numel[pname].numel()
        state += _state(stage, n, world)
        sent_paper += _sent_paper(stage, n, r)
        sent_run += _sent_as_run(stage, twice, n, r)
    return {"state": float(state), "sent_paper": float(sent_paper), "sent_as_run": float(sent_run)}
