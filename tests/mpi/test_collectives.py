"""Every collective, algorithm, op, dtype and size on 1-8 ranks, against a NumPy reference
and the MPI library's own result (see tests/mpi/ranks/collectives_matrix.py)."""
import pytest

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("np_", [1, 2, 3, 4, 5, 8])
def test_collectives_matrix(run_ranks, np_):
    extra = ["--torch"] if np_ in (2, 4) else []  # gloo set-up is slow; two sizes suffice
    if np_ >= 5:  # these sizes exercise the topology (folds, uneven rings), not every dtype
        extra += ["--dtypes", "float32,bfloat16,int64,uint8"]
    run = run_ranks(np_, "collectives_matrix.py", *extra, timeout=900).check()
    records = run.records()
    assert sorted(r["rank"] for r in records) == list(range(np_))
    for rec in records:
        assert rec["failures"] == [], f"rank {rec['rank']}: {rec['failures']}"
        # guard against a matrix that silently shrank: every collective ran many cases
        assert rec["ran"]["allreduce"] >= 400 and rec["ran"]["reduce_scatter"] >= 250
        assert rec["ran"]["allgather"] >= 100 and rec["ran"]["nonblocking"] >= 30
        for name in ("broadcast", "reduce", "gather", "scatter", "alltoall", "inplace",
                     "noncontiguous", "barrier", "float-rounding"):
            assert rec["ran"].get(name, 0) > 0, name


@pytest.mark.parametrize("np_, segment", [(2, None), (3, "256"), (5, None)])
def test_every_ready_call_is_exact(run_ranks, np_, segment):
    """The small-message path's ready calls, every algorithm, op and way of calling, and the
    torch path, equal an exact reference (tests/mpi/ranks/ready_calls.py); at N = 3 with
    ring chunks cut into segments of 256 bytes.  In the same launch: which entry of the
    all-reduce table ran each kind of call, that an entry a program puts first runs, and
    the staged path of CUDA all-reduces and of every other collective on the CPU with copies
    that run late.  Both paths run each algorithm's one
    schedule (psrt/collectives/schedule.py); the matrix above checks each against the NumPy
    reference and the MPI library on odd and even rank counts, in dtypes of both paths."""
    env = {"PSRT_RING_SEGMENT": segment} if segment else None
    run = run_ranks(np_, "ready_calls.py", timeout=240, env=env).check()
    records = run.records()
    assert len(records) == np_
    for rec in records:
        assert rec["failures"] == [], rec
        # algorithms x cases x (2 communicators x 3 repeats x 4 ways of calling + the torch path)
        # + the staged path, reduced on the host and on the device: algorithms x sizes x
        # (float32, bfloat16: 3 ops; int64: 2)
        assert rec["checked"] == 5 * (4 * 3 * 2 + 1) * (2 * 3 * 4 + 1) + 2 * 7 * 4 * (3 + 3 + 2)
        # the other collectives staged, per dtype: 4 reduce-scatter algorithms x ops x 2 ways,
        # 4 all-gathers, per root 4 broadcasts and 3 reduces x ops, 5 exchanges (float32 and
        # bfloat16 with 3 ops, int64 with 2)
        per_dtype = lambda ops: 4 * ops * 2 + 4 + np_ * (4 + 3 * ops) + 5  # noqa: E731
        assert rec["staged_calls"] == 2 * per_dtype(3) + per_dtype(2), rec
        # buffers reduced again were made ready in place (bounded: the oldest are let go)
        assert all(b > 0 for b in rec["bound"]), rec
        # the all-reduce table's entry of each kind of call, and one put first by the program
        assert rec["paths"] == ["make-ready", "ready", "small", "general", "make-ready", "native",
                                "counted", "counted"], rec
        assert rec["counted"] == 2 and rec["state"] == [8, "allreduce", None], rec


@pytest.mark.parametrize("np_", [1, 2, 3, 4, 5, 6, 7, 8])
def test_alltoallv_every_algorithm(run_ranks, np_):
    """Variable-size all-to-all, psrt's pairwise exchange and the MPI library's, on 1-8 ranks
    (tests/mpi/ranks/alltoallv.py); given counts cost no exchange but on checked calls, where
    disagreeing, mixed or malformed counts are one error naming the ranks."""
    records = run_ranks(np_, "alltoallv.py", timeout=240).check().records()
    assert len(records) == np_
    last = np_ - 1
    for rec in records:
        assert rec["failures"] == [], rec
        # 3 calls: every call agrees on its fingerprint (cheap) or gathers its signature (all);
        # the counts are gathered on the checked calls (the first under cheap), nothing else
        assert rec["meta_calls"] == {"all": 6, "cheap": 4, "off": 0}, rec
        if np_ == 1:
            continue
        errors = rec["errors"]
        assert errors["pairs"].startswith(f"alltoallv: counts disagree between ranks (rank {last} sends 1 "
                                          "rows to rank 0, which expects 2"), rec
        assert errors["mixed"].startswith(f"collective call #2 does not match across ranks: ranks "
                                          f"{list(range(1, np_))} differ from rank 0"), rec
        assert "rank 0: alltoallv(algorithm=native, dtype=torch.float32, recv_counts=exchanged" in errors["mixed"]
        assert errors["length"] == (f"alltoallv: receive counts must be {np_} non-negative numbers on every "
                                    f"rank (rank 1: {[1] * (np_ + 1)})"), rec
        assert errors["negative"].endswith(f"(rank {last}: {[1] * (np_ - 1) + [-1]})"), rec
        assert all("\n" not in e for e in errors.values())


@pytest.mark.parametrize("case", ["negative", "mixed"])
def test_alltoallv_unchecked_bad_counts_end_the_job(run_ranks, case):
    """With PSRT_CHECK=off nothing is gathered: negative counts on one rank are still one
    line and the end of the job, and a rank leaving its counts to be exchanged while the
    other gives them is named by the watchdog instead of hanging."""
    code = ("import torch, psrt\n"
            "from psrt.watchdog import Watchdog\n"
            "world = psrt.init()\n"
            "group = psrt.Communicator(world.comm)\n"
            "Watchdog(world, [group], timeout_s=2).start()\n"
            f"case = {case!r}\n"
            "bad = None if case == 'mixed' else [1, -1]\n"
            "group.alltoallv(torch.ones(2, 3), [1, 1], bad if world.rank == 1 else [1, 1])\n"
            "group.barrier()\n")
    run = run_ranks(2, "-c", code, timeout=120, env={"PSRT_CHECK": "off"})
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    if case == "negative":
        assert "[rank 1] psrt: error: alltoallv: receive counts [1, -1] must be 2 non-negative numbers" \
            in run.stderr, run.stderr[-3000:]
    else:
        assert "psrt: watchdog: no progress for 2 s" in run.stderr, run.stderr[-3000:]
        assert "rank 1 (" in run.stderr and "waiting in alltoallv call #1" in run.stderr, run.stderr[-3000:]
