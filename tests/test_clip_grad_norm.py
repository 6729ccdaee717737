"""``perparam.clip_grad_norm_``: the norm over every distinct gradient element, each counted once, bitwise
equal on every rank, for any mix of meshes and placements, empty shards and norm types.

The weighting is checked in one process first (hypothesis: simulated worlds of up to 8 ranks, every rank's
local shards and weights from the project's layout functions, against the norm of the global gradients),
then on real gloo ranks over a fixed handful of layouts against a one-process reference.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import perparam
from perparam.clip import DISTINCT_AXES, combine, copies, local_contribution, outside_copies
from perparam.sharding.layout import local_shape_and_offset
from tests.distributed import run_distributed
from tests.models import MLPNet

INF = float("inf")
NORM_TYPES = (2.0, 1.0, 3.0, INF)


# -- one process: the weighting against the norm of the global gradients -----------------------------------
def rank_shards(full: torch.Tensor, mesh_shape: tuple[int, ...],
                placements: tuple) -> list[tuple[torch.Tensor, int]]:
    """Each mesh rank's (row-major) local shard of ``full`` (``torch.chunk`` semantics, nested over the mesh
    axes: uneven and empty shards) and how many ranks of the mesh hold each of its elements."""
    out = []
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        shape, offset = local_shape_and_offset(full.shape, mesh_shape, placements, coord)
        piece = full
        for d, (start, length) in enumerate(zip(offset, shape)):
            piece = piece.narrow(d, start, length)
        out.append((piece, copies(mesh_shape, placements)))
    return out


AXIS_POOL = ("dp_replicate", "dp_shard", "tp", "ep")  # "ep" is distinct: its ranks hold other parameters


@st.composite
def worlds(draw):
    """A root mesh (1-3 named axes, at most 8 ranks), parameters on sub-meshes of it or plain, and a seed."""
    names = draw(st.permutations(AXIS_POOL))[:draw(st.integers(1, 3))]
    shape = draw(st.lists(st.integers(1, 3), min_size=len(names), max_size=len(names)).filter(
        lambda s: math.prod(s) <= 8))
    params = []
    for _ in range(draw(st.integers(1, 4))):
        dims = draw(st.lists(st.integers(1, 5), max_size=2))
        if draw(st.integers(0, 4)) == 0:
            params.append((tuple(dims), None, None))  # plain: replicated on every rank
            continue
        axes = sorted(draw(st.sets(st.integers(0, len(names) - 1), min_size=1)))
        choices = [Replicate()] + [Shard(d) for d in range(len(dims))]
        placements = tuple(draw(st.sampled_from(choices)) for _ in axes)
        params.append((tuple(dims), tuple(axes), placements))
    return tuple(names), tuple(shape), params, draw(st.integers(0, 2**16))


@pytest.mark.fast
@settings(max_examples=400, deadline=None)
@given(worlds())
def test_weighted_local_contributions_sum_to_the_norm_of_every_distinct_element(world):
    names, root_shape, params, seed = world
    gen = torch.Generator().manual_seed(seed)
    coords = list(itertools.product(*(range(n) for n in root_shape)))
    contributions = {c: [] for c in coords}
    distinct_grads = []
    for dims, axes, placements in params:
        if axes is None:
            full = torch.randn(dims, generator=gen, dtype=torch.float64)
            distinct_grads.append(full)
            for c in coords:
                contributions[c].append((full, len(coords)))
            continue
        # one parameter per coordinate of the distinct axes the mesh does not span (per-rank experts)
        apart = [a for a in range(len(names)) if a not in axes and names[a] in DISTINCT_AXES]
        mesh_shape = tuple(root_shape[a] for a in axes)
        outside = outside_copies(root_shape, names, axes)
        for key in itertools.product(*(range(root_shape[a]) for a in apart)):
            full = torch.randn(dims, generator=gen, dtype=torch.float64)
            distinct_grads.append(full)
            shards = rank_shards(full, mesh_shape, placements)
            for c in coords:
                if tuple(c[a] for a in apart) != key:
                    continue  # this rank holds another expert
                index = 0
                for a in axes:
                    index = index * root_shape[a] + c[a]
                piece, n = shards[index]
                contributions[c].append((piece, n * outside))
    everything = torch.cat([g.flatten() for g in distinct_grads])
    for p in NORM_TYPES:
        mine = torch.stack([local_contribution(contributions[c], p) for c in coords])
        want = torch.linalg.vector_norm(everything, p)
        if p == INF:
            assert combine(mine, p) == want
        else:
            torch.testing.assert_close(combine(mine, p), want, rtol=1e-12, atol=0)


def test_a_partial_placement_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"Partial.*reduce the gradient first"):
        copies((2,), (Partial(),))


def test_a_mesh_cut_along_an_unknown_axis_is_refused_naming_both_keywords():
    with pytest.raises(ValueError, match=r"'group'.*replicated_axes=.*distinct_axes="):
        outside_copies((2, 2), ("group", "dp_shard"), {1})
    assert outside_copies((2, 2), ("group", "dp_shard"), {1}, distinct_axes=("group",)) == 1
    assert outside_copies((2, 2), ("group", "dp_shard"), {1}, replicated_axes=("group",)) == 2
    assert outside_copies((3, 2), ("group", "dp_shard"), {0, 1}) == 1  # spans every axis: nothing outside


@pytest.mark.parametrize("norm_type", [0.0, -1.0, -INF, float("nan")])
def test_a_norm_type_that_is_not_positive_is_refused(norm_type):
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="norm_type"):
        perparam.clip_grad_norm_([p], 1.0, norm_type)


@pytest.mark.parametrize("norm_type,max_norm",
                         [("1", 1.0), ("inf", 1.0), (True, 1.0), (None, 1.0), (2.0, "1")])
def test_a_norm_type_or_max_norm_that_is_not_a_number_is_refused_before_anything_changes(norm_type, max_norm):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0)
    name = "max_norm" if norm_type == 2.0 else "norm_type"
    with pytest.raises(TypeError,
                       match=rf"{name} must be a number .* got "
                             rf"{max_norm if name == 'max_norm' else norm_type!r}"):
        perparam.clip_grad_norm_([p], max_norm, norm_type)
    assert torch.equal(p.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_without_a_process_group_plain_tensors_clip_as_torch_does(norm_type):
    def params():
        torch.manual_seed(0)
        ps = [nn.Parameter(torch.randn(3, 2)), nn.Parameter(torch.randn(0)), nn.Parameter(torch.randn(4))]
        for p in ps:
            p.grad = torch.randn_like(p) * 3
        return ps

    ours = params()
    theirs = [p for p in params() if p.numel()]  # torch's inf norm fails on an empty tensor; ours counts 0
    got = perparam.clip_grad_norm_(ours, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip([p for p in ours if p.numel()], theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_a_non_finite_norm_raises_with_error_if_nonfinite():
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([1.0, float("nan")])
    with pytest.raises(RuntimeError, match="non-finite"):
        perparam.clip_grad_norm_([p], 1.0, error_if_nonfinite=True)
    assert perparam.clip_grad_norm_([p], 1.0).isnan()


# -- real ranks: the issue's expert-parallel example --------------------------------------------------------
def _grad(name: str, shape) -> torch.Tensor:
    """A gradient for logical parameter ``name``, the same in every process."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))


