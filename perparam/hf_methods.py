"""``perparam.hf_methods``: the earlier path of ``perparam.hf.methods`` (``guard``, ``TREE_CHANGES``).
Imports neither transformers nor peft."""

from .hf.methods import TREE_CHANGES, guard

__all__ = ["TREE_CHANGES", "guard"]
