"""The hierarchical algorithm on a faked ragged placement (PSRT_HOSTS): 3 + 2 + 1 ranks on
three hosts, interleaved, and a 2 x 2 sub-communicator, every op and dtype against the MPI
library's result (tests/mpi/ranks/hierarchical.py); 'auto' picks it on several hosts."""
import pytest

pytestmark = pytest.mark.mpi


def test_hierarchical_ragged_equals_native(run_ranks):
    run = run_ranks(6, "hierarchical.py", timeout=300, env={"PSRT_HOSTS": "0,1,0,2,0,1"}).check()
    records = {r["rank"]: r for r in run.records()}
    assert sorted(records) == list(range(6))
    for rank, rec in records.items():
        assert rec["failures"] == [], f"rank {rank}: {rec['failures']}"
        assert rec["placement"] == [0, 1, 0, 2, 0, 1]
        # world.local_comm follows the faked hosts too
        assert rec["local_size"] == [3, 2, 3, 1, 3, 2][rank]
        assert set(rec["auto"].values()) == {"hierarchical"}, rec["auto"]
        if rank in (0, 1, 2, 5):
            assert rec["sub_placement"] == [0, 1, 0, 1]
            assert rec["ran"]["reductions"] == 2 * 280
        else:
            assert rec["ran"]["reductions"] == 280
