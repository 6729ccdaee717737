"""The runtime's leaf state: one ``TrainingState`` per group, with the transitions it may take.

A group moves through its states with asserted transitions (``ParamGroup.transition``)::

    IDLE --pre-forward--> FORWARD --post-forward--> IDLE          (one forward; nested calls stay FORWARD)
    IDLE --pre-backward (or a gradient arrives)--> PRE_BACKWARD    (backward has reached the group)
    PRE_BACKWARD --post-backward--> POST_BACKWARD                  (its backward is done on this rank)
    PRE_BACKWARD | POST_BACKWARD --final callback--> IDLE
    any --reset--> IDLE                                            (after an exception in flight)

A forward run inside backward (activation checkpointing recomputing a region) changes no state. What lives
for one iteration of a tree of groups is in ``perparam.runtime.context`` (``IterationContext``), above the
group.
"""

from __future__ import annotations

import enum
from types import MappingProxyType


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


ALLOWED = MappingProxyType({
    TrainingState.IDLE: frozenset({TrainingState.FORWARD, TrainingState.PRE_BACKWARD}),
    TrainingState.FORWARD: frozenset({TrainingState.IDLE}),
    TrainingState.PRE_BACKWARD: frozenset({TrainingState.POST_BACKWARD, TrainingState.IDLE}),
    TrainingState.POST_BACKWARD: frozenset({TrainingState.IDLE, TrainingState.PRE_BACKWARD}),
})


class StateError(RuntimeError):
    """An illegal state transition: a bug in perparam, or a use it does not support (named in the message)."""
