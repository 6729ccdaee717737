"""``perparam finetune --lora/--qlora``: the main job's tiny LLaMA with LoRA adapters sharded in the same
``fully_shard`` call as their layer's frozen base (one all-gather per layer per unshard), adapters' grads
equal to one process's, the base with no grads and no optimizer state, QLoRA's NF4 base at 0.140625x the
fp32 bytes, merged weights for export, checkpoint/resume, and one-line errors for bad flags."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.finetune_helpers import TINY, assert_one_line_error, run_finetune

GLOBAL_BATCH, SEQ, STEPS, TOL = 4, 16, 3, 1e-5


def _tiny_lora(qlora: bool, targets=None):
    """A tiny Llama (seed 0) with rank-4 adapters, ``B`` made non-zero so ``A`` gets gradients at step 0."""
    from perparam.finetune.lora import TARGETS, LoraConfig, LoRALinear, apply_lora
    from perparam.finetune.model import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.tiny())
    cfg = LoraConfig(4, 8.0, tuple(targets or TARGETS), qlora)
    apply_lora(model, cfg, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.normal_(0, 0.05, generator=gen)
    return model, cfg


def _rows() -> torch.Tensor:
    return torch.randint(0, 256, (3 * GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))


def _shard(model, world: int, cfg):
    from perparam.finetune import lora, train

    meshes = train.build_meshes(world, 1, 1, "cpu")
    dtype = torch.bfloat16 if cfg.qlora else torch.float32
    return train.shard_model(model, meshes, dtype, None, lora.layer_policy(cfg))


def _lora_parity_rank(rank: int, world: int) -> dict:
    from perparam import CommCounter
    from perparam.finetune.data import BatchStream
    from perparam.finetune.lora import merged_state_dict, trainable_parameters
    from perparam.finetune.model import Llama, next_token_loss

    model, cfg = _tiny_lora(qlora=False)
    reference = copy.deepcopy(model)
    _shard(model, world, cfg)
    stream = BatchStream(_rows(), GLOBAL_BATCH, seed=0)
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    ref_opt = torch.optim.AdamW(trainable_parameters(reference), lr=1e-2)
    ref = dict(reference.named_parameters())
    grad_diffs, comms = [], []
    for step in range(STEPS):
        inputs, targets = stream.rank_batch(step, rank, world)
        opt.zero_grad(set_to_none=True)
        with CommCounter() as comm:
            next_token_loss(model(inputs), targets).backward()
        comms.append(comm.by_kind())
        ref_opt.zero_grad(set_to_none=True)
        for x, y in zip(*(t.chunk(world) for t in stream.global_batch(step)), strict=True):
            (next_token_loss(reference(x), y) / world).backward()
        grad_diffs.append(max((p.grad.full_tensor() - ref[n].grad).abs().max().item()
                              for n, p in model.named_parameters() if p.requires_grad))
        opt.step()
        ref_opt.step()
    per_layer = []
    for layer in model.layers:  # one all-gather per layer per unshard: base and adapters in one buffer
        with CommCounter() as comm:
            layer.unshard()
            layer.reshard()
        per_layer.append(comm.by_kind())
    named = dict(model.named_parameters())
    state_names = sorted(n for n, p in named.items() if p in opt.state)
    merged = merged_state_dict(model)
    out = {"grad_diffs": grad_diffs, "comms": comms, "per_layer": per_layer, "state_names": state_names,
           "with_grad": sorted(n for n, p in named.items() if p.grad is not None),
           "trainable": sorted(n for n, p in named.items() if p.requires_grad)}
    if rank == 0:  # merged weights: the plain model's names, W + (alpha / r) B @ A, the same logits
        plain = Llama(reference.cfg)
        out["names"] = sorted(merged) == sorted(plain.state_dict())
        want = {}
        for name, m in reference.named_modules():
            if hasattr(m, "lora_a"):
                want[f"{name}.weight"] = m.weight + m.scaling * m.lora_b @ m.lora_a
        out["merge_diff"] = max((merged[k] - w).abs().max().item() for k, w in want.items())
        plain.load_state_dict(merged)
        x = _rows()[:2, :-1]
        with torch.no_grad():
            out["logit_diff"] = (plain(x) - reference(x)).abs().max().item()
    else:
        out["merged_none"] = merged is None
    model(_rows()[:1, :-1])  # every rank runs the same forwards (rank 0's check above is local)
    return out


def test_lora_adapters_match_one_process_with_one_all_gather_per_layer():
    results = run_distributed(_lora_parity_rank, 2, timeout=120)
    for r in results:
        assert max(r["grad_diffs"]) <= TOL, r["grad_diffs"]
        # forward: root + 2 layers; backward: the 2 layers again (the root keeps its gather); one
        # reduce-scatter per layer (its adapters), none for the root (embedding and final norm are frozen)
        assert r["comms"] == [{"all_gather": 5, "reduce_scatter": 2}] * STEPS, r["comms"]
        assert r["per_layer"] == [{"all_gather": 1}] * 2
        adapters = r["trainable"]
        assert len(adapters) == 2 * 7 * 2 and all(n.endswith(("lora_a", "lora_b")) for n in adapters)
        assert r["with_grad"] == adapters and r["state_names"] == adapters  # the base: no grads, no state
    assert results[0]["names"] and results[1]["merged_none"]
    assert results[0]["merge_diff"] <= 1e-6 and results[0]["logit_diff"] <= TOL, results[0]


def _qlora_rank(rank: int, world: int) -> dict:
    from perparam import CommCounter, quant
    from perparam.finetune.lora import NF4_BLOCK, merged_state_dict, trainable_parameters
    from perparam.finetune.lora_memory import measured_bytes, planned_bytes
    from perparam.finetune.model import next_token_loss

    model, cfg = _tiny_lora(qlora=True, targets=("q_proj", "v_proj"))
    reference = copy.deepcopy(model)
    bases = {n: p for n, p in model.named_parameters() if n.endswith("_proj.weight")}
    fp32_bytes = sum(p.numel() * 4 for p in bases.values())
    _shard(model, world, cfg)
    named = dict(model.named_parameters())
    base_bytes = sum(named[n].to_local().nbytes + model.get_buffer(f"{n}_qscale").to_local().nbytes
                     for n in bases)
    codes = {n: named[n].to_local().clone() for n in bases}
    opt = torch.optim.AdamW(trainable_parameters(model), lr=1e-2)
    inputs, targets = (t.chunk(world)[rank]
                       for t in (_rows()[:GLOBAL_BATCH, :-1], _rows()[:GLOBAL_BATCH, 1:]))
    losses, comms = [], []
    for _ in range(8):  # one batch again and again: the loss must fall
        opt.zero_grad(set_to_none=True)
        with CommCounter() as comm:
            loss = next_token_loss(model(inputs), targets)
            loss.backward()
        comms.append(comm.by_kind())
        opt.step()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    per_layer = []
    for layer in model.layers:
        with CommCounter() as comm:
            layer.unshard()
            layer.reshard()
        per_layer.append(comm.by_kind())
    planned = planned_bytes(model.cfg, world, cfg)["qlora"]
    measured = measured_bytes(model, opt)
    merged = merged_state_dict(model)
    out = {"losses": losses, "comms": comms, "per_layer": per_layer, "base_bytes": base_bytes,
           "fp32_bytes": fp32_bytes, "planned": planned, "measured": measured,
           "unchanged": all(torch.equal(named[n].to_local(), c) for n, c in codes.items()),
           "with_grad": sorted(n for n, p in named.items() if p.grad is not None),
           "dtypes": sorted({str(p.dtype) for n, p in named.items() if p.requires_grad})}
    full = {n: p.full_tensor() for n, p in model.named_parameters() if p.requires_grad}  # collective
    if rank == 0:  # merged: dequantized NF4 base (per row, blocks of 64) + (alpha / r) B @ A
        diffs = []
        for name, m in reference.named_modules():
            if not name.endswith("_proj"):
                continue
            w = quant.get("nf4").unpack(quant.get("nf4").pack(m.weight.detach(), NF4_BLOCK), NF4_BLOCK,
                                        torch.empty_like(m.weight))
            if hasattr(m, "lora_a"):
                w = w + m.scaling * full[f"{name}.lora_b"] @ full[f"{name}.lora_a"]
            diffs.append((merged[f"{name}.weight"] - w).abs().max().item())
        out["merge_diff"] = max(diffs)
        out["merged_keys"] = sorted(merged)
    return out


def test_qlora_nf4_base_at_0_140625x_fp32_bytes_and_the_loss_falls():
    world = 2
    results = run_distributed(_qlora_rank, world, timeout=120)
    for r in results:
        assert r["base_bytes"] == 0.140625 * r["fp32_bytes"] / world  # <= 0.15x: 4-bit codes + fp32 absmax/64
        assert r["losses"][-1] < r["losses"][0] - 0.05, r["losses"]  # measured: 5.54 -> 5.36
        assert r["unchanged"]  # the NF4 codes never change
        assert r["with_grad"] == [f"layers.{i}.attn.{p}_proj.lora_{ab}" for i in range(2) for p in "qv"
                                  for ab in "ab"]
        assert r["dtypes"] == ["torch.float32"]  # the adapters' master weights
        assert r["comms"] == [{"all_gather": 5, "reduce_scatter": 2}] * 8
        assert r["per_layer"] == [{"all_gather": 1}] * 2
        # planned (perparam.memory.plan) = measured, but for the reduce-scatter's used flags (one fp32
        # per trainable tensor, 4 per layer) and AdamW's step counters (one fp32 per trainable tensor)
        assert r["measured"]["params"] == r["planned"]["params"]
        assert r["measured"]["grads"] == r["planned"]["grads"] + 4 * 4 * 2
        assert r["measured"]["optimizer"] == r["planned"]["optimizer"] + 4 * 4 * 2
    assert results[0]["merge_diff"] <= 1e-6
    assert not [k for k in results[0]["merged_keys"] if "lora" in k or "qscale" in k]


def _resume_rank(rank: int, world: int, folder: str) -> dict:
    """QLoRA: 3 steps straight, against 2 steps, a checkpoint, a fresh model (other adapters), 1 step."""
    from perparam.finetune.checkpointing import finish_saves, resume_from, save_if_due
    from perparam.finetune.config import JobConfig
    from perparam.finetune.data import BatchStream
    from perparam.finetune.lora import trainable_parameters
    from perparam.finetune.model import next_token_loss

    job = JobConfig(steps=3, seq_len=SEQ, batch_size=GLOBAL_BATCH, lr=1e-2, seed=0, config="tiny",
                    save=folder, save_every=2, lora=4, lora_alpha=8.0, qlora=True)
    stream = BatchStream(_rows(), GLOBAL_BATCH, seed=0)

    def run(first: int, last: int, model=None, resume: str | None = None):
        if model is None:
            model, cfg = _tiny_lora(qlora=True)
            _shard(model, world, cfg)
        opt = torch.optim.AdamW(trainable_parameters(model), lr=job.lr)
        if resume:
            first = resume_from(JobConfig(**{**vars(job), "resume": resume}), model, opt, rank)
        losses = []
        for step in range(first, last):
            x, y = stream.rank_batch(step, rank, world)
            opt.zero_grad(set_to_none=True)
            loss = next_token_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            save_if_due(job, model, opt, step + 1, rank)
        finish_saves(job, rank)  # written in the background
        return model, opt, losses, first

    straight, _, straight_losses, _ = run(0, 3)
    run(0, 2)  # saves step-000002 (and step-000003 is not reached)
    other, _ = _tiny_lora(qlora=True)
    with torch.no_grad():
        for p in other.parameters():
            if p.requires_grad:
                p.add_(1.0)  # the checkpoint must overwrite these
    _shard(other, world, job.lora_config())
    resumed, opt, losses, first = run(0, 3, model=other, resume=folder)
    manifest = json.loads((Path(folder) / "step-000003" / "perparam_checkpoint.json").read_text())
    return {"first": first, "losses": losses, "straight": straight_losses[2:],
            "same": all(torch.equal(a.to_local(), b.to_local()) for a, b in
                        zip(resumed.parameters(), straight.parameters(), strict=True)),
            "state": len(opt.state), "extra_lora": manifest["extra"]["lora"]}


def test_qlora_checkpoint_resume_continues_exactly(tmp_path):
    for r in run_distributed(_resume_rank, 2, str(tmp_path / "ckpt"), timeout=120):
        assert r["first"] == 2 and r["losses"] == r["straight"] and r["same"], r
        assert r["state"] == 2 * 7 * 2  # AdamW state of the adapters only
        assert r["extra_lora"] == {"rank": 4, "alpha": 8.0,
                                   "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                               "up_proj", "down_proj"], "qlora": True}


@pytest.mark.slow
def test_lora_flags_end_to_end_and_a_resume_with_other_lora_flags_is_refused(tmp_path, text_dir, capsys,
                                                                           monkeypatch):
    out, ckpt = tmp_path / "s.json", tmp_path / "ckpt"
    gguf_out = tmp_path / "merged.gguf"
    proc = run_finetune(*TINY, "--text", str(text_dir), "--lora", "4", "--lora-targets", "q_proj,down_proj",
                        "--summary-json", str(out), "--save", str(ckpt), "--export", str(gguf_out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(out.read_text())
    # the export holds the merged weights: the file, loaded as a plain model, gives the trained loss
    reload_json = tmp_path / "reload.json"
    plain = [a for a in TINY if a not in ("--config", "tiny")]
    again = run_finetune(*plain, "--text", str(text_dir), "--gguf", str(gguf_out), "--steps", "0",
                         "--summary-json", str(reload_json))
    assert again.returncode == 0, again.stdout + again.stderr
    reloaded = json.loads(reload_json.read_text())
    assert abs(reloaded["heldout_loss_before"] - summary["heldout_loss_after"]) < 1e-5
    assert summary["heldout_loss_after"] != summary["heldout_loss_before"]
    assert summary["lora"] == {"rank": 4, "alpha": 8.0, "targets": ["q_proj", "down_proj"], "qlora": False}
    assert summary["param_dtype"] == "fp32" and "LoRA: rank 4, alpha 8 (scale 2)" in proc.stdout
    by_mode = summary["model_state_bytes_by_mode"]
    assert (by_mode["mode"] == "lora"
            and by_mode["measured"]["params"] == by_mode["planned_rank0"]["lora"]["params"])
    planned = by_mode["planned_rank0"]
    assert planned["lora"]["trainable"] == 2 * 4 * (64 + 64 + 128 + 64)  # 2 layers x rank 4 x (in + out)
    adapters = 4 * planned["lora"]["trainable"] // 2  # fp32 bytes of rank 0's half of the adapters
    assert planned["lora"]["params"] == planned["full"]["params"] + adapters
    assert (planned["lora"]["grads"], planned["lora"]["optimizer"]) == (adapters, 2 * adapters)
    assert planned["full"]["grads"] == planned["full"]["params"]
    projections = 4 * 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64) // 2  # rank 0's fp32 bytes of them
    # QLoRA: the projections at 0.140625x (NF4 codes + scales), the embedding and norms fp32, the adapters
    assert (planned["qlora"]["params"] == planned["full"]["params"] - projections + 0.140625 * projections
            + adapters)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert_one_line_error(capsys, [*TINY, "--text", str(text_dir), "--resume", str(ckpt), "--steps", "6"],
                          "trained with --lora 4 --lora-alpha 8 --lora-targets q_proj,down_proj, this run "
                          "has no --lora")


@pytest.mark.parametrize("flags, expect", [
    (["--qlora"], "--qlora needs --lora RANK"),
    (["--lora-targets", "q_proj"], "--lora-targets needs --lora RANK"),
    (["--lora", "0"], "--lora 0 must be a positive rank"),
    (["--lora", "4", "--lora-alpha", "-1"], "--lora-alpha -1.0 must be a positive"),
    (["--lora", "4", "--lora-targets", "q_proj,wq"], "unknown ['wq']; pass a comma list of q_proj, k_proj"),
    (["--lora", "4", "--qlora", "--quant", "int8"], "--qlora with --quant int8"),
    (["--lora", "4", "--nproc", "2", "--tp", "2"], "--lora with --tp 2"),
])
def test_bad_lora_flags_give_one_line_errors(flags, expect, capsys, text_dir, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert_one_line_error(capsys, ["--config", "tiny", "--text", str(text_dir), *flags], expect)
