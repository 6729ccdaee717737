"""The ways bytes move, as objects at the group's two seams.

An all-gather (``gather.GatherPath``: ``start`` / ``finish`` / ``pool_bytes``) runs as packed rows
(``gather_rows.PackedRows``), rows with quantized pieces (``QuantizedPieces``), a custom all-gather
(``CustomGather``), hpZ's secondary gather (``gather_hpz.HpzSecondary``) or the zero-copy sends into the
unsharded buffers (``gather_zero_copy.ZeroCopyGather``). A reduction (``reduce.ReducePath``: ``issue`` /
``pool_bytes``) runs as a packed reduce-scatter (``reduce_packed.PackedReduceScatter``), a custom one
(``CustomReduceScatter``), the zero-copy one (``reduce_zero_copy.ZeroCopyReduceScatter``), qgZ's all-to-all
(``reduce_qgz.QgzAllToAll``), the whole-gradient all-reduce (``reduce_whole.WholeAllReduce``), the K-invariant
tree (``reduce_invariant``) or the reduction of owner parameters' gradients to their owners
(``reduce_owner.ReduceToOwner``).

``choose.gather_path`` and ``choose.reduce_path`` are the only places a path is picked: each walks its
table of ``(rule, path)`` rows (``GATHER_RULES``, ``REDUCE_RULES``), first match wins, over the facts of one
set of parameters (what is fixed at ``fully_shard``, kept in the group's plans) and of the moment (settings,
devices). A new path is one file (its mechanism inside: nothing of it lives elsewhere) plus one row of a
table (``choose.Rules.add`` adds one from outside). What a path never does: choose the members of
an all-gather (the ZeRO stages, ``MeshPart._gather_members``) or finish a reduction (HSDP all-reduce,
partial hold, all-reduce hook, division, accumulation: ``MeshPart._advance``); those are the group's, once.

A path object holds no state of a group (one instance serves every group): it is handed the mesh part
(``perparam.runtime.part.MeshPart``, not imported here: the part imports the paths).
"""
