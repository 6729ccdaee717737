"""The optimizer step on perparam's sharded parameters: one ``Binding`` per optimizer (``binding.py``), found
through one weak registry (``registry.py``), whose step hooks run the step's stages (``stages.py``) from one
ordered list and undo them in reverse. ``docs/whole-matrix-optimizers.md``, CONTRIBUTING ("a step stage")."""
