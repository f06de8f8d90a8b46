"""The staged path's schedule and model (psrt/collectives/staged.py), on one process: chunk
bounds, the order of the stages, the pool made once, the pipelined-time model, and the
schedule run with copies that run late (tests/mpi/ranks/late_lanes.py) in every dtype."""
import sys
from pathlib import Path

import pytest
import torch

from psrt.collectives import staged, staged_plans

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi" / "ranks"))
from late_lanes import LateLanes  # noqa: E402


def test_chunks_cover_the_tensor_once_with_a_partial_last():
    assert staged.chunks(0, 4) == []
    assert staged.chunks(8, 4) == [(0, 4), (4, 4)]
    assert staged.chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert staged.chunks(3, 4) == [(0, 3)]


def test_schedule_overlaps_three_stages():
    assert staged.schedule(0) == []
    assert staged.schedule(1) == [("down", 0), ("reduce", 0), ("up", 0)]
    order = staged.schedule(5)
    at = {step: k for k, step in enumerate(order)}
    assert sorted(order) == sorted((s, i) for s in ("down", "reduce", "up") for i in range(5))
    for i in range(5):
        assert at[("down", i)] < at[("reduce", i)] < at[("up", i)]
        if i + 1 < 5:    # the next chunk is on its way down while this one is reduced
            assert at[("down", i + 1)] < at[("reduce", i)]
        if i > 0:        # and the one before on its way up
            assert at[("up", i - 1)] < at[("reduce", i)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 100])
def test_the_schedule_with_late_copies_reduces_every_chunk_once(dtype, numel):
    pool = staged.Pool(chunk_bytes=64, pin=False)
    src = (torch.arange(numel) % 7).to(dtype)
    for in_place in (False, True):
        x = src.clone()
        dst = x if in_place else torch.full_like(x, 5)
        seen = []

        def reduce_chunk(host):
            seen.append(host.numel())
            host.mul_(3)           # what a sum over three ranks holding the same chunk gives

        lanes = LateLanes()
        pieces = staged_plans.allreduce(x, dst, pool.elements(dtype), reduce_chunk)
        staged.pipeline(pieces, dtype, pool, lanes, dst)
        assert torch.equal(dst, src * 3)
        per = 64 // src.element_size()
        assert seen == [n for _, n in staged.chunks(numel, per)]
        assert lanes.log.count("down") == lanes.log.count("up") == len(seen)


def test_the_pool_is_allocated_once():
    pool = staged.Pool(chunk_bytes=64, pin=False)
    first = [pool.view(s, torch.float32, 16).data_ptr() for s in range(staged.SLOTS)]
    pieces = staged_plans.allreduce(torch.ones(100), torch.empty(100), 16, lambda h: None)
    staged.pipeline(pieces, torch.float32, pool, LateLanes())
    assert [pool.view(s, torch.bfloat16, 3).data_ptr() for s in range(staged.SLOTS)] == first
    assert pool.elements(torch.float64) == 8


def test_columns_cut_every_segment_in_slot_sized_pieces():
    # 3 ranks, 12 elements a slot: 4 columns of each segment per piece
    pieces = staged_plans.columns([10, 0, 5], 12)
    assert pieces == [(0, [4, 0, 4]), (4, [4, 0, 1]), (8, [2, 0, 0])]
    assert staged_plans.columns([0, 0], 12) == []
    # a slot smaller than the ranks still moves one column a piece
    assert staged_plans.columns([2, 1, 2], 2) == [(0, [1, 1, 1]), (1, [1, 0, 1])]


class _Counter:
    """Records the all-to-all's messages instead of sending them."""
    def __init__(self, rank, size):
        self.rank, self.size, self.sent, self.expected = rank, size, {}, {}


