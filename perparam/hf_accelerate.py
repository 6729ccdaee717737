"""``perparam.hf_accelerate``: the documented path of ``perparam.hf.accelerator`` (``ShardedAccelerator``,
``as_fsdp2_module``). Imports accelerate."""

from .hf.accelerator import STATE_DIR, ShardedAccelerator, as_fsdp2_module

__all__ = ["STATE_DIR", "ShardedAccelerator", "as_fsdp2_module"]
