"""``perparam.hf_entry``: the earlier path of ``perparam.hf.entry`` (``check_sharded``, ``sharded_roots``,
``deferred_reduction``). Imports neither transformers nor accelerate."""

from .hf.entry import check_sharded, deferred_reduction, sharded_roots

__all__ = ["check_sharded", "deferred_reduction", "sharded_roots"]
