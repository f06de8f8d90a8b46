"""The hierarchical schedule's data (placement, block order) and the two-level model, without
MPI: every block travels once, the host links carry what the docs say, and 'auto' on one host
chooses exactly what the tuning table says."""
import pytest

from psrt.collectives import cost, hierarchical as H
from psrt.collectives.algorithms import ALGORITHMS
from psrt.collectives.cost import link_load
from psrt.collectives.tuning import Tuning

M = 16 << 20


def test_placement_numbers_hosts_by_their_lowest_rank():
    p = H.Placement.from_keys(["b", "a", "b", "c", "b", "a"])
    assert p.host_of == (0, 1, 0, 2, 0, 1)
    assert p.sizes == (3, 2, 1) and p.local_of == (0, 0, 1, 0, 2, 1) and p.shards == 3
    assert p.rank_at(0, 2) == 4 and p.rank_at(2, 1) is None


@pytest.mark.parametrize("keys", [[0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 0, 2, 0, 1], [0, 1, 2, 3], [5] * 3])
def test_every_host_orders_every_block_once_by_holder(keys):
    p = H.Placement.from_keys(keys)
    block, _ = H._even_blocks(p, 1000)
    for host in range(p.hosts):
        order, counts, start = H._plan(p, host, block)
        assert sorted(order) == sorted(block) and sum(counts) == 1000
        assert len(counts) == p.sizes[host] and set(start) == set(range(p.shards))


def test_two_hosts_of_four_put_m_on_the_link_where_the_flat_ring_puts_175_m():
    host_of = [0] * 4 + [1] * 4
    flat = sum(link_load(m, host_of) * k for m, k, _ in cost.rounds("ring", host_of, M))
    two = sum(link_load(m, host_of) * k for m, k, _ in cost.rounds("hierarchical", host_of, M))
    assert flat == pytest.approx(1.75 * M) and two == pytest.approx(1.0 * M)
    links = cost.Links(cost.Fit(5e-6, 1 / 3e9, 1), cost.Fit(50e-6, 1 / 120e6, 1))
    assert cost.predict_two_level("hierarchical", host_of, M, links) < cost.predict_two_level("ring", host_of, M, links)
    # crowding charges each sequential step: the flat ring pays 14 waits
    crowded = cost.Links(links.intra, links.inter, crowd=4.0)
    assert cost.predict_two_level("ring", host_of, M, crowded) > cost.predict_two_level("ring", host_of, M, links) \
        + 14 * crowded.step_wait() - 1e-9


def test_auto_on_one_host_is_the_table_and_on_several_hosts_hierarchical():
    tuning = Tuning.load()
    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast"):
        for n in (2, 4, 8):
            for m in (8, 4096, 1 << 20, 16 << 20, 256 << 20):
                allowed = ALGORITHMS[coll]
                assert tuning.choose(coll, m, n, allowed, (n,)) == tuning._flat(coll, m, n, allowed)
                assert tuning.choose(coll, m, n, allowed) == tuning._flat(coll, m, n, allowed)
    assert tuning.choose("allreduce", M, 8, ALGORITHMS["allreduce"], (4, 4)) == "hierarchical"
    assert tuning.choose("allreduce", M, 8, ALGORITHMS["allreduce"], (1,) * 8) != "hierarchical"


def test_ranks_on_one_machine_share_its_cores_whatever_host_they_claim():
    from psrt.world import crowding, machine_key
    assert crowding(["m"] * 8, [2] * 8) == 4.0            # two emulated hosts of 4 on one 2-core machine
    assert crowding(["a"] * 4 + ["b"] * 4, [8] * 8) == 1.0
    assert crowding(["a", "a", "b"], [1, 1, 4]) == 2.0
    assert machine_key() == machine_key() != ""


def test_auto_on_crowded_hosts_prefers_the_schedules_of_fewer_rounds():
    tuning = Tuning.load()
    allowed = ALGORITHMS["allreduce"]
    small = 38_400          # the default MLP's gradients
    # 4 hosts of 2 on one 2-core machine: every round waits for a rank to be scheduled, and
    # the more ranks per core, the fewer rounds win: hierarchical's 4 (a reduction inside
    # each host, log2(4) exchanges among the first ranks, a broadcast) before the tree's
    # 2 log2(N) = 6 and the flat ring's 14, then the server's 2
    assert tuning.choose("allreduce", small, 8, allowed, (2, 2, 2, 2), crowd=1.0) not in ("ps", "tree")
    assert tuning.choose("allreduce", small, 8, allowed, (2, 2, 2, 2), crowd=4.0) == "hierarchical"
    assert tuning.choose("allreduce", small, 8, allowed, (2, 2, 2, 2), crowd=8.0) == "ps"
    # bandwidth-bound, the bytes decide, crowded or not
    assert all(tuning.choose("allreduce", 16 << 20, 8, allowed, (2, 2, 2, 2), crowd=c) == "hierarchical"
               for c in (1.0, 4.0))
    # only the all-reduce has a model of ps and tree
    assert tuning.choose("allgather", small, 8, ALGORITHMS["allgather"], (2, 2, 2, 2), crowd=4.0) in (
        "hierarchical", tuning._flat("allgather", small, 8, ALGORITHMS["allgather"]))


def test_a_ring_pays_the_latency_between_hosts_2_h_minus_1_times_and_hierarchical_log2_h():
    """A flat ring's 2(N-1) rounds pay the latency between hosts 2(H-1) times (NCCL's count):
    6 on 4 hosts of 4 ranks in host order, all 30 on 16 hosts of one; interleaved over 2
    hosts, every edge crosses and all 6 of 4 ranks' rounds pay it; the hierarchical
    all-reduce of a small buffer pays log2(4) = 2, its recursive doubling among the hosts'
    first ranks."""
    alpha = 1e-3
    links = cost.Links(cost.Fit(0.0, 1e-15, 1), cost.Fit(alpha, 1e-15, 1))
    four = [h for h in range(4) for _ in range(4)]
    assert cost.predict_two_level("ring", four, 1024, links) == pytest.approx(6 * alpha, rel=1e-6)
    assert cost.predict_two_level("ring", [0, 1, 0, 1], 1024, links) == pytest.approx(6 * alpha, rel=1e-6)
    assert cost.predict_two_level("ring", list(range(16)), 1024, links) == pytest.approx(30 * alpha, rel=1e-6)
    assert cost.predict_two_level("hierarchical", four, 1024, links) == pytest.approx(2 * alpha, rel=1e-6)
    # from LEADERS_RING_BYTES the first ranks run a ring: 2(H-1) = 6 rounds between hosts
    assert cost.predict_two_level("hierarchical", four, cost.LEADERS_RING_BYTES, links) == pytest.approx(
        6 * alpha, rel=1e-3)
    # three hosts: doubling folds one first rank onto another, and unfolds after (2 + 1 rounds)
    three = [h for h in range(3) for _ in range(2)]
    assert cost.predict_two_level("hierarchical", three, 1024, links) == pytest.approx(3 * alpha, rel=1e-6)
