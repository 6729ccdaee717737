"""K-invariant training: parameters bitwise the same on 1, 2 or 4 data-parallel ranks for one global batch.

The global batch is cut into ``U`` units (a power of two); rank ``r`` of ``K`` runs units
``r*U/K .. (r+1)*U/K - 1``, one forward and backward each, with gradient sync off. After each unit's
backward its gradient (reduce dtype) is taken out of the unsharded accumulators into a binary-counter
stack (``perparam.sharding.tree_sum``); an odd unit's accumulator is its left sibling, so the backward adds
the unit's gradient into it, the tree's own addition: at most ``log2(U/K)`` unsharded gradient buffers at
once, accumulator included, for ``U/K >= 2``. ``reduce()`` puts each parameter's subtree sum back and
reduces through the invariant tree reduce-scatter (``runtime/paths/reduce_invariant.py``: an all-to-all of
row pieces, the K pieces added in tree order; at K = 2 the zero-copy reduce-scatter, whose one addition is
the tree's), divided by ``U`` once (the gradient divide factor). Replicated and stage-1 parameters' whole
gradients take the same tree through a reduce-scatter then an all-gather (``INVARIANT_WHOLE``); on an HSDP
mesh the replicas' sums are added in tree order too (``collectives.tree_all_reduce_sum``). The same thread
count must be used at every K.
"""

from __future__ import annotations

import contextlib

import torch

from . import invariant_guard
from .clip import check_max_norm
from .comm import collectives
from .comm.peers import lost_peers
from .runtime.accumulation import reduce_accumulated
from .sharding.errors import ShardingError
from .sharding.tree_sum import TreeStack, is_power_of_two, tree_sum

__all__ = ["InvariantError", "InvariantUnits"]

_CLIP_CHUNK = 1 << 15  # elements of one float64 block of rows in clip_grad_norm_ (256 KiB)


class InvariantError(ShardingError, ValueError):
    """A K-invariant run refused: a setting whose reduction order depends on K."""