def _ep_modules() -> tuple[nn.Module, list[nn.Module], nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(4, 4), [nn.Linear(4, 4), nn.Linear(4, 4)], nn.Linear(4, 2)


def _ep_reference_grads(pre, experts, post) -> None:
    """One process, the global batch: token i goes to expert i % 2."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    h = pre(x)
    routed = torch.stack([experts[i % 2](h[i]) for i in range(8)])
    torch.nn.functional.mse_loss(post(routed), y).backward()


def ep_step(rank: int, world_size: int, max_norm: float) -> dict:
    """Dense ``pre``/``post`` sharded on a 2-rank mesh, each rank's own expert on a 1-rank ``edp`` mesh; the
    gradients are the one-process reference's; norms for each norm type, then a clipped SGD step."""
    pre, experts, post = _ep_modules()
    _ep_reference_grads(pre, experts, post)
    grads = {m: {n: p.grad.clone() for n, p in m.named_parameters()} for m in (pre, *experts, post)}
    ep = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "edp"))
    dense = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    mine = experts[rank]
    perparam.fully_shard(pre, mesh=dense)
    perparam.fully_shard(post, mesh=dense)
    perparam.fully_shard(mine, mesh=ep["edp"])
    params = [*pre.parameters(), *mine.parameters(), *post.parameters()]
    for m in (pre, mine, post):
        for n, p in m.named_parameters():
            p.grad = distribute_tensor(grads[m][n], p.device_mesh, p.placements, src_data_rank=None)
    norms = {p: perparam.clip_grad_norm_(params, INF, p) for p in NORM_TYPES}
    clipped = perparam.clip_grad_norm_(params, max_norm)
    torch.optim.SGD(params, lr=1.0).step()
    return {"norms": norms, "clipped": clipped,
            "params": {f"{tag}.{n}": p.full_tensor() for tag, m in (("pre", pre), (f"expert{rank}", mine),
                                                                     ("post", post))
                       for n, p in m.named_parameters()}}


