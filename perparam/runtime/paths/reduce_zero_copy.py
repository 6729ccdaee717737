"""The zero-copy reduce-scatter path (``perparam.runtime.zero_copy_reduce``): each rank's rows sent straight
from the unsharded gradients, one send and one receive per parameter and peer; no packed input."""

from __future__ import annotations

from ...sharding.layout import reduce_scatter_offsets
from .. import zero_copy_reduce
from ..reduction import PendingReduce


class ZeroCopyReduceScatter:
    name = "zero-copy reduce-scatter"

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        return zero_copy_reduce.issue(part, params, grads, used, dtype, plan)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        """No packed input; for K > 2 one ``[K, n]`` staging buffer of the peers' pieces."""
        k = part.num_shards
        return 0 if k == 2 else reduce_scatter_offsets([p.layout for p in params])[1] * dtype.itemsize * k


ZERO_COPY_REDUCE_SCATTER = ZeroCopyReduceScatter()