class InvariantUnits:
    """See the module docstring. ``model``: a ``fully_shard``-ed module (every group on one mesh, 1-D or
    HSDP); ``units``: U, a power of two divisible by the mesh size K; ``seed``: keys each unit's RNG.

    On an HSDP mesh (replicate R x shard S) K = R * S and the rank's index is ``replicate * S + shard``.

    Raises ``InvariantError`` for U not a power of two, K not dividing U, a trainable parameter no
    ``fully_shard`` call manages, tensor parallelism, ``grad_quant``
    (qgZ), a quantized all-gather of a parameter not stored quantized, a custom reduce-scatter, groups on
    different meshes."""

    def __init__(self, model, units: int, seed: int = 0) -> None:
        if isinstance(units, bool) or not is_power_of_two(units):
            raise InvariantError(f"InvariantUnits: units={units!r} must be a power of two (an int: 1, 2, 4, "
                                 "...)")
        groups = [g for g in _groups(model) if g.params]  # a root wrapping only children holds none
        if not groups:
            raise InvariantError("InvariantUnits: the model has no fully_shard-ed group")
        self.part = part = groups[0].parts[0]
        # the mesh's device: the float64 sums of clip and mean travel on its process groups (NCCL carries no
        # CPU tensor); a CUDA unit's dropout draws from the CUDA generator, forked and restored with the CPU's
        cuda = part.mesh.device_type == "cuda"
        self._device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._rng_devices = [self._device.index] if cuda else []
        # HSDP: the (replicate, shard) coordinates in row-major order, so each replica's ranks hold one
        # contiguous range of units (a node of the tree): the replicas' sums are the tree's top levels
        self.world = part.num_replicas * part.num_shards
        self.rank = (part.mesh.get_local_rank(0) if part.mesh.ndim == 2 else 0) * part.num_shards \
            + part.mesh.get_local_rank(part.mesh.ndim - 1)
        if units % self.world:
            raise InvariantError(f"InvariantUnits: the data-parallel world size {self.world} does not divide "
                                 f"units={units}; pick units a multiple of it")
        managed = {id(p.sharded) for g in groups for p in g.params}
        for name, p in model.named_parameters():
            if p.requires_grad and id(p) not in managed:
                raise InvariantError(f"InvariantUnits: trainable parameter '{name}' is not managed by any "
                                     "fully_shard call, so its gradient would stay this rank's units' alone "
                                     "(never reduced); call fully_shard on the model (the root) too, or "
                                     "freeze it")
        for g in groups:
            _check(g, part.mesh)
        # what close() gives back: each group's setting before the mode
        self._before = [(g, g.invariant, g.gradient_divide_factor, g.requires_gradient_sync) for g in groups]
        for g in groups:  # every group checked before any is changed
            g.invariant = True
            g.gradient_divide_factor = units
        self.groups, self.units, self.seed = groups, units, seed
        per = units // self.world
        self.indices = range(self.rank * per, (self.rank + 1) * per)
        self._params = [p for g in groups for p in g.params]
        self._stacks: dict[int, TreeStack] = {}
        self._count = 0  # units run this step
        self._slots = None  # clip_grad_norm_'s layout of the norm's vector (_clip_slots)
        self._clip_slots()
        # the refusals while the mode is on (perparam.invariant_guard)
        self._in_unit, self._reduced, self._refused = False, False, None
        self._sharded_ids = {id(p.sharded) for p in self._params}
        invariant_guard.install(self, InvariantError)

    def split(self, batch):
        """``batch``: a tensor, or tuple/list/dict of tensors, dim 0 the global batch ``B`` (``B % U == 0``,
        the same ``B`` for every tensor). Returns ``[(unit index, slice)]`` for this rank's units in order.

        Raises ``InvariantError`` for ``B`` not divisible by U, tensors of different ``B``, a non-tensor
        entry."""
        entries = batch.items() if isinstance(batch, dict) else (
            enumerate(batch) if isinstance(batch, (tuple, list)) else [("batch", batch)])
        sizes = {}
        for key, x in entries:
            if not isinstance(x, torch.Tensor) or not x.dim():
                raise InvariantError(f"InvariantUnits.split: entry {key!r} is {type(x).__name__}, not a "
                                     "tensor with a batch dim 0; pass only the tensors to split (keep the "
                                     "rest out of the batch)")
            sizes[key] = x.shape[0]
        if len(set(sizes.values())) > 1:
            raise InvariantError("InvariantUnits.split: the tensors' dim 0 (the global batch) differ: "
                                 f"{sizes}; every entry must hold the same global batch")
        if sizes and (b := next(iter(sizes.values()))) % self.units:
            raise InvariantError(f"InvariantUnits.split: global batch {b} not divisible by "
                                 f"units={self.units}")

        def cut(x, u):
            n = x.shape[0] // self.units
            return x[u * n:(u + 1) * n]

        def one(u):
            if isinstance(batch, dict):
                return {k: cut(v, u) for k, v in batch.items()}
            if isinstance(batch, (tuple, list)):
                return type(batch)(cut(v, u) for v in batch)
            return cut(batch, u)
        return [(u, one(u)) for u in self.indices]

    @contextlib.contextmanager
    def unit(self, index: int, step: int):
        """Around one unit's forward and backward: sync off, RNG seeded by ``(seed, step, index)``; on exit
        the unit's gradients join the tree. This rank's units run once each, in the order ``split`` gives (the
        tree adds them in that order); anything else raises ``InvariantError``. An exception inside the unit
        gives up this rank's step (the tree and the gradients accumulated so far dropped): run the step again
        from its first unit."""
        expected = self.indices[self._done()] if self._done() < len(self.indices) else None
        if index != expected:
            raise InvariantError(
                f"InvariantUnits.unit: unit {index!r} given, this rank runs units {list(self.indices)} once "
                "each in order and expects "
                f"{'reduce() now' if expected is None else f'unit {expected} next'}; call iu.unit(u, step) "
                "with the u of `for u, part in iu.split(batch)` (unit first, then the step)")
        for g in self.groups:
            g.requires_gradient_sync = False
        seeded = self._seed_accumulators()
        self._in_unit, self._reduced = True, False
        try:
            with torch.random.fork_rng(devices=self._rng_devices):
                torch.manual_seed((self.seed * 1_000_003 + step) * 65_537 + index)
                yield
        except BaseException:
            self._abandon()
            raise
        finally:
            self._in_unit = False
        for p in self._params:
            grad, p.grad_acc = p.grad_acc, None
            if id(p) in seeded:  # the left sibling, this unit's gradient added into it: a level-1 node
                self._stacks[id(p)].push(_sibling_sum(p, grad, seeded[id(p)]), level=1)
                continue
            if grad is None and id(p) in self._stacks:
                grad = torch.zeros_like(self._stacks[id(p)]._stack[-1][1])
            if grad is not None:
                if id(p) not in self._stacks:
                    self._stacks[id(p)] = _stack_with_zeros(self._done(), grad)
                self._stacks[id(p)].push(grad)
        self._count = self._done() + 1

    def _seed_accumulators(self) -> dict[int, int]:
        """Where the tree's top partial sum is a leaf waiting for its right sibling (an odd unit), that leaf
        becomes the parameter's accumulator, so the backward adds this unit's gradient straight into it
        (``left.add_(grad)``, the tree's own addition): one unsharded buffer less at the peak. Returns
        ``{id(param): the accumulator's version}`` to check that exactly one addition happened."""
        seeded = {}
        for p in self._params:
            stack = self._stacks.get(id(p))
            left = stack.take_leaf() if stack is not None else None
            if left is not None:
                p.grad_acc = left
                seeded[id(p)] = left._version
        return seeded

    def _done(self) -> int:
        return self._count

    def held_bytes(self) -> int:
        """Bytes of the partial sums the tree holds now, every parameter (unsharded, the reduce dtype): what
        the mode keeps beyond the normal accumulation's one unsharded accumulator per parameter."""
        return sum(t.nbytes for s in self._stacks.values() for _, t in s._stack)

    @torch.no_grad()
    @lost_peers("InvariantUnits.reduce()")
    def reduce(self) -> None:
        """Every rank: the tree-order reduction of this rank's units into the sharded ``.grad``, / U. First
        the ranks agree (one flag all-reduced) whether any refused a gradient outside a unit in this step:
        then ``InvariantError`` on every rank and the step given up."""
        flag = torch.tensor([1.0 if self._refused else 0.0], dtype=torch.float64, device=self._device)
        collectives.all_reduce_sum(flag, self.part.reduce_shard_pg, what="InvariantUnits.agree")
        if self.part.replicate_pg is not None:
            collectives.all_reduce_sum(flag, self.part.reduce_replicate_pg, what="InvariantUnits.agree")
        invariant_guard.agreed(self, flag)
        if self._done() != len(self.indices):
            raise InvariantError(f"InvariantUnits.reduce: {self._done()} units run on this rank, "
                                 f"{len(self.indices)} expected")
        for g in self.groups:  # checked before anything is changed
            if not g.requires_all_reduce:  # HSDP's partial hold would add the held sums outside the tree
                raise InvariantError(f"InvariantUnits.reduce: {g.own._what} has "
                                     "set_requires_all_reduce(False); the mode reduces once per step: leave "
                                     "it True")
        for p in self._params:
            stack = self._stacks.pop(id(p), None)
            if stack is not None:
                p.grad_acc = stack.result()
        for g in self.groups:
            g.requires_gradient_sync = True
        reduce_accumulated(self.groups)
        self._count = 0
        self._reduced = True

    def close(self) -> None:
        """Leave the mode: every group back to the reduction, gradient divide factor and gradient sync it had
        before ``InvariantUnits(...)`` (a plain ``backward()`` afterwards reduces as without the mode, divided
        by K, not U). Also on leaving ``with perparam.InvariantUnits(...) as iu:``. Raises ``InvariantError``
        between units (units run and not reduced)."""
        if self._done():
            raise InvariantError(f"InvariantUnits.close: {self._done()} units run and not reduced; call "
                                 "iu.reduce() first")
        for g, invariant, factor, sync in self._before:
            g.invariant, g.gradient_divide_factor, g.requires_gradient_sync = invariant, factor, sync
        self._before = []
        invariant_guard.uninstall(self)

    def _gate(self, group) -> None:
        """Each group's ``grad_gate`` while the mode is on: a backward reaching ``group`` outside a unit is
        refused (``perparam.invariant_guard``)."""
        if not self._in_unit:
            self._refused = invariant_guard.outside_unit(self, group)
            raise InvariantError(self._refused)

    def __enter__(self) -> InvariantUnits:
        return self

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self.close()
        # an exception is on its way: this step's units dropped, the settings restored without the check
        else:
            self._abandon()
            self.close()

    def _abandon(self) -> None:
        """This rank's step given up (an exception in a unit, or leaving the ``with`` on one): the tree's
        partial sums and the gradients accumulated so far dropped, sync back on, so the next step (or a plain
        backward after ``close``) starts from nothing; the step starts again from its first unit."""
        self._stacks.clear()
        self._count = 0
        for g in self.groups:
            g.drop_unsharded_grads()
            g.requires_gradient_sync = True

    def _clip_slots(self) -> tuple[list[tuple[int, int, bool]], int]:
        """Per parameter ``(start of its slices in the norm's vector, shard dim d, counted here)`` and the
        vector's length: fixed by the global shapes, meshes and placements, so worked out once (the global
        offsets read the mesh's coordinates: host reads kept off the step)."""
        if self._slots is None:
            from torch.distributed.tensor import Shard
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            slots, total = [], 0
            for p in self._params:
                shape = p.sharded.shape
                place = p.placements[-1]  # the shard axis's placement
                d = place.dim if isinstance(place, Shard) and len(shape) else 0
                _, offset = compute_local_shape_and_global_offset(shape, p.sharded.device_mesh,
                                                                  p.sharded.placements)
                counted = isinstance(place, Shard) or p.shard_rank == 0
                slots.append((total + (offset[d] if len(shape) else 0), d, counted))
                total += shape[d] if len(shape) else 1
            self._slots = (slots, total)
        return self._slots

    @torch.no_grad()
    @lost_peers("InvariantUnits.clip_grad_norm_()")
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the model's gradients by their global 2-norm, computed K-independently: per slice along a
        parameter's shard dim ``d`` (``Shard(d)``; dim 0 when replicated), whole on every rank that holds it,
        a float64 sum of squares (the slice made contiguous: the same elements in the same order at every
        K), written at the slice's global index of one float64 vector (zeros elsewhere: all-reducing it adds
        only zeros, exact; a replicated parameter's slices by shard rank 0 alone), then summed in one fixed
        order; gradients scaled by ``min(max_norm / (norm + 1e-6), 1)`` (torch's rule). Returns the norm
        (0-dim float32, on the mesh's device: nothing is read back to the host; ``.item()`` it to log it).
        Every rank calls it, after ``reduce()`` (else ``InvariantError``); a negative or NaN ``max_norm``
        raises ``ValueError`` (``perparam.clip.check_max_norm``)."""
        check_max_norm(max_norm)
        if self._done():
            raise InvariantError(f"InvariantUnits.clip_grad_norm_: {self._done()} units run and not reduced "
                                 "yet; call iu.reduce() first (the norm is of the reduced gradients)")
        slots, total = self._clip_slots()
        entries = [(start, g.to_local(), d, counted)
                   for p, (start, d, counted) in zip(self._params, slots, strict=True)
                   if (g := p.sharded.grad) is not None]
        vec = torch.zeros(total, dtype=torch.float64, device=self._device)
        for start, local, d, counted in entries:
            if counted and local.numel():
                slices = local.reshape(1, 1) if not local.dim() else local.movedim(d, 0).contiguous()
                slices = slices.reshape(slices.shape[0], -1)
                step = max(1, _CLIP_CHUNK // slices.shape[1])  # float64 squares a few slices at a time: in
                # cache, 4x less CPU than all at once, same bits
                for i in range(0, slices.shape[0], step):
                    blk = slices[i:i + step].double()
                    torch.sum(blk.mul_(blk), dim=1, out=vec[start + i:start + i + blk.shape[0]])
        # HSDP: the replicas hold the same reduced gradients, so the shard axis alone covers every slice once
        collectives.all_reduce_sum(vec, self.part.reduce_shard_pg, what="InvariantUnits.clip")
        norm = vec.sum().sqrt().to(torch.float32)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for _, local, _, _ in entries:
            local.mul_(coef.to(local.dtype))
        return norm

    @torch.no_grad()
    def mean(self, values) -> torch.Tensor:
        """The mean of every unit's scalar loss (``values``: this rank's, one per unit, in order), same on
        every rank: 0-dim float32 on the mesh's device (nothing read back to the host; ``.item()`` it to log).
        Raises ``InvariantError`` when ``len(values)`` is not this rank's unit count."""
        values = list(values)
        if len(values) != len(self.indices):
            raise InvariantError(f"InvariantUnits.mean: {len(values)} values given, this rank runs "
                                 f"{len(self.indices)} units; pass one loss per unit of iu.split(batch), in "
                                 "order")
        mine = torch.zeros(self.units, dtype=torch.float64, device=self._device)
        for u, v in zip(self.indices, values):
            mine[u] = v  # a device copy (float(v) read each loss back to the host: a sync per unit on CUDA)
        collectives.all_reduce_sum(mine, self.part.reduce_shard_pg, what="InvariantUnits.mean")
        if self.part.replicate_pg is not None:  # HSDP: the other replicas' units (zeros elsewhere: exact)
            collectives.all_reduce_sum(mine, self.part.reduce_replicate_pg, what="InvariantUnits.mean")
        return (tree_sum(list(mine)) / self.units).to(torch.float32)


def _sibling_sum(p, acc: torch.Tensor, version: int) -> torch.Tensor:
    """The seeded accumulator after the unit: ``left + grad`` (one addition), ``left + 0`` (no gradient this
    unit, as a zero leaf would give). ``InvariantError`` when the gradient arrived in pieces (it was used
    again after its group's backward: ``(left + g1) + g2`` is not the tree's ``left + (g1 + g2)``)."""
    if acc._version == version:
        return acc.add_(torch.zeros_like(acc))
    if acc._version != version + 1:
        raise InvariantError(f"InvariantUnits: parameter '{p.path}' received its gradient in "
                             f"{acc._version - version} pieces in one unit (used again after its group's "
                             "backward); the tree order cannot be kept: use it inside one group's forward")
    return acc


def _stack_with_zeros(done: int, like: torch.Tensor) -> TreeStack:
    stack = TreeStack(lambda a, b: a.add_(b))
    for _ in range(done):
        stack.push(torch.zeros_like(like))
    return stack


def _groups(model):
    from .module import groups_below

    return groups_below(model, True)


def _check(g, mesh) -> None:
    if len(g.parts) > 1:
        raise InvariantError(f"InvariantUnits: {g.own._what} has parameters on other meshes "
                             "(ParamPolicy.mesh)")
    if g.parts[0].mesh != mesh:
        raise InvariantError(f"InvariantUnits: {g.own._what} is on mesh {g.parts[0].mesh.mesh.tolist()}, "
                             f"another group on {mesh.mesh.tolist()}; shard every group on one mesh")
    if g.reduce_scatter_comm is not None:
        raise InvariantError(f"InvariantUnits: {g.own._what} has a custom reduce-scatter")
    for p in g.params:
        name = f"'{p.path}'"
        if p.tp:
            raise InvariantError(f"InvariantUnits: parameter {name} uses tensor parallelism, refused")
        if p.policy.grad_quant is not None:
            raise InvariantError(f"InvariantUnits: parameter {name} has grad_quant (qgZ), refused")
        if p.policy.quant is not None and not p.stored_quantized:
            raise InvariantError(f"InvariantUnits: parameter {name} has a quantized all-gather (QuantPolicy "
                                 "without store_quantized): its blocks run over each rank's flattened shard, "
                                 "so the gathered values depend on K; refused (a frozen parameter stored "
                                 "quantized, QuantPolicy(store_quantized=True), gathers its codes exactly "
                                 "and is accepted)")
