"""``perparam.hf_trainer``: the documented path of ``perparam.hf.trainer`` (``ShardedTrainer``). Imports
transformers."""

from .hf.trainer import IN_BACKWARD, SCHEDULER_NAME, STATE_DIR, ShardedTrainer

__all__ = ["IN_BACKWARD", "SCHEDULER_NAME", "STATE_DIR", "ShardedTrainer"]
