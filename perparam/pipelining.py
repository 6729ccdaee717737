"""Pipeline parallelism over perparam-sharded stages: ``PipelineStage``, torch's stage with FSDP2's hand-over.

torch's ``torch.distributed.pipelining`` schedules (``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ...) run each micro-batch's backward through the stage
(``backward_maybe_with_nosync``) and, after the last one, a REDUCE_GRAD action (``perform_reduce_grad``).
torch's stage gives data parallelism its hand-over only when the stage module ``isinstance`` of
``FSDPModule`` (or DDP): before every backward ``set_is_last_backward(False)``,
``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``; at REDUCE_GRAD the three set
to ``True``, FSDP2's private post-backward and final callback, then ``scale_grads``. perparam's modules are
not ``FSDPModule``s (FSDP2's private state, which that path reads, does not exist in them), so torch's
stage would treat them as plain modules: correct, but with a reduce-scatter and an all-gather per
micro-batch. This subclass gives them the same hand-over through perparam's methods of the same names and
meaning: micro-batches accumulate unsharded gradients with no communication and keep the parameters
gathered; REDUCE_GRAD issues one reduction per group and reshards.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from .module import ShardedModule
from .runtime.accumulation import reduce_accumulated
from .runtime.group import group_of


def _sharded_modules(submod: nn.Module) -> list[ShardedModule]:
    return [m for m in submod.modules() if isinstance(m, ShardedModule)]


def _groups(submod: nn.Module) -> list:
    groups: dict[int, object] = {}
    for m in _sharded_modules(submod):
        g = group_of(m)
        groups.setdefault(id(g), g)
    return list(groups.values())


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` (same arguments) for a stage module sharded by perparam: the module itself
    or any submodules passed to ``fully_shard``, typically over the dp axis of a (pp, dp) mesh, with the
    stage's ``group`` the pp axis's process group.

    Per schedule step, each group of the stage all-gathers in the first forward that needs it (again
    after an optimizer step), keeps its parameters gathered through every micro-batch's forward and
    backward, accumulates the micro-batches' gradients locally (``set_requires_gradient_sync(False)``) and
    issues its reduction (one reduce-scatter per reduce dtype; HSDP: plus one all-reduce) once, at the
    schedule's REDUCE_GRAD, then reshards. ``scale_grads`` (the schedule's argument, dividing by the number
    of micro-batches) then applies to the sharded ``.grad``s; perparam divides by the dp mesh's size (the
    gradient divide factor): a loss that is a mean per micro-batch gives the mean over the global batch.

    Raises ``NotImplementedError`` for split backwards (zero-bubble schedules' ``I``/``W`` actions), which
    perparam's hooks do not follow: use ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or
    ``ScheduleLoopedBFS``.
    """

    def forward_one_chunk(self, *args, **kwargs):
        # from the first forward of a step on, not only from the first backward (where torch's stage hands
        # FSDP2 the knobs): perparam drops parameters kept past a forward when the next forward starts
        # unless the group keeps them after backward; FSDP2 never does, so this keeps the same
        # all-gathers (a group with reshard_after_forward=False: one per step)
        for m in _sharded_modules(self.submod):
            m.set_reshard_after_backward(False, recurse=False)
        return super().forward_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        modules = _sharded_modules(self.submod)
        if not modules:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        if backward_type != "full":
            raise NotImplementedError(
                f"perparam.pipelining.PipelineStage (stage {self.stage_index}): a split backward "
                f"('{backward_type}', zero-bubble schedules) is not supported on perparam-sharded stages; "
                "use ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B or ScheduleLoopedBFS")
        # FSDP2's hand-over, as torch's stage gives an FSDPModule (recurse=False: each once)
        for m in modules:
            m.set_is_last_backward(False)
            m.set_reshard_after_backward(False, recurse=False)
            m.set_requires_gradient_sync(False, recurse=False)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:
        modules = _sharded_modules(self.submod)
        for m in modules:
            m.set_is_last_backward(True)
            m.set_reshard_after_backward(True, recurse=False)
            m.set_requires_gradient_sync(True, recurse=False)
        if modules:
            reduce_accumulated(_groups(self.submod))
        super().perform_reduce_grad(grad_scale_factor)  # scale_grads on the (sharded) .grads

    def _post_metadata_inference_cleanup(self) -> None:
        """After the forward and backward torch runs to infer shapes: finish and drop what they left (the
        gathered parameters, gradients accumulated or reduced), as torch does for FSDP2 modules."""
        super()._post_metadata_inference_cleanup()
        for m in _sharded_modules(self.submod):
            m.reset()
            for p in m.parameters():
                p.grad = None
