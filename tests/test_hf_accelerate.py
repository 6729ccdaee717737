"""accelerate's ``Accelerator`` loop with a perparam-sharded model
(``perparam.hf_accelerate.ShardedAccelerator``): 2 gloo ranks against one process with plain ``Accelerator``
(tiny random Llama, global batch 4, gradient accumulation 2, clipping every step, AdamW), ``save_state`` at
step 3 and ``load_state`` in a new run ending where the uninterrupted run ends, ``get_state_dict`` giving full
tensors; a sharded model given to plain ``Accelerator.prepare`` (DDP) refused; torch's FSDP2 policies accepted
by ``fully_shard``. One 2-rank launch for the loop cases (importing transformers and accelerate costs seconds
per rank).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest
import torch

from tests.distributed import run_distributed
from tests.hf_helpers import ddp_refusal, launched, make_llama, sharded_llama

pytestmark = pytest.mark.skipif(not all(importlib.util.find_spec(n) for n in ("transformers", "accelerate")),
                                reason="transformers and accelerate are test dependencies: pip install -e "
                                       "'.[dev]'")

WORLD = 2
GLOBAL_BATCH = 4
ACCUMULATION = 2
STEPS = 6
SAVED_AT = 3
MAX_GRAD_NORM = 0.05


def _loop(world: int, folder: str | None, resume: bool = False):
    """The user's loop; with ``world`` the model is sharded and the accelerator is perparam's. Returns the
    per-step losses (this rank's micro-batches), the pre-clip gradient norms and the accelerator and model."""
    from accelerate import Accelerator

    from perparam.hf_accelerate import ShardedAccelerator

    model = sharded_llama() if world else make_llama()
    ids = torch.randint(0, 33, (GLOBAL_BATCH * STEPS, 7), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader([{"input_ids": x, "labels": x} for x in ids],
                                       batch_size=GLOBAL_BATCH // ACCUMULATION // max(world, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / STEPS)
    # step_scheduler_with_optimizer=False: the scheduler steps once per optimizer step whatever the world size
    # (accelerate's default steps it once per process, for schedules written for one process's step count)
    accelerator = (ShardedAccelerator if world else Accelerator)(cpu=True,
                                                                 gradient_accumulation_steps=ACCUMULATION,
                                                                 step_scheduler_with_optimizer=False)
    model, opt, data, sched = accelerator.prepare(model, opt, data, sched)
    batches, losses, norms = data, [], []
    if resume:
        accelerator.load_state(os.path.join(folder, "state"))
        batches = accelerator.skip_first_batches(data, SAVED_AT * ACCUMULATION)
    for i, batch in enumerate(batches, start=SAVED_AT * ACCUMULATION if resume else 0):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            losses.append(loss.item())
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item())
            opt.step()
            if accelerator.sync_gradients:
                sched.step()
            opt.zero_grad()
        if folder is not None and not resume and i + 1 == SAVED_AT * ACCUMULATION:
            accelerator.save_state(os.path.join(folder, "state"))
    return losses, norms, accelerator, model


def _full(accelerator, model):
    state = accelerator.get_state_dict(model)
    return None if state is None else {k: v.clone() for k, v in state.items()}


def accelerate_run(rank: int, world: int, folder: str, shard: bool = True):
    """One rank of the sharded run, or (``shard=False``, 1 rank) the one-process reference: in a process of
    its own, so no accelerate singleton state of an earlier test in this process reaches it."""
    world = world if shard else 0
    launched(rank, world)
    losses, norms, accelerator, model = _loop(world, folder if world else None)
    result = {"losses": losses, "norms": norms, "params": _full(accelerator, model)}
    if not world:
        return result
    resumed_losses, _, resumed_acc, resumed = _loop(world, folder, resume=True)
    result.update(resumed=_full(resumed_acc, resumed), resumed_losses=resumed_losses,
                  files=sorted(os.listdir(os.path.join(folder, "state"))))
    # plain Accelerator.prepare would wrap the sharded model in DDP: refused, nothing trains unsharded
    from accelerate import Accelerator

    result["plain_prepare"] = ddp_refusal(Accelerator(cpu=True).prepare)
    result.update(_two_optimizers_and_a_second_prepare(folder))
    return result


def _two_optimizers_and_a_second_prepare(folder: str) -> dict:
    """Muon-style split (two optimizers over one sharded model, the model prepared twice): ``save_state``
    keeps both optimizers' shards, once; one optimizer over two sharded models is refused at
    ``save_state``."""
    from perparam.checkpoint import CheckpointError
    from perparam.hf_accelerate import ShardedAccelerator

    accelerator = ShardedAccelerator(cpu=True)
    model = sharded_llama()
    embed = [model.model.embed_tokens.weight]
    first = torch.optim.AdamW(embed, lr=1e-2)
    second = torch.optim.AdamW([p for p in model.parameters() if p is not embed[0]], lr=1e-2)
    model, first, second = accelerator.prepare(model, first, second)
    model = accelerator.prepare(model)
    ids = torch.randint(0, 33, (2, 7), generator=torch.Generator().manual_seed(0))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    first.step()
    second.step()
    location = accelerator.save_state(os.path.join(folder, "two"))
    saved = {n: s.clone() for n, s in second.optimizer.state[next(iter(second.optimizer.state))].items()}
    for p in second.optimizer.state.values():
        p["exp_avg"].zero_()
    accelerator.load_state(location)
    after = second.optimizer.state[next(iter(second.optimizer.state))]
    out = {"two_files": sorted(f for f in os.listdir(location) if f.startswith("perparam_state")),
           "second_restored": all(torch.equal(saved[k], after[k]) for k in saved)}
    both = ShardedAccelerator(cpu=True)
    a, b = sharded_llama(), sharded_llama()
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=1e-2)
    a, b, opt = both.prepare(a, b, opt)
    try:
        both.save_state(os.path.join(folder, "both"))
        out["one_over_two"] = None
    except CheckpointError as e:
        out["one_over_two"] = str(e)
    three = ShardedAccelerator(cpu=True)  # three sharded models: perparam_state_0..2 are no series to prune
    models = [sharded_llama() for _ in range(3)]
    three.prepare(*models, *[torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models])
    location = three.save_state(os.path.join(folder, "three"))
    out["three_files"] = sorted(f for f in os.listdir(location) if f.startswith("perparam_state"))
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as folder:
        sharded = run_distributed(accelerate_run, WORLD, folder, timeout=240)
        [reference] = run_distributed(accelerate_run, 1, folder, False, timeout=240)
    return sharded, reference


def test_an_accelerator_loop_over_a_sharded_model_matches_one_process_with_accumulation_and_clipping(runs):
    (r0, r1), ref = runs
    assert len(ref["losses"]) == STEPS * ACCUMULATION and len(ref["norms"]) == STEPS
    # equal tokens: the ranks' mean is the mean
    mean = [(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])]
    assert max(abs(a - b) for a, b in zip(mean, ref["losses"])) < 1e-5
    assert min(ref["norms"]) > MAX_GRAD_NORM
    assert max(abs(a - b) for a, b in zip(r0["norms"], ref["norms"])) < 1e-5
    assert r1["params"] is None and r0["params"].keys() == ref["params"].keys()  # full tensors on rank 0
    assert all(not hasattr(v, "device_mesh") for v in r0["params"].values())
    assert max((r0["params"][k] - v).abs().max().item() for k, v in ref["params"].items()) < 1e-5


