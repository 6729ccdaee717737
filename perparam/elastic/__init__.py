"""Fault tolerance: what keeps a run going when a rank dies or stops. In-memory snapshots of every rank's
shards after each step, a replica on the next node, and restore onto any number of ranks after torch's
elastic agent restarts the workers (docs/fault-tolerance.md); ``StepWatchdog``: a stopped or hung rank found
within a bound.

``State(model, optimizers, scheduler=None, **user_state)``: ``state.commit()`` after each step,
``step = state.restore()`` at start; ``init_process_group`` for workers the agent restarts.
``SnapshotError``: what cannot be snapshotted or restored.
"""

from perparam.session import init_process_group  # re-exported: where elastic users look

from .errors import SnapshotError
from .state import State
from .watchdog import StepWatchdog

__all__ = ["SnapshotError", "State", "StepWatchdog", "init_process_group"]
