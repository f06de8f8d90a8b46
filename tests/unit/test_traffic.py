"""The per-step traffic model of the data-parallel strategies (psrt/dp/traffic.py) and the
prediction text under psrt.train's summary (psrt/train/prediction.py)."""
import pytest

from psrt.collectives.cost import Fit, link_load, predict_alltoall, wire_bytes
from psrt.dp import traffic
from psrt.train import prediction

LINK = Fit(alpha_s=20e-6, beta_s_per_byte=8e-9, r2=1.0)
M = 16 << 20


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_phase_moves_what_ring_allreduce_sends(n):
    (phase,) = traffic.phases("ring", n, M)
    assert phase.steps == 2 * (n - 1)
    for r in range(n):
        assert sum(b for s, _, b in phase.transfers if s == r) == pytest.approx(wire_bytes("allreduce", "ring", M, n, r))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ps_pushes_then_pulls_through_rank_0(n):
    push, pull = (p.transfers for p in traffic.phases("ps", n, M))
    assert sorted(d for _, d, _ in push) == [0] * (n - 1) and sorted(s for s, _, _ in pull) == [0] * (n - 1)
    assert sum(b for *_, b in push) == sum(b for *_, b in pull) == (n - 1) * M
    one_per_host = list(range(n))
    p = traffic.predict("ps", n, M, one_per_host, LINK)
    # the server's link carries (N-1) M in, then (N-1) M out: 2 (N-1) M beta + 2 alpha
    assert p.bandwidth_s == pytest.approx(2 * (n - 1) * M * LINK.beta_s_per_byte)
    assert p.latency_s == pytest.approx(2 * LINK.alpha_s)


def test_sharded_and_dedicated_layouts():
    # 4 shards co-located: each rank sends 3 x M/4 and receives 3 x M/4 in each phase
    push, pull = traffic.phases("ps-sharded", 4, M)
    assert link_load(push.transfers, [0, 1, 2, 3]) == pytest.approx(3 * M / 4)
    # a dedicated server (the last rank) serves 3 workers
    push = traffic.phases("ps", 4, M, servers=1)[0].transfers
    assert {d for _, d, _ in push} == {3} and len(push) == 3
    assert traffic.phases("horovod", 4, M)[0].steps == 6
    assert traffic.phases("ps-async", 3, M)[0].transfers == [(0, 2, M), (1, 2, M)]
    assert traffic.phases("own-strategy", 4, M) is None


def test_placement_changes_the_prediction():
    """On two hosts of four only the boundary crossings count: the ring crosses it twice
    (2(N-1)/N M each way), the server's host sends and receives 4 M."""
    two_nodes = [0, 0, 0, 0, 1, 1, 1, 1]
    ring = traffic.predict("ring", 8, M, two_nodes, LINK)
    ps = traffic.predict("ps", 8, M, two_nodes, LINK)
    assert ring.bandwidth_s == pytest.approx(2 * 7 / 8 * M * LINK.beta_s_per_byte)
    assert ps.bandwidth_s == pytest.approx(2 * 4 * M * LINK.beta_s_per_byte)
    assert traffic.predict("ring", 8, M, [0] * 8, LINK).bandwidth_s == 0    # no link crossed


def test_regime():
    assert traffic.predict("ring", 8, 64, list(range(8)), LINK).regime == "latency-bound"
    assert traffic.predict("ring", 8, M, list(range(8)), LINK).regime == "bandwidth-bound"


def test_crossover_is_where_the_ring_starts_to_win():
    hosts = list(range(4))
    m = traffic.crossover("ps", "ring", 4, hosts, LINK)
    # 6 alpha + 1.5 m beta = 2 alpha + 6 m beta  =>  m = 4 alpha / (4.5 beta)
    assert m == pytest.approx(4 * LINK.alpha_s / (4.5 * LINK.beta_s_per_byte), rel=2e-3)
    for size, ring_wins in ((m * 0.99, False), (m * 1.01, True)):
        ring = traffic.predict("ring", 4, size, hosts, LINK).total_s
        assert (ring < traffic.predict("ps", 4, size, hosts, LINK).total_s) == ring_wins
    # two ranks: the same latencies and half the bytes, so the ring wins at every size
    assert traffic.crossover("ps", "ring", 2, [0, 1], LINK) == 0.0
    # the other way round the server never wins on bandwidth
    assert traffic.crossover("ring", "ps", 4, hosts, LINK) is None


