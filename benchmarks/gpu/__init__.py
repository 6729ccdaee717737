"""The prepared check for one CUDA GPU: ``python -m benchmarks.gpu.check`` (``check.py``) runs the sections of
``sections.py``, ``simulated.py``, ``two_ranks.py`` and ``accelerate.py``."""
