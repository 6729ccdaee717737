"""GPU check section: accelerate's routes with a perparam-sharded model on one CUDA GPU (a 1-rank NCCL group).

``run(out)`` fills ``out`` with:

* ``policies``: torch's FSDP2 ``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` as
  ``fully_shard`` converts them (what accelerate's FSDP2 plugin passes);
* ``loop``: ``perparam.hf_accelerate.ShardedAccelerator`` over a sharded tiny Llama against plain
  ``Accelerator`` over the unsharded one (gradient accumulation 2, clipping, AdamW): the largest loss and
  parameter differences;
* ``fsdp2_plugin``: accelerate's FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``, reachable
  only on GPU backends) given torch's FSDP2 (the baseline: its losses against the plain run) and given a
  model perparam sharded first, without and with ``perparam.hf_accelerate.as_fsdp2_module`` (without it
  perparam modules are not ``FSDPModule``s, so accelerate shards again and torch's ``fully_shard`` refuses;
  with it accelerate takes the model as sharded): the differences against the plain run, or the error.

The functions take the device, so ``tests/test_gpu_accelerate.py`` runs ``policies`` and ``loop`` on CPU.
"""

from __future__ import annotations

import os
import traceback

import torch
import torch.distributed as dist

STEPS = 4
ACCUMULATION = 2
MAX_GRAD_NORM = 0.05


def make_llama(device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=33, hidden_size=16, intermediate_size=25, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=False, attn_implementation="eager")
    return LlamaForCausalLM(cfg).to(device)


def policies() -> dict:
    """What ``fully_shard`` makes of torch's FSDP2 policies (``perparam.sharding.policy``), as strings."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    from perparam.sharding.policy import as_mp_policy, as_offload

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                              cast_forward_inputs=False)
    return {"mp": repr(as_mp_policy(mp, "mp_policy")),
            "offload": repr(as_offload(OffloadPolicy(), "offload")),
            "cpu_offload": repr(as_offload(CPUOffloadPolicy(pin_memory=False), "offload"))}


def _train(accelerator, model, device: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    ids = torch.randint(0, 33, (2 * ACCUMULATION * STEPS, 7), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids], batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, data = accelerator.prepare(model, opt, data)
    losses = []
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
            opt.step()
            opt.zero_grad()
    state = accelerator.get_state_dict(model)
    return losses, {k: v.detach().float().cpu() for k, v in state.items()}


def _diff(a: tuple, b: tuple) -> dict:
    return {"loss_max_diff": max(abs(x - y) for x, y in zip(a[0], b[0])),
            "param_max_diff": max((a[1][k] - v).abs().max().item() for k, v in b[1].items())}


def loop(device: str) -> dict:
    """``ShardedAccelerator`` over the sharded model against plain ``Accelerator`` over the unsharded one, in
    this process (the default process group's ranks: 1 here)."""
    from accelerate import Accelerator

    from perparam import fully_shard
    from perparam.hf_accelerate import ShardedAccelerator

    cpu = device == "cpu"
    plain = _train(Accelerator(cpu=cpu, gradient_accumulation_steps=ACCUMULATION), make_llama(device), device)
    model = make_llama(device)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sharded = _train(ShardedAccelerator(cpu=cpu, gradient_accumulation_steps=ACCUMULATION), model, device)
    return {"reference_losses": plain[0], **_diff(sharded, plain)}


def fsdp2_plugin(device: str) -> dict:
    """accelerate's FSDP2 plugin: with torch's FSDP2 (against a plain run), and given a perparam model."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from perparam import fully_shard
    from perparam.hf_accelerate import as_fsdp2_module

    out: dict = {}
    plain = _train(Accelerator(gradient_accumulation_steps=ACCUMULATION), make_llama(device), device)

    def plugin_accelerator():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["LlamaDecoderLayer"])
        return Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=ACCUMULATION)

    try:
        out["torch_fsdp2"] = _diff(_train(plugin_accelerator(), make_llama(device), device), plain)
    except Exception:  # recorded: the section reports what happens
        out["torch_fsdp2"] = {"error": traceback.format_exc(limit=3)}
    for name, opt_in in (("perparam_presharded", False), ("perparam_as_fsdp2_module", True)):
        model = make_llama(device)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        if opt_in:
            as_fsdp2_module(model)
        try:
            out[name] = _diff(_train(plugin_accelerator(), model, device), plain)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
    return out


def run(out: dict, args=None) -> None:
    """The section (``check.py`` runs it as ``accelerate``): on ``args.device`` (default ``"cuda"``, one
    GPU); starts (and ends) a 1-rank process group (NCCL on CUDA, gloo on CPU) unless one exists. On CPU the
    FSDP2 plugin is not active (accelerate keeps it for GPU backends only): ``fsdp2_plugin`` is skipped."""
    device = getattr(args, "device", None) or "cuda"
    own = not dist.is_initialized()
    if own:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from benchmarks.gpu.sections import free_port

        os.environ["MASTER_PORT"] = free_port()  # (a fixed one collided with another run on the machine)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
        if device == "cuda":
            torch.cuda.set_device(0)
    try:
        out["policies"] = policies()
        sections = [("loop", loop)] + ([("fsdp2_plugin", fsdp2_plugin)] if device == "cuda" else [])
        for name, fn in sections:
            try:
                out[name] = fn(device)
            except Exception:
                out[name] = {"error": traceback.format_exc(limit=4)}
        if device != "cuda":
            out["fsdp2_plugin"] = {"skipped": "accelerate's FSDP2 plugin is active on GPU backends only"}
        errors = [name for name in ("loop", "fsdp2_plugin") if "error" in out[name]]
        if errors:
            raise RuntimeError(f"gpu_accelerate: {errors} failed (their tracebacks are in the section's "
                               "output)")
    finally:
        if own:
            import gc

            gc.collect()
            dist.destroy_process_group()