def rows(comm_ring_s: float) -> list[dict]:
    common = dict(steps=10, compute_s=0.1, grad_bytes=M)
    return [dict(common, dp="ps", comm_s=9.0, wall_s=9.2), dict(common, dp="ring", comm_s=comm_ring_s, wall_s=comm_ring_s + 0.2)]


def link(hosts: int = 4, per_host: int = 1, cores: int = 16) -> dict:
    return {"alpha_s": LINK.alpha_s, "beta_s_per_byte": LINK.beta_s_per_byte, "between": "rank 0 (a) <-> rank 1 (b)",
            "hosts": hosts, "ranks": hosts * per_host, "cores": cores, "per_host": per_host,
            "host_of": [r // per_host for r in range(hosts * per_host)]}


def test_prediction_text_under_the_summary():
    table = rows(comm_ring_s=2.1)
    prediction.annotate(table, link(), servers=None)
    ps, ring = table
    assert ps["pred_comm_s"] == pytest.approx(6 * M * 8e-9 + 40e-6)
    assert ring["pred_step_s"] == pytest.approx(0.01 + ring["pred_comm_s"])
    text = prediction.describe(table)
    assert "alpha 20.0 us, 125 MB/s; 4 ranks on 4 hosts; gradients 16 MiB per step" in text
    assert "crossover: ring communicates faster than ps above" in text and "is above it" in text
    assert "measured comm over the model" not in text       # 210 ms a step vs 201 predicted
    # the steps' ratio, measured (0.92 s / 0.23 s) and the model's (ps's step / ring's)
    predicted = ps["pred_step_s"] / ring["pred_step_s"]
    assert f"step: ring 4.00x ps's speed, the model {predicted:.2f}x ({4.0 / predicted - 1:+.0%})" in text


def test_the_librarys_allreduce_is_priced_as_what_it_runs_where_both_levels_were_measured():
    """psrt.train's table charges `native` Rabenseifner's algorithm (what Open MPI 4.1's rules
    run on a power of two of ranks), the step model's price, where the ping-pongs measured
    both levels of a placement of several hosts; the ring elsewhere."""
    from psrt.bench import step_model
    from psrt.collectives import cost
    two_by_four = dict(link(hosts=2, per_host=4, cores=8), intra=(2e-6, 1 / 4e9), crowd=1.0)
    table = [dict(steps=10, compute_s=0.1, grad_bytes=M, dp=dp, comm_s=1.0, wall_s=1.1) for dp in ("native", "ring")]
    prediction.annotate(table, two_by_four, servers=None)
    native, ring = table
    levels = cost.Links(cost.Fit(2e-6, 1 / 4e9, 1.0), LINK, 1.0)
    assert native["pred_comm_s"] == pytest.approx(step_model.comm_time("native", two_by_four["host_of"], M, levels))
    # only the two middle exchanges cross the hosts, M/2 each way in each: M in all on a
    # host's link against the ring's 1.75 M
    assert native["pred_comm_s"] == pytest.approx(M * LINK.beta_s_per_byte, rel=0.06)
    assert ring["pred_comm_s"] == pytest.approx(1.75 * M * LINK.beta_s_per_byte, rel=0.01)
    # without the measurement inside a host, or on one host, the ring's price
    for where in (link(hosts=2, per_host=4, cores=8), dict(two_by_four, hosts=1, host_of=list(range(8)))):
        table = [dict(steps=10, compute_s=0.1, grad_bytes=M, dp=dp, comm_s=1.0, wall_s=1.1) for dp in ("native", "ring")]
        prediction.annotate(table, where, servers=None)
        assert table[0]["pred_comm_s"] == pytest.approx(table[1]["pred_comm_s"])


def test_prediction_says_why_when_far_from_the_measurement():
    table = rows(comm_ring_s=20.0)               # 10x the model
    prediction.annotate(table, link(hosts=2, per_host=4, cores=2), servers=None)
    text = prediction.describe(table)
    assert "measured comm over the model: ring" in text and "4 ranks share a host's 2 cores" in text


@pytest.mark.parametrize("seconds,text", [(12e-6, "12 us"), (3.456e-3, "3.46 ms"), (0.87, "870 ms"), (1.2, "1.2 s")])
def test_duration(seconds, text):
    assert prediction.duration(seconds) == text


class _Comm:
    """Rank 0 of a two-rank job on two hosts, enough of mpi4py's Comm for measure()."""
    rank, size = 0, 2

    def allgather(self, value):        # host names; (machine, cores) pairs
        return [value, ("other machine", 2) if isinstance(value, tuple) else "other"]

    def Split(self, color, key):
        return self

    def bcast(self, value, root):
        return value

    def Free(self):
        pass


class _World:
    hostname = "here"


def _points(times):
    return [{"nbytes": m, "one_way_s": t} for m, t in zip(prediction.SIZES, times)]


def test_a_busy_ping_pong_is_measured_again_then_left_out(monkeypatch, capsys):
    flat = _points([1e-5, 1e-3, 1e-3, 1e-3])            # bigger messages no slower: no beta
    good = _points([1e-5, 1e-3, 2e-3, 4e-3])
    tries = iter([flat, good])
    from psrt.collectives import pingpong
    monkeypatch.setattr(pingpong, "pingpong", lambda *a, **k: next(tries))
    link = prediction.measure(_World(), _Comm())
    assert link["beta_s_per_byte"] == pytest.approx(1e-3 / (1 << 20)) and link["hosts"] == 2
    monkeypatch.setattr(pingpong, "pingpong", lambda *a, **k: flat)
    assert prediction.measure(_World(), _Comm()) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"psrt: no alpha-beta prediction: ping-pong times do not grow with message size; cannot "
                   f"fit beta after {prediction.ATTEMPTS} ping-pongs (a busy host?)"]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pairwise_alltoall_one_rank_per_host(n):
    """(N-1) steps of one M/N block each way over every host's link."""
    got = predict_alltoall([list(range(n))], M, list(range(n)), LINK)
    assert got == pytest.approx((n - 1) * (LINK.alpha_s + M / n * LINK.beta_s_per_byte))


def test_pairwise_alltoall_counts_the_busiest_link_of_each_step():
    a, b = LINK.alpha_s, LINK.beta_s_per_byte
    # two groups of 2 on 4 hosts at once: one step, each link carrying one block
    assert predict_alltoall([[0, 1], [2, 3]], M, [0, 1, 2, 3], LINK) == pytest.approx(a + M / 2 * b)
    # 4 ranks on 2 hosts of 2: steps 1 and 3 send one block of M/4 across each way, step 2 two
    assert predict_alltoall([[0, 1, 2, 3]], M, [0, 0, 1, 1], LINK) == pytest.approx(3 * a + M * b)
    # nothing crosses a link: no prediction
    assert predict_alltoall([[0, 1], [2, 3]], M, [0, 0, 1, 1], LINK) is None


def test_runs_the_model_does_not_cover_say_why():
    """--pp/--tp and --model moe move traffic the model does not price: one line says so
    (psrt.train prints it under the table instead of the prediction); plain DP runs get one."""
    assert prediction.not_covered(1, 1, "mlp") is None
    assert prediction.not_covered(1, 1, "transformer") is None
    for pp, tp in ((2, 1), (1, 2), (2, 2)):
        line = prediction.not_covered(pp, tp, "transformer")
        assert line.startswith("no alpha-beta prediction for --pp/--tp runs: ") and "\n" not in line
    assert prediction.not_covered(1, 1, "moe").startswith("no alpha-beta prediction for --model moe: ")
