"""Which function implements each (collective, algorithm): the table behind the names of
algorithms.py (a test keeps the two the same).

Every function has one signature per collective, working in place on a flat buffer:
allreduce `fn(comm, buf, op)`, reduce_scatter `fn(comm, buf, elems, op)`, allgather
`fn(comm, buf, elems)`, broadcast `fn(comm, buf, root)`, reduce `fn(comm, buf, root, op)`,
alltoallv `fn(comm, send, send_elems, recv, recv_elems)`.
"""
from __future__ import annotations

from psrt.collectives import alltoall, hierarchical, native, nccl, ps, recursive, ring, torch_backend, tree
from psrt.collectives.layout import even_counts

ALLREDUCE = {
    "ring": lambda c, b, op, src=None: ring.allreduce(c, b, op, even_counts(b.numel(), c.size), src=src),
    "doubling": recursive.allreduce_doubling,
    "halving-doubling": recursive.allreduce_halving_doubling,
    "tree": tree.allreduce,
    "ps": ps.allreduce,
    "hierarchical": hierarchical.allreduce,
    "native": native.allreduce,
    "torch": torch_backend.allreduce,
    "nccl": nccl.allreduce,
}
REDUCE_SCATTER = {"ring": ring.reduce_scatter, "ps": ps.reduce_scatter,
                  "hierarchical": hierarchical.reduce_scatter, "native": native.reduce_scatter, "torch": torch_backend.reduce_scatter,
                  "nccl": nccl.reduce_scatter}
ALLGATHER = {"ring": ring.allgather, "ps": ps.allgather, "hierarchical": hierarchical.allgather,
             "native": native.allgather,
             "torch": torch_backend.allgather, "nccl": nccl.allgather}
BROADCAST = {"tree": tree.broadcast, "ps": ps.broadcast, "hierarchical": hierarchical.broadcast,
             "native": native.broadcast,
             "torch": torch_backend.broadcast, "nccl": nccl.broadcast}
REDUCE = {"tree": tree.reduce, "ps": ps.reduce, "native": native.reduce,
          "torch": torch_backend.reduce, "nccl": nccl.reduce}
ALLTOALLV = {"pairwise": alltoall.pairwise, "native": native.alltoallv}

# allreduce algorithms that can read their input from a separate source tensor
READS_SOURCE = frozenset({"ring"})

IMPLEMENTATIONS = {"allreduce": ALLREDUCE, "reduce_scatter": REDUCE_SCATTER, "allgather": ALLGATHER,
                   "broadcast": BROADCAST, "reduce": REDUCE, "alltoallv": ALLTOALLV}
