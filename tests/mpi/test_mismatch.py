"""Disagreeing collective calls become an error on every rank that names the ranks."""
import pytest

pytestmark = pytest.mark.mpi


def test_mismatches_are_reported_on_every_rank(run_ranks):
    run = run_ranks(3, "mismatch.py", timeout=120).check()
    records = run.records()
    assert len(records) == 3
    expect = {"shape": ("ranks [1]", "numel=5"), "dtype": ("ranks [2]", "torch.float64"),
              "op": ("ranks [1, 2]", "op=max"), "root": ("ranks [1]", "root=1"),
              "order": ("ranks [1]", "broadcast("), "allgather-row": ("ranks [1, 2]", "(2, 2)"),
              "later-call": ("ranks [1]", "numel=6")}
    for rec in records:
        for case, (who, what) in expect.items():
            res = rec["results"][case]
            assert res["raised"], f"rank {rec['rank']} case {case}: no error"
            assert who in res["message"] and what in res["message"], (case, res["message"])
            assert res["seconds"] < 1.0, (case, res["seconds"])


ALGORITHMS = ("native", "ring", "doubling", "halving-doubling", "tree", "ps")


def test_every_call_is_checked_under_the_default(run_ranks):
    """A divergence at call 1, 3 or 100 (4 and 4M floats), every algorithm, psrt.Communicator
    and torch.distributed's psrt backend, default PSRT_CHECK: every rank raises the same
    CollectiveMismatch naming both ranks' shapes, no call before it returned a wrong sum,
    and the communicator is still in step afterwards."""
    run = run_ranks(2, "mismatch_calls.py", "matrix", timeout=300).check()
    records = run.records()
    assert len(records) == 2
    for rec in records:
        res = rec["results"]
        expected = [f"communicator {a} call {k} {s}" for a in ALGORITHMS for k in (1, 3, 100)
                    for s in ("small", "4M") if k < 100 or s == "small" or a == "native"]
        expected += [f"c10d {a} call {k}" for a in ALGORITHMS
                     for k in ("1 small", "3 small", "3 4M", "100 small")]
        assert sorted(k for k in res if k != "after") == sorted(expected)
        for case in expected:
            got = res[case]
            assert got["raised"] == "CollectiveMismatch", (rec["rank"], case, got)
            assert got["wrong"] == 0, (rec["rank"], case, got)
            algo = case.split()[1]
            small = case.endswith("small")
            shapes = ("shape=(4,)", "shape=(5,)") if small else ("shape=(4194304,)", "shape=(4194305,)")
            msg = got["message"]
            assert all(s in msg for s in shapes) and f"algorithm={algo}" in msg, (case, msg)
            assert "ranks [1] differ from rank 0" in msg, (case, msg)
            assert got["seconds"] < 1.0, (case, got["seconds"])
        assert res["after"]["sum"] == [2.0, 2.0, 2.0]


def test_a_script_whose_third_call_diverges_ends_with_one_line(algorithm="native"):
    """A user's psrt.c10d script, 4M against 4M+1 floats at the third all_reduce, uncaught,
    under mpi_launch: one line naming both shapes, exit 2, no crash, no sum printed for the
    diverging step, nothing of MPI's abort notice."""
    import subprocess
    import sys
    from conftest import MPI_SCRIPTS, ROOT
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("PSRT_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([str(ROOT / "mpi_launch"), "-np", "2", sys.executable,
                           str(MPI_SCRIPTS / "mismatch_calls.py"), "script", algorithm],
                          capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "shape=(4194304,)" in lines[0] and "shape=(4194305,)" in lines[0], lines
    assert "step 2" not in proc.stdout and proc.stdout.count("step 1: sum 2.0") == 2, proc.stdout