def test_save_state_and_load_state_resume_every_ranks_optimizer_shards_exactly(runs):
    (r0, r1), _ = runs
    assert "perparam_state_0" in r0["files"] and "scheduler.bin" in r0["files"]
    assert r0["resumed_losses"] == pytest.approx(r0["losses"][SAVED_AT * ACCUMULATION:], abs=1e-6)
    assert r1["resumed_losses"] == pytest.approx(r1["losses"][SAVED_AT * ACCUMULATION:], abs=1e-6)
    assert max((r0["resumed"][k] - v).abs().max().item() for k, v in r0["params"].items()) < 1e-6


def test_plain_accelerator_prepare_of_a_sharded_model_is_refused(runs):
    (r0, r1), _ = runs
    for r in (r0, r1):
        assert (r["plain_prepare"] is not None
                and "perparam.hf_accelerate.ShardedAccelerator" in r["plain_prepare"])


def _not_launched(rank: int, world: int) -> str | None:
    """A process group of ``world`` ranks that accelerate does not see (no torchrun variables)."""
    from perparam import ShardingError
    from perparam.hf_accelerate import ShardedAccelerator

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)
    try:
        ShardedAccelerator(cpu=True)
    except ShardingError as e:
        return str(e)
    return None


def test_sharded_accelerator_refuses_a_process_group_that_accelerate_does_not_see():
    """Without torchrun's variables every rank would read the same batches and save as the main process."""
    for message in run_distributed(_not_launched, 2):
        assert message and "1 process" in message and "2 ranks" in message and "torchrun" in message, message


def test_save_state_keeps_every_optimizer_of_a_sharded_model_once_and_refuses_one_optimizer_over_two(runs):
    (r0, r1), _ = runs
    for r in (r0, r1):
        assert r["two_files"] == ["perparam_state_0"], r["two_files"]  # the model prepared twice: saved once
        assert r["second_restored"]  # the second optimizer's shards come back from the perparam checkpoint
        assert r["one_over_two"] and "its own optimizer" in r["one_over_two"], r["one_over_two"]
        assert r["three_files"] == ["perparam_state_0", "perparam_state_1",
                                    "perparam_state_2"], r["three_files"]