def test_every_alltoall_message_is_one_its_receiver_expects():
    """Each rank's pieces post, per peer, exactly as many messages as that peer's pieces
    expect from it, however the block sizes compare with half a slot."""
    import random
    rng = random.Random(3)
    for n in (2, 3, 5):
        counts = [[rng.choice([0, 1, 7, 8, 9, 30]) for _ in range(n)] for _ in range(n)]  # counts[a][b]: a -> b
        sent, expected = {}, {}
        for r in range(n):
            send = torch.zeros(sum(counts[r]))
            recv_counts = [counts[j][r] for j in range(n)]
            recv = torch.zeros(sum(recv_counts))
            pieces = staged_plans.alltoallv(_Counter(r, n), send, counts[r], recv, recv_counts, per=16)
            for p in pieces:
                to, s, frm, g = p.middle.to, p.middle.s, p.middle.frm, p.middle.g
                sent[(r, to)] = sent.get((r, to), 0) + (s > 0)
                expected[(frm, r)] = expected.get((frm, r), 0) + (g > 0)
                assert sum(x.numel() for _, x in p.down) == s <= 8 and sum(x.numel() for x, _ in p.up) == g <= 8
        for a in range(n):
            for b in range(n):
                if a != b:
                    assert sent.get((a, b), 0) == expected.get((a, b), 0) == -(-counts[a][b] // 8)


def test_the_model_is_the_slowest_stage_plus_one_chunk_through_the_others():
    mib = 1 << 20
    reduce_s = lambda n: n / 1e9          # noqa: E731  the host all-reduce at 1 GB/s
    t = staged.staged_time(64 * mib, 50e9, 50e9, reduce_s, chunk_bytes=4 * mib)
    assert t == pytest.approx(64 * mib / 1e9 + 2 * 4 * mib / 50e9)
    # copies slower than the reduction: the copy down bounds it
    t = staged.staged_time(64 * mib, 1e9, 2e9, lambda n: n / 4e9, chunk_bytes=4 * mib)
    assert t == pytest.approx(64 * mib / 1e9 + 4 * mib / 4e9 + 4 * mib / 2e9)
    assert staged.staged_time(0, 1e9, 1e9, reduce_s) == 0.0


def test_the_gpu_bench_puts_each_staged_row_beside_its_model_and_torch():
    from psrt.bench import cuda
    mib = 1 << 20
    gpu = cuda.Gpu(torch.device("cuda", 0), down_bps=50e9, up_bps=50e9, staged=True)
    rows = [{"algorithm": "ring", "nbytes": 16 * mib, "time_us": 30_000.0},
            {"algorithm": "host:ring", "nbytes": 16 * mib, "time_us": 25_000.0},
            {"algorithm": "torch", "nbytes": 16 * mib, "time_us": 40_000.0},
            {"algorithm": "auto", "nbytes": 16 * mib, "time_us": 20_000.0}]
    # another collective of the same size is compared with its own host and torch rows
    other = [dict(r, collective="reduce_scatter", time_us=r["time_us"] / 2) for r in rows]
    rows = [dict(r, collective="allreduce") for r in rows] + other
    cuda.add_models(rows, gpu)
    ring, host, peer, auto = rows[:4]
    assert rows[4]["vs_model"] == pytest.approx(15_000.0 / (12_500.0 + 2 * (4 * mib / 50e9) * 1e6))
    assert rows[4]["vs_torch"] == pytest.approx(0.75)
    want = 25_000.0 + 2 * (4 * mib / 50e9) * 1e6     # the host stage, plus one chunk down and up
    assert ring["model_us"] == pytest.approx(want) and ring["vs_model"] == pytest.approx(30_000.0 / want)
    assert ring["vs_torch"] == pytest.approx(0.75) and auto["vs_torch"] == pytest.approx(0.5)
    assert "model_us" not in host and "model_us" not in auto and "vs_torch" not in host
    direct = [{k: r[k] for k in ("algorithm", "nbytes", "time_us")} for r in rows[:3]]
    cuda.add_models(direct, cuda.Gpu(gpu.device, 1e9, 1e9, staged=False))
    assert "model_us" not in direct[0]          # a CUDA-aware MPI stages nothing
    assert cuda.device_rows(["ring", "nccl", "torch"], own_gpu=False) == ["ring", "torch"]
    assert cuda.host_rows(["ring", "auto", "torch", "nccl", "native"]) == ["ring", "native"]


def test_a_slot_comes_back_only_once_its_copy_up_has_run():
    """A pipeline receive gives its slots back with the event of their copy up; the next
    taker must not write a slot whose data is still on its way up."""
    slots = staged.Slots(chunk_bytes=16, pin=False)
    lanes = LateLanes()
    first = slots.take()
    first.view(torch.float32)[:] = 7
    out = torch.zeros(4)
    slots.give(first, lanes.copy("up", out, first.view(torch.float32)), lanes)
    assert torch.equal(out, torch.zeros(4))          # the copy has not run yet
    again = slots.take()
    assert again.data_ptr() == first.data_ptr() and slots.made == 1
    assert torch.equal(out, torch.full((4,), 7.0))   # taking it ran the copy first
    slots.give(again)
    slots.take()
    slots.take()
    assert slots.made == 2                           # a second one only while two are out


@pytest.mark.parametrize("op", ["sum", "max", "avg"])
def test_reduced_on_the_device_the_host_only_moves_data(op):
    """PSRT_STAGED_REDUCE=gpu: each piece's chunks of every rank are gathered on the host and
    reduced on the device, after their copies up, in rank order (3 ranks, this one rank 1)."""
    size, rank = 3, 1
    pool = staged.Pool(chunk_bytes=48, pin=False)           # 12 float32: 4 of each rank a piece
    src, dst = torch.arange(10.0), torch.full((10,), -1.0)
    scratch = torch.empty(staged.SLOTS, 48, dtype=torch.uint8)

    def gather(host, counts):                               # ranks 0 and 2 hold 10x and 100x
        n = counts[0]
        assert counts == [n] * size and host.numel() == size * n
        mine = host[rank * n:(rank + 1) * n].clone()
        host[:n], host[2 * n:] = mine * 10, mine * 100
    lanes = LateLanes()
    pieces = staged_plans.allreduce_on_gpu(src, dst, pool.elements(torch.float32), rank, size, op, gather,
                                           lambda slot: scratch[slot].view(torch.float32))
    assert [p.down[0][1].numel() for p in pieces] == [4, 4, 2]
    staged.pipeline(pieces, torch.float32, pool, lanes, dst)
    want = {"sum": src * 111, "max": src * 100, "avg": src * 111 / 3}[op]
    assert torch.allclose(dst, want)
    assert lanes.log.count("up work") == 3


def test_the_gpu_bench_times_the_staged_sum_on_the_other_side_too():
    from types import SimpleNamespace

    from psrt.bench import cuda
    for own, other in (("host", "gpu"), ("gpu", "host")):
        stager = staged.Stager(reduce_on=own)
        group = SimpleNamespace(_staging=SimpleNamespace(direct_cuda=False), _stager=stager)
        with cuda.other_path(group) as label:
            assert label == f"{other}-reduce:" and group._stager.reduce_on == other
        assert group._stager is stager
        assert cuda.other_path(group).applies("allreduce") and not cuda.other_path(group).applies("allgather")


def test_on_a_cuda_aware_mpi_the_gpu_bench_stages_the_same_calls_and_compares_them():
    """Rows `staged:ALGO` beside the direct ones, for every collective; the staged results are
    compared element by element with the direct path's on one random input."""
    from types import SimpleNamespace

    from psrt.bench import cuda
    from psrt.transport import Staging
    own = Staging(cuda_aware_mpi=True)
    group = SimpleNamespace(_staging=own, comm=SimpleNamespace(rank=0, allreduce=lambda v: v))
    other = cuda.other_path(group)
    assert isinstance(other, cuda.ForceStaged) and other.applies("allgather")
    with other as label:
        assert label == "staged:" and group._staging.direct_cuda is False
    assert group._staging is own

    def call(name, x):      # a staged path that gets one element wrong for "bad"
        y = x * 2
        if name == "bad" and not group._staging.direct_cuda:
            y[3] += 1
        return y
    assert other.differences(call, ["ring", "bad"], 64, torch.float32, "cpu") == {"ring": 0, "bad": 1}
    assert group._staging is own
