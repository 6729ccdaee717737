"""The benchmark's configurations: how each one builds, wraps and initialises the model.

Every configuration starts from the same weights: ``GPT(cfg)`` built on CPU under ``torch.manual_seed(seed)``
(the *seeded full init*). ``bound`` and ``ddp`` build it directly. The sharded configurations build the model
on the meta device, shard it, then materialise only this rank's shards from rank 0's seeded full init
(``perparam.full_state.load_full_state_dict``; FSDP2: ``to_empty()`` then torch's ``set_model_state_dict``
with ``full_state_dict=True, broadcast_from_rank0=True``), so no rank but 0 ever holds the whole model.

Wrapping (torchtitan's): the two embeddings in one call, each block, ``[ln_f, head]`` in one call, the root
last (it then manages no parameters). ``[ln_f, head]`` runs last in forward and first in backward, so it
keeps its parameters (``reshard_after_forward=False``), as torchtitan does.
"""

from __future__ import annotations

import torch
from torch import nn

import perparam
from benchmarks.harness.model import GPT, GPTConfig

CONFIGS = ("bound", "ddp", "fsdp2", "fsdp2_bf16", "perparam", "perparam_bf16", "perparam_int8",
           "perparam_int8_grad", "perparam_int8_both")
DESCRIPTIONS = {
    "bound": "each rank trains its own unsharded replica, no collectives (what compute alone costs)",
    "ddp": "torch DistributedDataParallel",
    "fsdp2": "torch fully_shard: embeddings, each block, [norm, head], root",
    "fsdp2_bf16": "torch fully_shard, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "perparam": "perparam.fully_shard, wrapped as fsdp2",
    "perparam_bf16": "perparam, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)",
    "perparam_int8": "perparam, int8-quantized all-gather of the Linear weights",
    "perparam_int8_grad": "perparam, int8-quantized gradient reduce-scatter of the Linear weights (ZeRO++ "
                          "qgZ)",
    "perparam_int8_both": "perparam, int8 all-gather and int8 gradient reduce-scatter of the Linear weights",
}
#: ``benchmarks/zero_stages.py``'s configurations beyond ``ddp``, ``fsdp2`` and ``perparam`` (all stage 3)
ZERO_CONFIGS = ("fsdp2_keep", "perparam_stage1", "perparam_stage2", "perparam_mix")
DESCRIPTIONS.update({
    "fsdp2_keep": "torch fully_shard, reshard_after_forward=False on every call (FSDP2's nearest to ZeRO-2)",
    "perparam_stage1": "perparam, ParamPolicy(zero_stage=1) on every parameter",
    "perparam_stage2": "perparam, ParamPolicy(zero_stage=2) on every parameter",
    "perparam_mix": "perparam, embeddings and norms stage 1, attention (qkv, proj) stage 2, MLP and head "
                    "stage 3",
})
SHARDED = ("fsdp2", "fsdp2_bf16", "perparam", "perparam_bf16", "perparam_int8", "perparam_int8_grad",
           "perparam_int8_both", *ZERO_CONFIGS)
LR = 1e-3


class Unsupported(Exception):
    """The configuration cannot be built with this version of perparam."""


def seeded_full_init(cfg: GPTConfig, seed: int) -> GPT:
    """The reference model every configuration starts from (unsharded, CPU)."""
    torch.manual_seed(seed)
    return GPT(cfg)


def wrap_units(model: GPT) -> list[tuple[list[nn.Module], bool]]:
    """``fully_shard`` calls in order, as (modules, reshard_after_forward); the root last."""
    return ([([model.tok, model.pos], True)] + [([b], True) for b in model.blocks]
            + [([model.ln_f, model.head], False), ([model], True)])


def mix_stage(module_name: str, module: nn.Module) -> int:
    """``perparam_mix``'s ZeRO stage of a module's direct parameters: embeddings and norms 1 (touched by every
    micro-batch), attention's ``qkv``/``proj`` 2, the rest (MLP, head) 3."""
    if isinstance(module, (nn.Embedding, nn.LayerNorm)):
        return 1
    return 2 if module_name.rsplit(".", 1)[-1] in ("qkv", "proj") else 3


def _perparam_kwargs(name: str, modules: list[nn.Module]) -> dict:
    if name == "perparam":
        return {}
    if name in ("perparam_stage1", "perparam_stage2"):
        return {"param_policy": perparam.ParamPolicy(zero_stage=int(name[-1]))}
    if name == "perparam_mix":
        stage = {id(p): mix_stage(n, m) for module in modules for n, m in module.named_modules()
                 for p in m.parameters(recurse=False)}
        return {"param_policy": lambda _name, p: perparam.ParamPolicy(zero_stage=stage.get(id(p), 3))}
    if name == "perparam_bf16":
        return {"mp_policy": perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                           reduce_dtype=torch.float32)}
    if name.startswith("perparam_int8"):  # every nn.Linear weight this call manages
        quant = perparam.ParamPolicy(quant=None if name == "perparam_int8_grad"
                                     else perparam.QuantPolicy(torch.int8),
                                     grad_quant=None if name == "perparam_int8" else "int8")
        linear = {id(m.weight) for module in modules for m in module.modules() if isinstance(m, nn.Linear)}
        return {"param_policy": lambda _name, p: quant if id(p) in linear else None}
    raise ValueError(name)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def build(name: str, cfg: GPTConfig, mesh, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model wrapped for ``name``, initialised from the seeded full init, and its AdamW.

    Raises ``Unsupported`` when the installed perparam cannot build ``name``; ``ValueError`` for an
    unknown name."""
    if name == "bound":
        model = seeded_full_init(cfg, seed)
    elif name == "ddp":
        model = nn.parallel.DistributedDataParallel(seeded_full_init(cfg, seed))
    elif name in SHARDED:
        with torch.device("meta"):
            model = GPT(cfg)
        if name.startswith("fsdp2"):
            _fsdp2(name, model, mesh)
        else:
            try:
                for modules, raf in wrap_units(model):
                    perparam.fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                                         reshard_after_forward=raf, **_perparam_kwargs(name, modules))
            except (NotImplementedError, TypeError, AttributeError) as e:
                raise Unsupported(f"{type(e).__name__}: {e}") from e
        full = seeded_full_init(cfg, seed).state_dict() if _rank() == 0 else None
        if name.startswith("fsdp2"):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            model.to_empty(device="cpu")
            set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True,
                                                                             broadcast_from_rank0=True))
        else:
            from perparam.full_state import load_full_state_dict

            load_full_state_dict(model, full)
        del full
    else:
        raise ValueError(f"unknown configuration {name!r}; choose from {CONFIGS + ZERO_CONFIGS}")
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _fsdp2(name: str, model: GPT, mesh) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = {}
    if name == "fsdp2_bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for modules, raf in wrap_units(model):
        raf = raf and name != "fsdp2_keep"
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, reshard_after_forward=raf,
                    **kwargs)


def full_state(name: str, model: nn.Module) -> dict[str, torch.Tensor] | None:
    """The unsharded state dict on rank 0 (``None`` elsewhere): to check every configuration starts from
    the same weights. Every rank calls it."""
    if name == "bound":
        return model.state_dict() if _rank() == 0 else None
    if name == "ddp":
        return model.module.state_dict() if _rank() == 0 else None
    if name.startswith("fsdp2"):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return sd if _rank() == 0 else None
    from perparam.full_state import full_state_dict

    return full_state_dict(model)
