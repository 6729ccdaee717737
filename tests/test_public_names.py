"""The documented import paths and error types stay where users find them, whatever folder the code is in."""

from __future__ import annotations

import importlib

import pytest

import perparam

pytestmark = pytest.mark.fast


def test_documented_module_paths_import():
    for name in ("perparam.quant", "perparam.checkpoint", "perparam.full_state", "perparam.memory",
                 "perparam.finetune", "perparam.api", "perparam.module"):
        importlib.import_module(name)
    from perparam.quant import get, names, register  # noqa: F401

    assert {"int8", "fp8", "nf4"} <= set(perparam.quant.names())
    assert perparam.quant.register is importlib.import_module("perparam.sharding.quant").register


def test_error_types_are_exported_from_the_package():
    from perparam.checkpoint import CheckpointError

    assert perparam.CheckpointError is CheckpointError
    for name in ("StateError", "TransformError", "ReplacedParameterError", "ReplacedAfterShardingError",
                 "PolicyError", "ShardingError", "StoredDtypeChangeError", "CollectiveMismatchError",
                 "CollectiveTimeoutError", "MetaParameterError", "DeepcopyError",
                 "UnflattenableShardError"):
        error = getattr(perparam, name)
        assert issubclass(error, Exception) and name in perparam.__all__, name


def test_the_checkpoint_family_keeps_its_public_paths():
    from perparam import checkpoint, errors, full_state

    for name in ("save", "load", "async_save", "wait_pending", "latest", "survey", "PendingSave", "MANIFEST",
                 "FORMAT", "full_state_dict", "load_full_state_dict", "CheckpointError",
                 "CheckpointDamagedError"):
        assert hasattr(checkpoint, name) and name in checkpoint.__all__, name
    assert (checkpoint.CheckpointError is full_state.CheckpointError is perparam.CheckpointError
            is errors.CheckpointError)
    assert issubclass(checkpoint.CheckpointDamagedError, checkpoint.CheckpointError)
    assert perparam.CheckpointDamagedError is checkpoint.CheckpointDamagedError
    assert checkpoint.full_state_dict is full_state.full_state_dict
