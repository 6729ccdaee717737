"""K-invariant training (``perparam.InvariantUnits``): parameters bitwise equal (sha256 of every
parameter's full bytes) after AdamW steps on 1, 2 and 4 ranks for the same global batch, and the
refusals."""

import hashlib

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import perparam
from tests.distributed import run_distributed
from tests.models import TinyNet, make_batches, sharded_tiny


def _train(rank, world_size, units, steps, clip, case="fp32"):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (world_size,))
    kw = {}
    if case == "bf16":
        kw["mp_policy"] = perparam.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
    if case == "stage2":
        kw["param_policy"] = {"*": perparam.ParamPolicy(zero_stage=2)}
    if case == "frozen":
        model.blocks[0].fc1.weight.requires_grad_(False)
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh, **kw)
    perparam.fully_shard(model, mesh=mesh, **kw)
    inv = perparam.InvariantUnits(model, units=units, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step, (x, y) in enumerate(make_batches(steps, 16)):
        for u, (xu, yu) in inv.split((x, y)):
            with inv.unit(u, step):
                torch.nn.functional.mse_loss(model(xu), yu).backward()
        inv.reduce()
        if clip:
            inv.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.full_tensor().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.fast
def test_invariant_units_give_bitwise_equal_parameters_on_1_2_and_4_ranks():
    hashes = {k: run_distributed(_train, k, 8, 4, False) for k in (1, 2, 4)}
    assert len({h for hs in hashes.values() for h in hs}) == 1, hashes


def test_invariant_units_with_the_invariant_clip_norm_give_bitwise_equal_parameters_on_1_2_and_4_ranks():
    hashes = {k: run_distributed(_train, k, 4, 4, True) for k in (1, 2, 4)}
    assert len({h for hs in hashes.values() for h in hs}) == 1, hashes


@pytest.mark.parametrize("case", ["bf16", "frozen", "stage2"])
def test_invariant_units_give_bitwise_equal_parameters_in_each_case_on_1_2_and_4_ranks(case):
    hashes = {k: run_distributed(_train, k, 4, 3, False, case) for k in (1, 2, 4)}
    assert len({h for hs in hashes.values() for h in hs}) == 1, hashes


def test_invariant_units_stay_bitwise_equal_over_24_steps_on_1_2_and_4_ranks():
    hashes = {k: run_distributed(_train, k, 8, 24, True) for k in (1, 2, 4)}
    assert len({h for hs in hashes.values() for h in hs}) == 1, hashes


def _refuse(rank, world_size, units):
    model = TinyNet()
    perparam.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    try:
        perparam.InvariantUnits(model, units=units)
    except perparam.InvariantError as e:
        return str(e)
    return None


@pytest.mark.parametrize("units, world, words", [(6, 2, "power of two"), (2, 4, "does not divide")])
def test_invariant_units_refuse_a_bad_unit_count_naming_it(units, world, words):
    assert all(words in m for m in run_distributed(_refuse, world, units))


def _mean(rank, world_size):
    torch.set_num_threads(1)
    model = TinyNet()
    perparam.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    inv = perparam.InvariantUnits(model, units=4)
    return float(inv.mean([torch.tensor(0.1 * (u + 1)) for u in inv.indices]))


def test_invariant_mean_of_unit_losses_is_bitwise_equal_on_1_2_and_4_ranks():
    assert len({m for k in (1, 2, 4) for m in run_distributed(_mean, k)}) == 1


def _refuse_policy(rank, world_size, policy):
    model = TinyNet()
    perparam.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)), param_policy={"*": policy})
    try:
        perparam.InvariantUnits(model, units=4)
    except perparam.InvariantError as e:
        return str(e)
    return None


@pytest.mark.parametrize("policy, words", [
    (perparam.ParamPolicy(grad_quant="int8"), "grad_quant"),
    (perparam.ParamPolicy(quant=perparam.QuantPolicy("int8")), "quantized all-gather"),  # blocks span rows
])
def test_invariant_units_refuse_grad_quant_and_a_quantized_all_gather_naming_them(policy, words):
    assert all(m and words in m for m in run_distributed(_refuse_policy, 2, policy))


#: stage 3 by default; a replicated LayerNorm and head bias, stage-1 fc1, Shard(1) fc2.weight (its clip
#: norm per column), all in one model
BLOCK = {"norm.*": perparam.ParamPolicy(placement=Replicate()), "fc1.*": perparam.ParamPolicy(zero_stage=1),
         "fc2.weight": perparam.ParamPolicy(placement=Shard(1))}
ROOT = {"head.bias": perparam.ParamPolicy(placement=Replicate())}
MIXED = (BLOCK, ROOT)