def ep_reference(max_norm: float) -> dict:
    pre, experts, post = _ep_modules()
    _ep_reference_grads(pre, experts, post)
    params = [p for m in (pre, *experts, post) for p in m.parameters()]
    norms = {p: torch.nn.utils.get_total_norm([q.grad for q in params], p) for p in NORM_TYPES}
    clipped = torch.nn.utils.clip_grad_norm_(params, max_norm)
    torch.optim.SGD(params, lr=1.0).step()
    named = {"pre": pre, "expert0": experts[0], "expert1": experts[1], "post": post}
    return {"norms": norms, "clipped": clipped,
            "params": {f"{tag}.{n}": p.detach() for tag, m in named.items() for n, p in m.named_parameters()}}


@pytest.mark.fast
def test_expert_meshes_give_the_one_process_norm_on_every_rank_and_clip_alike():
    max_norm = 0.1  # the 2-norm is 1.39: clipping is active
    want = ep_reference(max_norm)
    outs = run_distributed(ep_step, 2, max_norm)
    assert want["clipped"] > max_norm
    for p in NORM_TYPES:
        assert torch.equal(outs[0]["norms"][p], outs[1]["norms"][p]), p  # bitwise, every rank
        torch.testing.assert_close(outs[0]["norms"][p], want["norms"][p], rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[0]["clipped"], want["clipped"], rtol=0, atol=1e-6)
    for out in outs:
        for name, value in out["params"].items():
            torch.testing.assert_close(value, want["params"][name], rtol=0, atol=1e-6, msg=name)


