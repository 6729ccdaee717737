"""Traps that hold one worker of ``perparam finetune`` inside a chosen phase of a chosen step, so that a
harness can SIGKILL or SIGSTOP it there from outside (``benchmarks/harness/finetune_faults.py``).

The job's code is not changed: the harness puts a folder on the workers' ``PYTHONPATH`` whose
``sitecustomize.py`` calls :func:`install` (:func:`site_folder` writes it), and :func:`install` acts only in
the worker named by :data:`TRAP_ENV` (``"RANK,PHASE,STEP,READY_FILE"``) and in the first start of the group
(``TORCHELASTIC_RESTART_COUNT`` 0: the restarted workers run free). The trapped worker writes
``READY_FILE`` (``pid phase step time``, renamed into place) and sleeps there until it is killed.

Phases, of the 1-based step ``STEP`` (``STEP - 1`` optimizer steps done, counted by a global optimizer
step hook):

- ``forward``: before the second decoder layer's forward (the first unit of the step);
- ``backward``: in the gradient of the first decoder layer's output (its backward, after the later layers');
- ``step``: before the optimizer step;
- ``commit``: in the snapshot commit of step ``STEP``, while the first tensor is copied into the own slot
  (its header zeroed: the slot is torn), on the copier's thread (the training thread goes on into the next
  step and waits for the copy at its optimizer step); in a job without snapshots (``--max-restarts 0``:
  the disk recovery's run) where the commit would be, after the optimizer step;
- ``save``: in the write of the ``--save`` checkpoint of step ``STEP`` (``async_save``'s background thread:
  the main thread goes on with the next step and waits for this rank in its first collective).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

TRAP_ENV = "PERPARAM_BENCH_FAULT_TRAP"
PHASES = ("forward", "backward", "step", "commit", "save")


def site_folder(folder: Path) -> Path:
    """Write ``folder/sitecustomize.py`` (which calls :func:`install`) and return ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "from benchmarks.harness.fault_traps import install\n\ninstall()\n"
    )
    return folder


def stay(ready: str, phase: str, step: int) -> None:
    """Say where this process is (the ready file) and wait there to be killed."""
    part = f"{ready}.part"
    Path(part).write_text(f"{os.getpid()} {phase} {step} {time.time():.6f}\n")
    os.replace(part, ready)
    while True:
        time.sleep(3600)


def install() -> None:
    """Arm the trap of :data:`TRAP_ENV` in this process when it is the worker named there (see above)."""
    spec = os.environ.get(TRAP_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    rank, phase, step, ready = spec.split(",", 3)
    if os.environ.get("RANK") != rank:
        return
    at = int(step)
    import torch
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    done = {"steps": 0, "layers": 0}

    def count_step(opt, args, kwargs) -> None:
        done["steps"] += 1
        done["layers"] = 0

    register_optimizer_step_post_hook(count_step)

    def armed() -> bool:
        return done["steps"] == at - 1 and torch.is_grad_enabled()

    def layer(module) -> bool:  # (fully_shard gives the module a class of its own, derived from the model's)
        return any(c.__name__ == "DecoderLayer" for c in type(module).__mro__)

    if phase == "forward":

        def before_layer(module, args) -> None:
            if layer(module) and armed():
                done["layers"] += 1
                if done["layers"] == 2:
                    stay(ready, phase, at)

        register_module_forward_pre_hook(before_layer)
    elif phase == "backward":

        def after_layer(module, args, out) -> None:
            if layer(module) and armed() and out.requires_grad:
                done["layers"] += 1
                if done["layers"] == 1:
                    out.register_hook(lambda grad: stay(ready, phase, at))

        register_module_forward_hook(after_layer)
    elif phase == "step":

        def before_step(opt, args, kwargs) -> None:
            if done["steps"] == at - 1:
                stay(ready, phase, at)

        register_optimizer_step_pre_hook(before_step)
    elif phase == "commit" and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0":

        def after_step(opt, args, kwargs) -> None:
            if done["steps"] == at:
                stay(ready, phase, at)

        register_optimizer_step_post_hook(after_step)  # (after count_step)
    elif phase == "commit":
        from perparam.elastic import copier, slots

        start, payload, marked = copier.HostCopier.start, slots.SlotFile.payload, set()

        def starting(self, slot, *args):  # the commit, on the training thread: is it step STEP's own copy?
            if done["steps"] == at and "-own-" in slot.path.name:
                marked.add(slot.path.name)
            return start(self, slot, *args)

        def copying(self, nbytes, offset=0):  # the copy itself, on the copier's thread
            if self.path.name in marked:
                stay(ready, phase, at)
            return payload(self, nbytes, offset)

        copier.HostCopier.start, slots.SlotFile.payload = starting, copying
    elif phase == "save":
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data
        name = f"step-{at:06d}"

        def writing(self, plan, planner):
            if name in str(getattr(self, "path", "")):
                stay(ready, phase, at)
            return write_data(self, plan, planner)

        FileSystemWriter.write_data = writing
    else:
        raise ValueError(f"{TRAP_ENV}: phase {phase!r} is not one of {', '.join(PHASES)}")
