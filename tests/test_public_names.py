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
                 "PolicyError", "ShardingError", "StoredDtypeChangeError", "CollectiveMismatchError", "CollectiveTimeoutError", "MetaParameterError",
                 "DeepcopyError",
                 "UnflattenableShardError"):
        error = getattr(perparam, name)
        assert issubclass(error, Exception) and name in perparam.__all__, name
