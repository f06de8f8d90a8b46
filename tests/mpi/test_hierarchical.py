"""The hierarchical algorithm on a faked ragged placement (PSRT_HOSTS): 3 + 2 + 1 ranks on
three hosts, interleaved, and a 2 x 2 sub-communicator, every op and dtype against the MPI
library's result (tests/mpi/ranks/hierarchical.py); 'auto' picks it on several hosts."""
import json
import os

import pytest
import torch

from psrt.collectives import ALGORITHMS
from psrt.collectives.tuning import Tuning

pytestmark = pytest.mark.mpi


def test_hierarchical_ragged_equals_native(run_ranks):
    run = run_ranks(6, "hierarchical.py", timeout=300, env={"PSRT_HOSTS": "0,1,0,2,0,1"}).check()
    records = {r["rank"]: r for r in run.records()}
    assert sorted(records) == list(range(6))
    tiny = Tuning.load().choose("allreduce", 8, 6, ALGORITHMS["allreduce"], (3, 2, 1), host_of=[0, 1, 0, 2, 0, 1],
                                crowd=max(1.0, 6 / (os.cpu_count() or 1)))
    for rank, rec in records.items():
        assert rec["failures"] == [], f"rank {rank}: {rec['failures']}"
        assert rec["placement"] == [0, 1, 0, 2, 0, 1]
        # world.local_comm follows the faked hosts too
        assert rec["local_size"] == [3, 2, 3, 1, 3, 2][rank]
        # auto: hierarchical where bytes count; for 8 bytes the two-level model's pick for
        # 6 ranks crowding this machine's cores (ps where they outnumber them enough)
        assert rec["auto"]["1048576"] == rec["auto"]["16777216"] == "hierarchical", rec["auto"]
        assert rec["auto"]["8"] == tiny, rec["auto"]
        if rank in (0, 1, 2, 5):
            assert rec["sub_placement"] == [0, 1, 0, 1]
            assert rec["ran"]["reductions"] == 2 * 286
        else:
            assert rec["ran"]["reductions"] == 286


def _train(run_ranks, tmp_path, name, *flags):
    save, metrics = tmp_path / f"{name}.pt", tmp_path / f"{name}.jsonl"
    run_ranks(4, "-m", "psrt.train", "--dp", "ps", "--steps", "3", "--seed", "3", "--quiet",
              "--save", str(save), "--metrics", str(metrics), *flags, timeout=300,
              env={"PSRT_HOSTS": "0,1,0,1"}).check()
    summary = [json.loads(line) for line in metrics.read_text().splitlines() if '"summary"' in line][-1]
    return torch.load(save, weights_only=True), summary


def test_ps_local_aggregation_trains_alike_and_unloads_the_server(run_ranks, tmp_path):
    """2 faked hosts of 2 ranks: the host sums first, so the server sends to 1 remote rank
    instead of 3, and the parameters equal the flat server's within rounding."""
    flat, flat_sum = _train(run_ranks, tmp_path, "flat")
    local, local_sum = _train(run_ranks, tmp_path, "local", "--local-aggregation")
    for key, value in flat.items():
        assert torch.allclose(value, local[key], rtol=1e-5, atol=1e-6), key
    assert local_sum["bytes_max_rank"] * 2 < flat_sum["bytes_max_rank"], (local_sum, flat_sum)
