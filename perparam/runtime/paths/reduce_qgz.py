"""qgZ's low-precision reduce-scatter path (``perparam.runtime.grad_quant``): the K rows encoded, one
all-to-all, decoded and summed in rank order."""

from __future__ import annotations

from ...sharding.grad_quant import grad_wire
from .. import grad_quant
from ..reduction import PendingReduce


class QgzAllToAll:
    name = "qgZ all-to-all"

    def issue(self, part, params, grads, used, dtype, plan) -> PendingReduce:
        if part.call.reduce_scatter_comm is not None:  # set_custom_reduce_scatter checks it too
            raise RuntimeError(f"perparam: {part._what} has a custom reduce-scatter and grad_quant parameters "
                               f"({', '.join(p.fqn for p in params)}); drop one of the two")
        return grad_quant.issue(part, params, grads, used, dtype, plan.wire)

    def pool_bytes(self, part, params, dtype, wire) -> int:
        """An upper bound: the encoded send rows and the rows received (``[K, row_bytes]`` each), the fp32
        ``[K, total]`` scratch and the packed ``[K, n]`` input the encoding may need first."""
        k = part.num_shards
        gw = grad_wire([p.layout.padded_local_numel for p in params], wire)
        packed = k * sum(gw.numels) * dtype.itemsize
        return 2 * k * gw.row_bytes + k * gw.total * 4 + packed


QGZ = QgzAllToAll()