def _meshes(world_size):
    """Every data-parallel layout four ranks can run side by side: K = 1 (each rank alone), K = 2 (two
    pairs), K = 4, HSDP 2 x 2 and 4 x 1 (replicate x shard: four replicas tell a tree from another order)."""
    return {"1": init_device_mesh("cpu", (4, 1), mesh_dim_names=("r", "k"))["k"],
            "2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("r", "k"))["k"],
            "4": init_device_mesh("cpu", (4,)), "2x2": init_device_mesh("cpu", (2, 2)),
            "4x1": init_device_mesh("cpu", (4, 1))}


def _train_on(mesh, units, steps, policy, clip=True):
    torch.set_num_threads(1)
    model = sharded_tiny(mesh=mesh, param_policy=policy[0], root={"mesh": mesh, "param_policy": policy[1]})
    inv = perparam.InvariantUnits(model, units=units, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    losses = [_step(model, inv, opt, step, x, y, clip) for step, (x, y) in enumerate(make_batches(steps, 16))]
    return _hash(model), losses


def _step(model, inv, opt, step, x, y, clip=True) -> float:
    """One step in the mode: this rank's units one backward each, the tree reduction, the invariant clip
    (``clip``), AdamW; returns the units' mean loss (the same bits at every K)."""
    mine = []
    for u, (xu, yu) in inv.split((x, y)):
        with inv.unit(u, step):
            loss = torch.nn.functional.mse_loss(model(xu), yu)
            loss.backward()
        mine.append(loss.detach())
    inv.reduce()
    if clip:
        inv.clip_grad_norm_(0.05)
    opt.step()
    opt.zero_grad()
    return float(inv.mean(mine))


def _hash(model):
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.full_tensor().detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _mixed_on_every_mesh(rank, world_size):
    return {name: _train_on(mesh, 8, 4, MIXED) for name, mesh in _meshes(world_size).items()}


def test_invariant_units_with_replicated_stage_1_and_stage_3_parameters_on_1d_and_hsdp_are_bitwise_equal():
    """One launch of four ranks: K = 1, 2, 4 (1D) and HSDP 2 x 2, the mixed model, 4 clipped AdamW steps:
    one parameter hash and one list of reported losses over every mesh and rank."""
    results = run_distributed(_mixed_on_every_mesh, 4)
    hashes = {(r, name): h for r, res in enumerate(results) for name, (h, _) in res.items()}
    assert len(set(hashes.values())) == 1, hashes
    assert len({tuple(losses) for res in results for _, losses in res.values()}) == 1


class DropNet(TinyNet):
    """TinyNet with dropout after the embedding: each unit's mask comes from the unit's RNG stream."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.25)

    def forward(self, idx):
        x = self.drop(self.embed(idx).mean(dim=1))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _state_hash(model, opt):
    """sha256 of every parameter's full bytes and every AdamW state tensor's (``step`` included)."""
    h = hashlib.sha256(_hash(model).encode())
    for name, p in model.named_parameters():
        for key, value in sorted(opt.state[p].items()):
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            h.update(f"{name}.{key}".encode())
            h.update(full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


#: the legs of the resumed run: (world size, steps run); the K = 4 launch also runs on to the end
#: uninterrupted
LEGS = [(4, 2), (2, 2), (1, 2), (4, 2)]


def _leg(rank, world_size, folder, leg):
    """Leg ``leg`` of ``LEGS``: load the previous leg's checkpoint (none for the first), run its steps in
    the mode (dropout on, clipped AdamW, the mixed model), save; the first leg then continues to the last
    step (the uninterrupted K = 4 run). Returns (state hash at the leg's end, its reported losses[, the
    uninterrupted run's hash and losses])."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    model = DropNet()
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh, param_policy=MIXED[0])
    perparam.fully_shard(model, mesh=mesh, param_policy=MIXED[1])
    inv = perparam.InvariantUnits(model, units=8, seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    start = 0 if leg == 0 else perparam.checkpoint.load(f"{folder}/leg{leg - 1}", model, opt)["step"]
    total = sum(n for _, n in LEGS)
    batches = make_batches(total, 16)

    def run(first, last):
        return [_step(model, inv, opt, step, *batches[step]) for step in range(first, last)]

    end = start + LEGS[leg][1]
    losses = run(start, end)
    perparam.checkpoint.save(f"{folder}/leg{leg}", model, opt, extra={"step": end})
    out = (_state_hash(model, opt), losses)
    if leg == 0:
        rest = run(end, total)
        out += (_state_hash(model, opt), losses + rest)
    return out


def test_a_run_saved_at_k4_continues_bitwise_on_2_then_1_then_4_ranks_as_the_uninterrupted_k4_run(tmp_path):
    """Parameters, AdamW state (``step`` included), dropout masks and reported losses: the run saved at
    K = 4 after 2 steps, resumed on 2 ranks for 2, saved, on 1 for 2, saved, on 4 for the last 2, ends with
    the state hash of the uninterrupted K = 4 run and the same per-step losses."""
    results = [run_distributed(_leg, k, str(tmp_path), leg) for leg, (k, _) in enumerate(LEGS)]
    assert all(r == leg[0] for leg in results for r in leg)  # every rank alike
    _, _, straight, straight_losses = results[0][0]
    assert results[-1][0][0] == straight, [leg[0][0] for leg in results]
    assert [x for leg in results for x in leg[0][1]] == straight_losses


class CheckpointedNet(TinyNet):
    """TinyNet whose blocks run under activation checkpointing (recomputed in backward)."""

    def forward(self, idx):
        x = self.embed(idx).mean(dim=1)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x)


class Adapted(torch.nn.Module):
    """A frozen base ``Linear`` plus a rank-2 adapter ``x @ a.T @ b.T`` (LoRA's shape, both factors
    nonzero)."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(2, base.in_features) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(base.out_features, 2) * 0.1)

    def forward(self, x):
        return self.base(x) + x @ self.a.t() @ self.b.t()


NF4_BASE = {"*.base.weight": perparam.ParamPolicy(quant=perparam.QuantPolicy("nf4", store_quantized=True))}
OWNER = {"fc*.weight": perparam.ParamPolicy(update="owner")}
CPU_ALL = {"*": perparam.ParamPolicy(offload=perparam.OffloadPolicy("cpu", "all"))}


def _feature_run(mesh, case, steps=2):
    """``"qlora"``: activation checkpointing, the blocks' Linears frozen and stored NF4 with adapters
    (AdamW on the adapters and the rest); ``"owner"``: activation checkpointing, the blocks' weights
    stepped whole by ``torch.optim.Muon`` on their owner (``update="owner"``), the root's parameters
    offloaded (``OffloadPolicy("cpu", "all")``), AdamW on the rest. Clipped steps in the mode."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = CheckpointedNet()
    if case == "qlora":
        for block in model.blocks:
            block.fc1, block.fc2 = Adapted(block.fc1), Adapted(block.fc2)
    for block in model.blocks:
        perparam.fully_shard(block, mesh=mesh, param_policy=NF4_BASE if case == "qlora" else OWNER)
    perparam.fully_shard(model, mesh=mesh, param_policy=None if case == "qlora" else CPU_ALL)
    inv = perparam.InvariantUnits(model, units=8, seed=7)
    whole = [p for n, p in model.named_parameters()
             if case == "owner" and ".fc" in n and n.endswith("weight")]
    rest = [p for p in model.parameters() if p.requires_grad and all(p is not w for w in whole)]
    opts = [torch.optim.AdamW(rest, lr=1e-2, foreach=False)] + ([torch.optim.Muon(whole, lr=0.02)] if whole
                                                                else [])
    for step, (x, y) in enumerate(make_batches(steps, 16)):
        for u, (xu, yu) in inv.split((x, y)):
            with inv.unit(u, step):
                torch.nn.functional.mse_loss(model(xu), yu).backward()
        inv.reduce()
        inv.clip_grad_norm_(0.05)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return _hash(model)


def _features_on_every_mesh(rank, world_size):
    meshes = _meshes(world_size)
    return {(case, name): _feature_run(meshes[name], case) for case in ("qlora", "owner")
            for name in ("1", "2", "4")}


def test_invariant_units_with_checkpointing_qlora_offload_and_owner_muon_are_bitwise_equal_on_every_mesh():
    """One launch of four ranks, K = 1, 2 and 4 side by side: per case one parameter hash."""
    results = run_distributed(_features_on_every_mesh, 4)
    for case in ("qlora", "owner"):
        hashes = {(r, name): h for r, res in enumerate(results) for (c, name), h in res.items() if c == case}
        assert len(set(hashes.values())) == 1, (case, hashes)


def _refuse_held_partial_sums(rank, world_size):
    torch.set_num_threads(1)
    model = TinyNet()
    perparam.fully_shard(model, mesh=init_device_mesh("cpu", (2, 1)))
    inv = perparam.InvariantUnits(model, units=2)
    model.set_requires_all_reduce(False)
    x, y = make_batches(1, 4)[0]
    for u, (xu, yu) in inv.split((x, y)):
        with inv.unit(u, 0):
            torch.nn.functional.mse_loss(model(xu), yu).backward()
    try:
        inv.reduce()
    except perparam.InvariantError as e:
        return str(e)
    return None


def test_invariant_reduce_refuses_hsdp_held_partial_sums_naming_the_setting():
    assert all(m and "set_requires_all_reduce(False)" in m
               for m in run_distributed(_refuse_held_partial_sums, 2))
