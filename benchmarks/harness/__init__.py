"""What the benchmarks share: the model (``model.py``), the configurations (``configs.py``), what a rank runs
(``runner.py``), starting ranks and the A/B arguments (``launch.py``, ``ports.py``), measuring (``memory.py``,
``comm.py``, ``host_syncs.py``, ``step_categories.py``), the formulas figures are set against (``fits.py``,
``zero_formulas.py``) and the summary (``report.py``)."""
