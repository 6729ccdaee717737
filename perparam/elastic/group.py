"""``init_process_group`` for a worker that torch's elastic agent may restart.

Under ``torchrun`` the workers of every attempt share the agent's TCPStore (``TORCHELASTIC_USE_AGENT_STORE``),
and the keys an attempt wrote stay there: a restarted rank that comes up before its peers reads the previous
attempt's gloo addresses and fails with ``Gloo connectFullMesh failed ... Connection refused`` (measured:
torch 2.13, ``torchrun --standalone --max-restarts 1``, one rank 5 s slower to start than the other: the
restart fails every time; with the store prefixed by the attempt number it succeeds). This one prefixes it.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist


def init_process_group(backend: str = "gloo", **kwargs) -> None:
    """``torch.distributed.init_process_group(backend, **kwargs)``; under torch's elastic agent (and without
    ``store``/``init_method`` given) on the agent's store under a prefix of its own per restart
    (``TORCHELASTIC_RESTART_COUNT``), so no attempt reads another's keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "store" not in kwargs and "init_method" not in kwargs:
        timeout = kwargs.get("timeout") or timedelta(minutes=5)
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        kwargs.update(store=dist.PrefixStore(f"perparam/attempt-{attempt}", store), rank=int(os.environ["RANK"]),
                      world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, **kwargs)
