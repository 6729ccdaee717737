"""The disk tier: optimizer state (and stored shards) in files give bit-identical training, 1D and HSDP,
K = 1-4 with uneven and empty shards, stock optimizers, checkpoints through the tier, and clear errors."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import perparam
from perparam import OffloadPolicy, ParamPolicy, ShardingError, fully_shard
from perparam.offload import OffloadError, mapped
from perparam.offload.scratch import PREFIX, Scratch, clean_stale
from tests.distributed import run_distributed
from tests.models import TinyNet, local_slice, make_batches, sharded_tiny, train_steps

STEPS = 3
OPTIMIZERS = {
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adam_loop": lambda ps: torch.optim.Adam(ps, lr=1e-2, foreach=False),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, foreach=True),
}


def _build(world_size: int, offload, mesh_shape=None) -> TinyNet:
    mesh = init_device_mesh("cpu", mesh_shape or (world_size,),
                            mesh_dim_names=("replicate", "shard") if mesh_shape and len(mesh_shape) == 2
                            else None)
    return sharded_tiny(mesh=mesh, offload_policy=offload)


def _train(rank: int, world_size: int, model: TinyNet, optimizer, steps: int = STEPS, start: int = 0,
           accumulate: bool = False) -> list[float]:
    """``steps`` optimizer steps; ``accumulate``: three backwards per step on thirds of the batch, the first
    without gradient sync (no-sync accumulation of 2 micro-batches), the last two each reduced into the
    sharded ``.grad`` (the second adds into a gradient shard the tier evicted)."""
    batches = make_batches(start + steps, 12 if accumulate else 8)[start:]
    micro_sync = (False, True, True) if accumulate else (True,)
    return [loss.item() for loss in train_steps(model, optimizer, batches, rank, world_size, micro_sync)]


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().clone() for n, p in model.named_parameters()}


def same_with_and_without_disk(rank: int, world_size: int, root: str, optimizers: tuple[str, ...],
                               mesh_shape=None, accumulate: tuple[bool, ...] = (False,)) -> list:
    """Per optimizer and accumulation (see ``_train``): (losses, parameters) of one run per tier on this
    rank: device, optimizer state on disk, everything on disk; and how many files the disk tier held (the
    gradient shards' among them)."""
    out = []
    for optimizer in optimizers:
        for acc in accumulate:
            runs = []
            for offload in (None, OffloadPolicy("disk", "optimizer", path=root),
                            OffloadPolicy("disk", "all", path=root)):
                model = _build(world_size, offload, mesh_shape)
                opt = OPTIMIZERS[optimizer](model.parameters())
                runs.append((_train(rank, world_size, model, opt, accumulate=acc), _full(model)))
            out.append(runs)
    perparam.offload.flush()
    files = list(Path(root).glob(f"{PREFIX}*/*.bin"))
    return [out, len(files), sum("gradient_shard" in f.name for f in files)]


def _assert_bitwise(results) -> None:
    for per_optimizer, files, grad_files in results:
        for device, *disks in per_optimizer:
            for disk in disks:
                assert device[0] == disk[0], (device[0], disk[0])
                for name, want in device[1].items():
                    assert torch.equal(disk[1][name], want), name
        assert files > 0 and grad_files > 0


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_adamw_with_state_shard_and_gradient_on_disk_matches_device_bitwise_with_accumulation(
        tmp_path, world_size):
    _assert_bitwise(run_distributed(same_with_and_without_disk, world_size, str(tmp_path), ("adamw_foreach",),
                                    None, (True,)))


def test_hsdp_2x2_with_state_shard_and_gradient_on_disk_matches_device_bitwise_with_accumulation(tmp_path):
    _assert_bitwise(run_distributed(same_with_and_without_disk, 4, str(tmp_path), ("adamw_foreach",), (2, 2),
                                    (True,)))


def test_stock_optimizers_with_state_on_disk_match_device_bitwise(tmp_path):
    _assert_bitwise(run_distributed(same_with_and_without_disk, 3, str(tmp_path),
                                    ("adam_loop", "sgd_momentum")))


def checkpoint_through_the_tier(rank: int, world_size: int, root: str, save_offloaded: bool) -> list:
    """Train, save with one tier, load into a model with the other, train on: as one run without offload."""
    import perparam.checkpoint as ckpt

    disk = OffloadPolicy("disk", "all", path=root)
    model = _build(world_size, disk if save_offloaded else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = _train(rank, world_size, model, opt, steps=2)
    ckpt.save(os.path.join(root, "ckpt"), model, opt)
    saved = _full(model)
    model = _build(world_size, None if save_offloaded else disk)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt.load(os.path.join(root, "ckpt"), model, opt)
    resumed = first + _train(rank, world_size, model, opt, steps=2, start=2)
    ref = _build(world_size, None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    return [resumed, _full(model), _train(rank, world_size, ref, ref_opt, steps=4), _full(ref), saved]


def checkpoint_both_ways(rank: int, world_size: int, root: str) -> list:
    return [checkpoint_through_the_tier(rank, world_size, os.path.join(root, str(saved)), saved)
            for saved in (True, False)]


def load_on_another_world_size(rank: int, world_size: int, path: str, offloaded: bool) -> dict:
    import perparam.checkpoint as ckpt

    model = _build(world_size,
                   OffloadPolicy("disk", "all", path=os.path.dirname(path)) if offloaded else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(rank, world_size, model, opt, steps=1)  # the optimizer has state (in files) to be replaced
    ckpt.load(path, model, opt)
    return _full(model)


def test_checkpoint_saved_with_disk_tier_loads_bit_exact_without_and_back(tmp_path):
    for per_rank in run_distributed(checkpoint_both_ways, 3, str(tmp_path)):
        for losses, params, want_losses, want_params, _ in per_rank:
            assert losses == want_losses
            for name, want in want_params.items():
                assert torch.equal(params[name], want), name
    saved = per_rank[0][4]  # saved with everything on disk on 3 ranks: loaded on 2 ranks, on disk there too
    for params in run_distributed(load_on_another_world_size, 2, str(tmp_path / "True" / "ckpt"), True):
        for name, want in saved.items():
            assert torch.equal(params[name], want), name


def _step(rank: int, world_size: int, model, opt, index: int) -> tuple[float, str]:
    """Forward, backward and step on batch ``index``; an ``OffloadError`` from the step is returned, and
    the step retried (the gradients are still there)."""
    x, y = (local_slice(t, rank, world_size) for t in make_batches(index + 1, 8)[index])
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    message = ""
    try:
        opt.step()
    except OffloadError as e:
        message = str(e)
        opt.step()
    opt.zero_grad()
    return loss.item(), message


def write_back_fails_then_recovers(rank: int, world_size: int, root: str, where: str) -> list:
    """ENOSPC injected where ``where`` says ("write": step 1's write-backs; "reserve": making step 0's
    files); the error names parameter and file, and no state is lost: 4 steps match a run without offload."""
    model = _build(world_size, OffloadPolicy("disk", "optimizer", path=root))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    losses, messages = [], []
    for index in range(4):
        if where == "reserve" and index == 0:
            original, os.posix_fallocate = os.posix_fallocate, full
            x, y = (local_slice(t, rank, world_size) for t in make_batches(1, 8)[0])
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            try:
                opt.step()  # the step runs; moving its new state into files fails in the post-hook
            except OffloadError as e:
                messages.append(str(e))
            opt.zero_grad()
            os.posix_fallocate = original
            losses.append(loss.item())
            continue
        if where == "write" and index == 1:
            original, mapped._write_back = mapped._write_back, full
        loss, message = _step(rank, world_size, model, opt, index)
        for lane in (mapped.SHARD_LANE, mapped.STATE_LANE):  # the I/O threads' queues done (each in order)
            mapped.executor(lane).submit(lambda: None).result()
        if where == "write" and index == 1:
            mapped._write_back = original  # the failed write-backs surface at the next step's pre-hook
        losses.append(loss)
        messages.append(message)
    ref = _build(world_size, None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    return ["".join(messages), losses, _full(model), _train(rank, world_size, ref, ref_opt, steps=4),
            _full(ref)]


def disk_full_both_ways(rank: int, world_size: int, root: str) -> list:
    return [write_back_fails_then_recovers(rank, world_size, root, where) for where in ("write", "reserve")]


def test_disk_full_names_parameter_and_file_and_loses_no_state(tmp_path):
    for message, losses, params, want_losses, want_params in sum(run_distributed(disk_full_both_ways, 2,
                                                                                 str(tmp_path)), []):
        assert "No space left on device" in message and str(tmp_path) in message, message
        assert re.search(r"'[\w.]+' of (Block|TinyNet) optimizer state", message), message
        assert "kept in memory" in message
        assert losses == want_losses
        for name, want in want_params.items():
            assert torch.equal(params[name], want), name


def refused(rank: int, world_size: int, policies: list) -> list:
    out = []
    for policy in policies:
        model = TinyNet()
        before = dict(model.named_parameters())
        try:
            if isinstance(policy, dict):
                fully_shard(model, param_policy=policy)
            else:
                fully_shard(model, offload_policy=policy)
            out.append(["", False])
        except ShardingError as e:
            out.append([str(e), all(p is before[n] for n, p in model.named_parameters())])
    return out


def test_bad_offload_input_is_refused_at_fully_shard_naming_parameter_and_path(tmp_path):
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    path = str(not_a_dir / "offload")
    frozen = {"head.*": ParamPolicy(requires_grad=False, offload=OffloadPolicy("disk", path=str(tmp_path)))}
    [[unwritable, no_folder, frozen]] = run_distributed(refused, 1,
                                                        [OffloadPolicy("disk", path=path), "disk", frozen])
    assert ("'embed.weight'" in unwritable[0] and path in unwritable[0]
            and "writable directory" in unwritable[0])
    assert "names no folder" in no_folder[0]
    assert "'head.weight'" in frozen[0] and "frozen" in frozen[0]
    assert all(unchanged for _, unchanged in (unwritable, no_folder, frozen))


@pytest.mark.fast
def test_tiers_a_cuda_mesh_cannot_have_are_refused_naming_what_to_use_instead():
    from perparam.offload import tier
    from perparam.sharding.policy import MixedPrecisionPolicy, resolve

    for offload in (OffloadPolicy("disk", "optimizer", path="/tmp"),
                    OffloadPolicy("disk", "all", path="/tmp"), OffloadPolicy("cpu", "all")):
        policy = resolve("fc.weight", nn.Parameter(torch.zeros(2, 2)), MixedPrecisionPolicy(), None, 2,
                         offload)
        with pytest.raises(OffloadError) as e:
            tier.check([("fc.weight", policy, 16)], "cuda", "Net")
        assert ("'fc.weight' of Net" in str(e.value)
                and "use OffloadPolicy('cpu', 'optimizer')" in str(e.value))


def cpu_tier_on_a_cpu_mesh(rank: int, world_size: int) -> list:
    from torch.distributed.fsdp import CPUOffloadPolicy

    out = []
    for policy in (CPUOffloadPolicy(pin_memory=False), OffloadPolicy("cpu")):
        model = TinyNet()
        fully_shard(model, offload_policy=policy)
        out.append({sp.policy.offload for sp in perparam.module.group_of(model).params})
    return [out, perparam.offload.offloaded_bytes()]


def test_cpu_tier_and_fsdp2_cpu_offload_policy_are_accepted_on_a_cpu_mesh_as_the_same_memory():
    [(tiers, offloaded)] = run_distributed(cpu_tier_on_a_cpu_mesh, 1)
    assert tiers == [{OffloadPolicy("cpu", "all", pin_memory=False)}, {OffloadPolicy("cpu")}]
    assert offloaded == {}  # nothing moved: on a CPU run host memory is the device memory


def test_stale_scratch_folders_are_removed_at_start_and_live_ones_kept(tmp_path):
    stale = tmp_path / f"{PREFIX}999999-dead"
    stale.mkdir()
    (stale / ".lock").write_text("")
    (stale / "000001-x.bin").write_bytes(b"0" * 10)
    live = Scratch(tmp_path)
    assert not stale.exists() and live.dir.exists()
    assert clean_stale(tmp_path) == [] and live.dir.exists()  # its lock is held
    live.remove()
    assert not live.dir.exists()


def test_a_process_removes_its_scratch_folder_when_it_exits(tmp_path):
    # scratch.py imports the standard library only: a bare interpreter starts in milliseconds
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('s', sys.argv[1]); "
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
            "print(m.Scratch(sys.argv[2]).dir)")
    script = Path(perparam.__file__).parent / "offload" / "scratch.py"
    made = subprocess.run([sys.executable, "-c", code, str(script), str(tmp_path)], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert made.startswith(str(tmp_path)) and list(tmp_path.iterdir()) == []




def _rss_anon() -> int:
    """This process's resident anonymous memory, bytes (``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def rss_in_training(rank: int, world_size: int, root: str, state: str | None) -> list[int]:
    """[RssAnon after two steps, RssAnon between step 2's backward and its step (evictions done, glibc's
    free blocks given back in every variant), bytes the tier was to take off after the step, and between
    backward and step (the gradient shards too, with "all")]: 4 x Linear(1024, 1024), fp32, AdamW (34 MB
    of state; 17 MB of shards; 17 MB of gradients)."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(4)))
    offload = OffloadPolicy("disk", state, path=root) if state else None
    for layer in model:
        fully_shard(layer, offload_policy=offload)
    fully_shard(model, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(4, 1024)
    for _ in range(2):
        model(x).square().mean().backward()
        perparam.offload.flush()
        perparam.offload.trim_heap()
        before_step = _rss_anon()
        opt.step()
        opt.zero_grad()
    perparam.offload.flush()
    perparam.offload.trim_heap()
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    planned = 2 * local + (local if state == "all" else 0)
    return [_rss_anon(), before_step, planned, planned + (local if state == "all" else 0)]


def test_rss_anon_falls_by_the_offloaded_bytes_within_5_percent(tmp_path):
    [(device, device_backward, _, _)] = run_distributed(rss_in_training, 1, str(tmp_path), None)
    for state in ("optimizer", "all"):
        [(offloaded, backward, planned, planned_backward)] = run_distributed(rss_in_training, 1,
                                                                             str(tmp_path), state)
        assert abs((device - offloaded) - planned) <= 0.05 * planned, (state, device - offloaded, planned)
        fell = device_backward - backward  # the gradient shards are in the tier too with "all"
        assert abs(fell - planned_backward) <= 0.05 * planned_backward, (state, fell, planned_backward)


def test_state_dict_of_an_optimizer_with_host_offloaded_state_brings_the_state_in_first(monkeypatch):
    # the cpu tier's state (a HostSlot, on device meshes) has no device storage between steps: the optimizer's
    # state_dict() must fetch it before handing it out. Here a HostSlot over a CPU tensor stands in
    from types import SimpleNamespace

    from perparam.offload import tier
    from perparam.offload.host import HostSlot

    weight = nn.Parameter(torch.ones(3))
    slot = HostSlot("w exp_avg", torch.zeros(3), pin=False)
    po = SimpleNamespace(state_slots={"exp_avg": slot}, slots=lambda: [])
    owner = SimpleNamespace(sharded=weight, offload=po)
    monkeypatch.setattr(tier, "_OWNERS", [owner])
    monkeypatch.setattr(tier, "_read_ahead", lambda po: None)
    brought = []
    monkeypatch.setattr(tier, "bring_in", lambda opt: brought.append(opt))
    opt = torch.optim.SGD([weight], lr=0.1)
    tier._pre_step(opt, (), {})
    tier._pre_step(opt, (), {})  # hooked once
    opt.state_dict()
    assert brought == [opt]
    plain = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    tier._pre_step(plain, (), {})
    plain.state_dict()
    assert brought == [opt]  # an optimizer without host-offloaded state is left alone


def test_an_offload_group_made_after_one_is_freed_never_takes_its_key():
    """The tier's forward order (which group's shards to read ahead next) names groups by key. ``id()`` of
    a freed group is handed to the next object of its size (CPython reuses the memory at once), so a new
    model's group would read ahead by the freed model's order; the key is issued by a counter."""
    from perparam.offload import tier

    keys = set()
    for _ in range(20):
        group = tier._Group()  # made and freed, as a model's groups are when it is deleted
        keys.add(group.key)
        del group
    assert len(keys) == 20
