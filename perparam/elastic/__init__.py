"""Fault tolerance: what keeps a run going when a rank dies or stops (``StepWatchdog``: a stopped or hung
rank found within a bound)."""

from .watchdog import StepWatchdog

__all__ = ["StepWatchdog"]
