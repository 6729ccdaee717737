"""Small models the tests share: uneven and empty shards, nesting, a module called twice."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d + 1)  # 2d+1 rows: uneven over most world sizes
        self.fc2 = nn.Linear(2 * d + 1, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, d]
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    """``Embedding(5, d)`` -> blocks -> ``Linear(d, 2)``: 5 and 2 rows leave empty shards on 3-4 ranks."""

    def __init__(self, d: int = 6, n_blocks: int = 2, call_twice: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_blocks))
        self.head = nn.Linear(d, 2)
        self.call_twice = call_twice

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # idx: [batch, tokens] -> [batch, 2]
        x = self.embed(idx).mean(dim=1)  # [batch, d]
        for block in self.blocks:
            x = block(x)
            if self.call_twice:
                x = block(x)
        return self.head(x)


def shard_blocks_then_root(model: nn.Module, root: dict | None = None, **kwargs) -> nn.Module:
    """``perparam.fully_shard(block, **kwargs)`` for each of ``model.blocks``, then ``fully_shard(model,
    **kwargs)`` (``root``: the root call's keywords instead). Returns ``model``."""
    import perparam

    for block in model.blocks:
        perparam.fully_shard(block, **kwargs)
    perparam.fully_shard(model, **(kwargs if root is None else root))
    return model


def sharded_tiny(seed: int = 0, *, shard: bool = True, d: int = 6, n_blocks: int = 2,
                 call_twice: bool = False, root: dict | None = None, **kwargs) -> TinyNet:
    """The setup most tests share: ``torch.manual_seed(seed)``, ``TinyNet(d, n_blocks, call_twice)``, then
    each block and the root sharded by ``shard_blocks_then_root(model, root, **kwargs)``. ``shard=False``:
    the same model unsharded (the one-process reference)."""
    torch.manual_seed(seed)
    model = TinyNet(d=d, n_blocks=n_blocks, call_twice=call_twice)
    return shard_blocks_then_root(model, root, **kwargs) if shard else model


def make_batches(steps: int, global_batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 5, (global_batch, 3), generator=g), torch.randn(global_batch, 2, generator=g))
            for _ in range(steps)]


def regression_batches(steps: int, global_batch: int, d_in: int, d_out: int,
                       seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` pairs ``(x [global_batch, d_in], y [global_batch, d_out])`` of standard normals, x then y
    per step from one generator seeded ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(global_batch, d_in, generator=g), torch.randn(global_batch, d_out, generator=g))
            for _ in range(steps)]


def train_steps(model: nn.Module, opt, batches, rank: int, world_size: int,
                micro_sync: tuple[bool, ...] = (True,)) -> list[torch.Tensor]:
    """One MSE step per global batch (each rank on its ``local_slice``; ``world_size == 0``: the whole
    batch, the one-process reference): forward and backward, ``opt.step()``, ``opt.zero_grad()``. With
    several ``micro_sync`` flags, one forward and backward per flag on equal chunks of the local batch, each
    after ``model.set_requires_gradient_sync(flag)``. Returns the local losses (detached scalars; the last
    micro-batch's)."""
    import torch.nn.functional as F

    losses = []
    for x, y in batches:
        if world_size:
            x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        for sync, xm, ym in zip(micro_sync, x.chunk(len(micro_sync)), y.chunk(len(micro_sync))):
            if len(micro_sync) > 1:
                model.set_requires_gradient_sync(sync)
            loss = F.mse_loss(model(xm), ym)
            loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter by name as a full tensor (a DTensor's ``full_tensor()``), detached copies."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def mean_over_ranks(x: torch.Tensor) -> float:
    """The mean of a per-rank scalar (e.g. a local loss) over all ranks of the default process group;
    with equal local batches that is the global batch's mean."""
    import torch.distributed as dist

    x = x.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x.item()


def local_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous share of a global batch (equal shares)."""
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


def comm_per_micro_batch(model: nn.Module, rank: int, world_size: int, micro_batches: int = 3) -> list[dict]:
    """Collectives (kind -> count) of each micro-batch's forward+backward; gradient sync only on the last."""
    import torch.nn.functional as F

    from perparam import CommCounter

    counts = []
    for i, (x, y) in enumerate(make_batches(micro_batches, 4)):
        model.set_requires_gradient_sync(i == micro_batches - 1)
        with CommCounter() as comm:
            F.mse_loss(model(local_slice(x, rank, world_size)), local_slice(y, rank, world_size)).backward()
        counts.append(comm.by_kind())
    return counts


class MLPNet(nn.Module):
    """The tensor-parallel tests' model: embedding, colwise ``up``, rowwise ``down``, norm and head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 6)
        self.up = nn.Linear(6, 10)  # colwise on tp=2: 5 rows per tp rank, then 3 + 2 over dp
        self.down = nn.Linear(10, 6)  # rowwise on tp=2: weight [6, 5] per tp rank, dp splits its rows
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, idx):  # idx: [batch, tokens] -> [batch, 3]
        x = self.embed(idx).mean(1)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(self.norm(x))
