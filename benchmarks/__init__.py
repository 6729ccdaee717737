"""perparam's benchmarks, run from the repository root as ``python -m benchmarks.<name>``
(``benchmarks/README.md``).

The scripts at this level are the benchmarks; what they share is in ``benchmarks/harness/`` and the prepared
check for one CUDA GPU in ``benchmarks/gpu/``. A script imports the harness only, the GPU check imports the
harness and itself, the harness imports only itself (``tests/test_layers.py``)."""
