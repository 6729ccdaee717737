"""A training loop under ``torchrun --max-restarts N`` with ``perparam.elastic.State``, for the fault tests
(``tests/test_elastic_faults.py``) and the kill-to-first-step figures of ``docs/fault-tolerance.md``.

``python -m torch.distributed.run ... tests/elastic_worker.py OUT STEPS [VICTIM PHASE KILL_STEP]``: trains
``TinyNet`` (or ``--gpt`` a small GPT) for STEPS steps, committing after each. In the first incarnation, rank
VICTIM stops at PHASE (``forward``, ``backward``, ``step``: before the optimizer step, ``commit``: inside a
snapshot commit, after its payload and before its header) of step KILL_STEP, writes ``OUT/ready`` (its pid)
and waits there for the test to SIGKILL it. Rank 0 appends events to ``OUT/events.jsonl`` (``start``,
``restored``, ``step``; wall-clock times) and writes ``OUT/final.json``: the sha256 of every parameter and
every optimizer-state tensor (full tensors), the losses of all steps (kept in the committed state), and the
restarts.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import perparam
from perparam.elastic import State, init_process_group, slots
from tests.models import TinyNet, local_slice, make_batches

BATCH = 12


def _sha(t: torch.Tensor) -> str:
    full = (t.full_tensor() if isinstance(t, DTensor) else t).detach().contiguous().cpu()
    return hashlib.sha256(full.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _event(out: str, **what) -> None:
    if dist.get_rank() == 0:
        with open(os.path.join(out, "events.jsonl"), "a") as f:
            f.write(json.dumps({"t": time.time(), **what}) + "\n")


def _wait_to_be_killed(out: str) -> None:
    with open(os.path.join(out, "ready.part"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(out, "ready.part"), os.path.join(out, "ready"))
    while True:
        time.sleep(1)


def main(out: str, steps: int, victim: int = -1, phase: str = "", kill_step: int = -1) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(60, exit=True)
    t0 = time.time()
    init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    _event(out, event="start", restart=restart, t_process=t0)
    torch.manual_seed(0)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh)
    perparam.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    state = State(model, opt, sched, losses=[])
    t_restore = time.time()
    start = state.restore()
    _event(out, event="restored", restart=restart, step=start, restore_s=time.time() - t_restore)
    armed = {"step": -1}
    here = rank == victim and restart == 0

    def stop_at(name):
        if here and phase == name and armed["step"] == kill_step:
            _wait_to_be_killed(out)

    model.blocks[1].register_forward_pre_hook(lambda m, a: stop_at("forward"))
    def backward_trap(module, args, output) -> None:  # during backward: after the head's, before block 0's
        if output.requires_grad:
            output.register_hook(lambda grad: stop_at("backward"))

    model.blocks[0].register_forward_hook(backward_trap)
    opt.register_step_pre_hook(lambda o, a, k: stop_at("step"))
    finish = slots.SlotFile.finish

    # runs in State's background thread: the step is the header's, not armed's
    def finish_or_stop(self, header):
        if "-own-" in self.path.name and here and phase == "commit" and header.generation == kill_step + 1:
            _wait_to_be_killed(out)
        finish(self, header)

    slots.SlotFile.finish = finish_or_stop
    batches = make_batches(steps, BATCH)
    for i in range(start, steps):
        armed["step"] = i
        x, y = local_slice(batches[i][0], rank, world), local_slice(batches[i][1], rank, world)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        state.losses = [*state.losses, (mean / world).item()]
        state.commit()
        _event(out, event="step", restart=restart, step=i + 1)
    names = {id(p): n for n, p in model.named_parameters()}
    shas = {f"model.{k}": _sha(v) for k, v in model.state_dict().items()}
    for p, st in opt.state.items():
        shas.update({f"optim.{names[id(p)]}.{k}": _sha(v)
                     for k, v in st.items() if isinstance(v, torch.Tensor)})
    if rank == 0:
        with open(os.path.join(out, "final.json"), "w") as f:
            json.dump({"sha256": shas, "losses": state.losses, "restarts": restart}, f)
    state.close()
    del model, opt, state
    dist.destroy_process_group()


if __name__ == "__main__":
    args = sys.argv[1:]
    main(args[0], int(args[1]), *(int(args[2]), args[3], int(args[4])) if len(args) > 2 else ())
