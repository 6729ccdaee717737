"""``perparam.InvariantUnits`` used the wrong way: each misuse that would silently give K-dependent (or
simply wrong) results raises ``InvariantError`` naming the call and the fix. One launch of two ranks."""

import torch
from torch.distributed.device_mesh import init_device_mesh

import perparam
from tests.distributed import run_distributed
from tests.models import TinyNet, make_batches


def _build(world_size, units=4):
    torch.manual_seed(0)
    model = TinyNet()
    perparam.fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, perparam.InvariantUnits(model, units=units)


def _run_units(model, inv, x, y, order):
    for u, (xu, yu) in order:
        with inv.unit(*u):
            torch.nn.functional.mse_loss(model(xu), yu).backward()


def _error(fn):
    try:
        fn()
    except perparam.InvariantError as e:
        return str(e)
    return None


def _misuses(rank, world_size):
    torch.set_num_threads(1)
    x, y = make_batches(1, 16)[0]
    out = {}

    def swapped():  # iu.unit(step, u) for iu.unit(u, step), at step 1: wrong on every rank at once
        model, inv = _build(world_size)
        _run_units(model, inv, x, y, [((1, u), s) for u, s in inv.split((x, y))])
    out["swapped"] = _error(swapped)

    def repeated():  # the first unit run twice instead of each unit once
        model, inv = _build(world_size)
        first = inv.split((x, y))[0]
        _run_units(model, inv, x, y, [((first[0], 0), first[1])] * len(inv.indices))
    out["repeated"] = _error(repeated)

    def clip_first():  # clip_grad_norm_ before reduce(): nothing reduced yet
        model, inv = _build(world_size)
        _run_units(model, inv, x, y, [((u, 0), s) for u, s in inv.split((x, y))])
        inv.clip_grad_norm_(1.0)
    out["clip_first"] = _error(clip_first)

    out["mean_short"] = _error(lambda: _build(world_size)[1].mean([torch.tensor(1.0)]))
    out["split_mismatched"] = _error(lambda: _build(world_size)[1].split((x, y[:8])))
    out["split_not_tensor"] = _error(lambda: _build(world_size)[1].split({"x": x, "n": 3}))
    out["units_bool"] = _error(lambda: _build(world_size, units=True))

    def unmanaged():  # the blocks sharded, the root's embedding and head left out: never reduced
        model = TinyNet()
        for block in model.blocks:
            perparam.fully_shard(block, mesh=init_device_mesh("cpu", (world_size,)))
        perparam.InvariantUnits(model, units=4)
    out["unmanaged"] = _error(unmanaged)

    def after_close(model):  # this rank's rows, one plain backward: its local gradient shards
        n = x.shape[0] // world_size
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n]).backward()
        return [p.grad.to_local().clone() for p in model.parameters()]

    # one step; with `retry`, its second unit first raises and the step is run again
    def reduced_grads(retry):
        model, inv = _build(world_size)
        parts = inv.split((x, y))
        if retry:
            try:
                _run_units(model, inv, x, y, [((parts[0][0], 0), parts[0][1])])
                with inv.unit(parts[1][0], 0):
                    torch.nn.functional.mse_loss(model(parts[1][1][0]), parts[1][1][1]).backward()
                    raise RuntimeError("a failing unit")
            except RuntimeError:
                pass
        _run_units(model, inv, x, y, [((u, 0), s) for u, s in parts])
        inv.reduce()
        return [p.grad.to_local().clone() for p in model.parameters()]
    out["retry_diff"] = max(float((a - b).abs().max()) if a.numel() else 0.0
                            for a, b in zip(reduced_grads(True), reduced_grads(False)))

    model, inv = _build(world_size)
    with inv:  # one step in the mode, then left: the next plain backward reduces as without it (/ K, not / U)
        _run_units(model, inv, x, y, [((u, 0), s) for u, s in inv.split((x, y))])
        inv.reduce()
    left = after_close(model)
    torch.manual_seed(0)
    fresh = TinyNet()
    perparam.fully_shard(fresh, mesh=init_device_mesh("cpu", (world_size,)))
    out["closed_diff"] = max(float((a - b).abs().max()) if a.numel() else 0.0
                             for a, b in zip(left, after_close(fresh)))
    return out


def test_invariant_units_refuse_out_of_order_units_an_early_clip_ragged_batches_unsharded_params_and_close():
    for out in run_distributed(_misuses, 2):
        assert "iu.unit(u, step)" in out["swapped"] and "unit 1 given" in out["swapped"], out["swapped"]
        assert out["repeated"] and "in order" in out["repeated"], out["repeated"]
        assert out["clip_first"] and "reduce()" in out["clip_first"], out["clip_first"]
        assert out["mean_short"] and "1 values" in out["mean_short"], out["mean_short"]
        assert out["split_mismatched"] and "16" in out["split_mismatched"] and "8" in out["split_mismatched"]
        assert out["split_not_tensor"] and "'n'" in out["split_not_tensor"], out["split_not_tensor"]
        assert out["units_bool"] and "power of two" in out["units_bool"], out["units_bool"]
        assert out["unmanaged"] and "'embed.weight'" in out["unmanaged"], out["unmanaged"]
        assert out["closed_diff"] == 0.0, out["closed_diff"]
        assert out["retry_diff"] == 0.0, out["retry_diff"]
