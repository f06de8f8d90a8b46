"""Rank side of tests/mpi/test_grid.py: every factorisation of the world into dp x pp x tp.

For each, a rank reports its coordinates, the world ranks in each of its axis
communicators (in axis-rank order), its pipeline neighbours, and the sum of the world
ranks over each axis computed by the axis's psrt Communicator; the test recomputes all of
it from the layout formula; with every expert-parallel degree that divides dp, the ranks of
its ep and edp groups.  One PSRT-RESULT line per factorisation (and ep) and rank, and one
with the errors of layouts that do not fit.
"""
import json

import torch

import psrt
from psrt.errors import PsrtError
from psrt.grid import Grid
from psrt.trace import Tracer


def factorisations(n):
    return [(d, p, n // (d * p)) for d in range(1, n + 1) for p in range(1, n + 1)
            if n % (d * p) == 0]


def main():
    world = psrt.init()
    for dp, pp, tp in factorisations(world.size):
        g = Grid(dp, pp, tp, world.comm)
        me = torch.tensor([float(g.rank)])
        rec = {"rank": world.rank, "degrees": [dp, pp, tp], "grid_rank": g.rank,
               "coords": list(g.coords), "ranks": [g.dp_rank, g.pp_rank, g.tp_rank],
               "members": {a: getattr(g, a + "_comm").allgather(g.rank) for a in ("dp", "pp", "tp")},
               "sums": {a: getattr(g, a + "_group").allreduce(me).item() for a in ("dp", "pp", "tp")},
               "pp_prev": g.pp_prev, "pp_next": g.pp_next,
               "first": g.is_first_stage, "last": g.is_last_stage}
        # The neighbours really are the neighbours: shift world ranks along the pipeline.
        got = g.pp_comm.sendrecv(g.rank, dest=g.pp_next, source=g.pp_prev)
        rec["from_prev"] = got
        print("PSRT-RESULT " + json.dumps(rec), flush=True)
        g.free()
        # expert parallelism at every degree that divides dp: who shares experts, who replicates them
        for ep in (e for e in range(2, dp + 1) if dp % e == 0):
            g = Grid(dp, pp, tp, world.comm, ep=ep)
            print("PSRT-RESULT " + json.dumps({
                "rank": world.rank, "ep_degrees": [dp, pp, tp, ep], "ep_rank": g.ep_rank,
                "ep": g.ep_comm.allgather(g.rank), "edp": g.edp_comm.allgather(g.rank),
                "ep_sum": g.ep_group.allreduce(me).item()}), flush=True)
            g.free()
    rec = {"rank": world.rank}
    for key, make in (("mismatch", lambda: Grid(2, 2, 2, world.comm)),
                      ("build", lambda: Grid.build(world.comm, pp=3))):
        try:
            make()
            rec[key] = None
        except PsrtError as err:
            rec[key] = str(err)
    tracer = Tracer()
    g = Grid.build(world.comm, tp=2, tracer=tracer)
    rec["inferred"] = [g.dp, g.pp, g.tp]
    # every axis's Communicator records into the grid's tracer: one all-reduce on each
    for axis in ("dp", "pp", "tp", "ep", "edp"):
        getattr(g, axis + "_group").allreduce(torch.ones(3), algorithm="ring")
    rec["traced"] = [(name, args["bytes"]) for name, _, _, _, _, args in tracer.events]
    g.free()
    print("PSRT-RESULT " + json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
