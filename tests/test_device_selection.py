"""Which device perparam's default mesh and ``clip_grad_norm_`` use follows the process group's backends
(``mesh.default_device_type``), not the exact backend string; ``distributed_session`` gives each process
its ``LOCAL_RANK`` GPU and creates NCCL's world communicator at init (``device_id``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import mesh
from mesh.dims import device_type_of_backends
from perparam.session import distributed_session
from tests.distributed import run_distributed

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("config, device", [
    ("nccl", "cuda"), ("cuda:nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda"), ("cuda:nccl,cpu:gloo", "cuda"),
    ("gloo", "cpu"), ("cpu:gloo", "cpu"), ("cpu:gloo,cuda:gloo", "cpu"), ("fake", "cpu"),
    ("cpu:fake,cuda:fake,hpu:fake,xpu:fake", "cpu"), ("threaded", "cpu"), ("xccl", "xpu")])
def test_the_device_type_is_the_first_accelerator_with_a_device_native_backend(config, device):
    assert device_type_of_backends(config) == device


def _in_a_world(rank: int, world_size: int) -> dict:
    got = {"gloo": mesh.default_device_type()}
    real = dist.get_backend_config
    dist.get_backend_config = lambda group=None: "cpu:gloo,cuda:nccl"
    try:
        got["mixed"] = mesh.default_device_type()
    finally:
        dist.get_backend_config = real
    return got


def test_a_cpu_gloo_cuda_nccl_world_shards_on_cuda_and_a_gloo_world_on_cpu():
    for got in run_distributed(_in_a_world, 2):
        assert got == {"gloo": "cpu", "mixed": "cuda"}


def test_distributed_session_sets_the_local_rank_gpu_and_creates_the_nccl_communicator_at_init(monkeypatch):
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: "init" in calls)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.setdefault("init", (backend, kw)))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.setdefault("destroyed", True))
    for name, value in (("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")):
        monkeypatch.setenv(name, value)
    with distributed_session():
        pass
    assert calls["set_device"] == torch.device("cuda", 1)
    assert calls["init"] == ("nccl", {"device_id": torch.device("cuda", 1)})
    assert calls["destroyed"]


def test_the_main_job_sets_the_local_rank_gpu_and_creates_the_nccl_communicator_at_init(monkeypatch):
    from perparam.finetune.train import setup_distributed

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set_device", d))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, **kw: calls.setdefault("init", (backend, kw)))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    monkeypatch.setattr(dist, "get_world_size", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert setup_distributed(30.0) == (3, 4, torch.device("cuda", 1))
    assert calls["set_device"] == torch.device("cuda", 1)
    backend, kwargs = calls["init"]
    assert backend == "nccl" and kwargs["device_id"] == torch.device("cuda", 1)


def test_serialised_cuda_streams_are_warned_about_on_a_device_mesh_only():
    from perparam.comm.process_groups import serialised_streams_warning

    message = serialised_streams_warning("cuda", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in message and "Unset" in message
    assert serialised_streams_warning("cuda", {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) is None
    assert serialised_streams_warning("cuda", {}) is None
    assert serialised_streams_warning("cpu", {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) is None
