"""The suite's goal rows are computed from the rows measured in the run: per-call cost over
the bare mpi4py floor (psrt/bench/floors.py) and tracing's overhead on the DDP step."""
from psrt.bench import suite, training
from psrt.bench.collectives import against_floors


def row(n: int, algorithm: str, nbytes: int, time_us: float) -> dict:
    return {"collective": "allreduce", "world_size": n, "algorithm": algorithm, "nbytes": nbytes,
            "time_us": time_us}


def per_call_rows() -> list[dict]:
    rows = []
    for nbytes in (4, 1024):
        for algo, psrt_us, floor_us in (("ring", 9.0, 6.0), ("tree", 5.0, 4.0)):
            rows += [row(2, algo, nbytes, psrt_us), row(2, f"mpi4py-{algo}", nbytes, floor_us),
                     row(2, f"{algo}+inplace", nbytes, psrt_us - 1), row(2, f"mpi4py-{algo}+inplace", nbytes, floor_us),
                     row(2, f"{algo}+async", nbytes, 30.0), row(2, f"mpi4py-{algo}+async", nbytes, 12.0)]
    rows.append(row(2, "ring+new", 4, 25.0))          # no floor called this way: not judged
    return rows


def test_per_call_goals_take_the_worst_ratio_to_the_floor_called_the_same_way():
    rows = per_call_rows()
    against_floors(rows)
    at = {(r["algorithm"], r["nbytes"]): r for r in rows}
    assert at[("ring", 4)]["vs_floor"] == 1.5 and at[("tree+inplace", 1024)]["vs_floor"] == 1.0
    assert at[("ring+async", 4)]["vs_floor"] == 2.5 and at[("ring+async", 4)]["vs_sync_floor"] == 5.0
    assert at[("ring+new", 4)]["vs_floor"] is None and "vs_floor" not in at[("mpi4py-ring", 4)]
    # persistent requests are an in-place call: the in-place floor is theirs
    extra = [row(2, "ring+persistent", 4, 9.0), row(2, "mpi4py-ring+inplace", 4, 6.0)]
    against_floors(extra)
    assert extra[0]["vs_floor"] == 1.5
    goals = suite.per_call_goals(rows)
    assert [(g.value, g.ok) for g in goals] == [
        ("worst 1.50x (ring, 4 B)", True),
        ("worst 1.33x (ring, 4 B)", True),
        ("worst 2.50x (ring, 4 B); 7.50x the blocking floor", False)]
    assert goals[0].text == ("N=2, into a held result: ring, halving-doubling, tree, ps within 2x of the "
                                "same schedule in bare mpi4py at 4 B and 1 KiB")
    assert "non-blocking" in goals[2].text
    text = suite.per_call_section(rows)
    assert "| 2 | ring | async | 30.0 / 12.0 (x2.50) | 30.0 / 12.0 (x2.50) |" in text


def test_tracing_overhead_is_a_goal_of_the_training_part():
    rows = [{"where": "one host", "ranks": 2, "dp": dp, "step_s": s}
            for dp, s in (("ring", 0.010), ("ring+trace", 0.0104), ("torch-ddp", 0.02))]
    goals = training.goals(rows)
    assert [(g.text, g.value, g.ok) for g in goals] == [
        ("one host, N=2: ring DDP step <= torch DDP (gloo) step", "2.00x", True),
        ("one host, N=2: ring DDP step with psrt.trace recording < 1.05x the step without", "1.040x", True)]
    rows[1]["step_s"] = 0.0106
    assert training.goals(rows)[1].ok is False