# -- real ranks: a fixed handful of layouts ------------------------------------------------------------------
def _layouts(rank: int) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Per layout, this rank's parameters with the logical name each stands for (4 ranks)."""
    torch.manual_seed(0)
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    hsdp = nn.Linear(4, 3)  # 3 rows over 2 shards, replicated twice
    perparam.fully_shard(hsdp,
                         mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard")))
    out["hsdp"] = [(f"hsdp.{n}", p) for n, p in hsdp.named_parameters()]
    fsdp = nn.Linear(4, 2)  # 2 rows on 4 ranks: ranks 2 and 3 hold empty shards
    perparam.fully_shard(fsdp, mesh=init_device_mesh("cpu", (4,)))
    out["empty_shards"] = [(f"fsdp.{n}", p) for n, p in fsdp.named_parameters()]
    # expert e on the 2 ranks of ep group e
    ep = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "edp"))
    expert = nn.Linear(4, 3)
    perparam.fully_shard(expert, mesh=ep["edp"])
    e = ep.get_local_rank("ep")
    out["experts"] = [(f"expert{e}.{n}", p) for n, p in expert.named_parameters()]
    out["plain"] = [("plain", nn.Parameter(torch.zeros(3)))]
    tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = MLPNet()  # up/down TP-composed (_StridedShard), the rest on dp_shard only (replicated over tp)
    parallelize_module(model, tp["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    perparam.fully_shard(model, mesh=tp["dp_shard"])
    out["tp"] = [(f"tp.{n}", p) for n, p in model.named_parameters()]
    for params in out.values():
        for name, p in params:
            full = _grad(name, p.shape)
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else full
    return out


def _logical_shapes() -> dict[str, dict[str, tuple[int, ...]]]:
    """Every logical parameter of each layout (both experts), as a one-process model holds them."""
    torch.manual_seed(0)
    lin = {n: tuple(p.shape) for n, p in nn.Linear(4, 3).named_parameters()}
    return {"hsdp": {f"hsdp.{n}": s for n, s in lin.items()},
            "empty_shards": {f"fsdp.{n}": tuple(p.shape) for n, p in nn.Linear(4, 2).named_parameters()},
            "experts": {f"expert{e}.{n}": s for e in (0, 1) for n, s in lin.items()},
            "plain": {"plain": (3,)},
            "tp": {f"tp.{n}": tuple(p.shape) for n, p in MLPNet().named_parameters()}}


def layout_norms(rank: int, world_size: int) -> dict:
    layouts = _layouts(rank)
    layouts["all"] = [item for params in list(layouts.values()) for item in params]
    placements = {n: str(p.placements) for n, p in layouts["tp"] if isinstance(p, DTensor)}
    return {"norms": {(name, p): perparam.clip_grad_norm_([q for _, q in params], INF, p)
                      for name, params in layouts.items() for p in NORM_TYPES},
            "tp_placements": placements}


def test_layouts_give_the_one_process_norm_bitwise_equal_on_every_rank():
    shapes = _logical_shapes()
    shapes["all"] = {n: s for layout in list(shapes.values()) for n, s in layout.items()}
    outs = run_distributed(layout_norms, 4)
    assert "_StridedShard" in outs[0]["tp_placements"]["tp.up.weight"], outs[0]["tp_placements"]
    for (layout, p), got in outs[0]["norms"].items():
        for out in outs[1:]:
            assert torch.equal(out["norms"][layout, p], got), (layout, p)
        want = torch.nn.utils.get_total_norm([_grad(n, s) for n, s in shapes[layout].items()], p)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * max(1.0, want.item()), msg=f"{layout} {p}")


def empty_shard_norms(rank: int, world_size: int) -> dict:
    """The issue's ``nn.Linear(4, 2)`` on 3 ranks (rank 2 holds no rows) plus a plain parameter."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    perparam.fully_shard(lin, mesh=init_device_mesh("cpu", (3,)))
    plain = nn.Parameter(torch.zeros(3))
    named = [*((f"lin.{n}", p) for n, p in lin.named_parameters()), ("plain", plain)]
    for name, p in named:
        full = _grad(name, p.shape)
        p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None) \
            if isinstance(p, DTensor) else full
    records, norms = [], {}
    for p in NORM_TYPES:
        with perparam.CommCounter() as comm:
            norms[p] = perparam.clip_grad_norm_([q for _, q in named], INF, p)
        records.append([(r.kind, r.nbytes, r.group_size) for r in comm.records])
    return {"norms": norms, "records": records, "local_rows": lin.weight.to_local().shape[0]}


def test_a_rank_with_empty_shards_issues_the_same_one_all_reduce_and_gets_the_same_norm():
    outs = run_distributed(empty_shard_norms, 3)
    assert outs[2]["local_rows"] == 0
    torch.manual_seed(0)
    full = [_grad(f"lin.{n}", p.shape)
            for n, p in nn.Linear(4, 2).named_parameters()] + [_grad("plain", (3,))]
    for p in NORM_TYPES:
        want = torch.nn.utils.get_total_norm(full, p)
        for out in outs:
            assert torch.equal(out["norms"][p], outs[0]["norms"][p]), p
            torch.testing.assert_close(out["norms"][p], want, rtol=0, atol=1e-6)
    for out in outs:  # one all-reduce of [world, 2] float64 per call, on every rank
        assert out["records"] == [[("all_reduce", 3 * 2 * 8, 3)]] * len(NORM_TYPES)


# -- real ranks: what the rule cannot count is refused on every rank ----------------------------------------
def refusal(rank: int, world_size: int, case: str) -> str:
    torch.manual_seed(0)
    names = ("group", "edp") if case == "unknown_axis" else ("ep", "edp")
    expert = nn.Linear(2, 2)
    perparam.fully_shard(expert, mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=names)["edp"])
    for p in expert.parameters():
        p.grad = DTensor.from_local(torch.ones(p.to_local().shape), p.device_mesh, p.placements)
    if case == "partial" and rank == 0:
        expert.weight.grad = DTensor.from_local(torch.ones(2, 2), expert.weight.device_mesh, [Partial()])
    try:
        perparam.clip_grad_norm_(expert.parameters(), 1.0)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case,fragments", [
    ("partial", [["parameter #0", "Partial"], ["rank(s) [0]"]]),
    ("unknown_axis", [["'group'", "distinct_axes="], ["'group'", "distinct_axes="]]),
])
def test_a_gradient_the_rule_cannot_count_raises_on_every_rank(case, fragments):
    for message, want in zip(run_distributed(refusal, 2, case), fragments):
        for fragment in want:
            assert fragment in message, (fragment, message)
