"""psrt.trace: spans, the Chrome-trace layout with clock offsets, and `python -m psrt.trace`."""
import json
import threading

import pytest

from psrt.trace import OFF, Tracer, chrome_trace, clock_offset
from psrt.trace.__main__ import main
from psrt.trace.view import draw


def test_off_records_nothing_and_on_records_spans():
    with OFF.span("forward", "compute"):
        pass
    OFF.add("allreduce", "comm", 0, 10)
    assert OFF.events == []
    t = Tracer()
    with t.span("backward", "compute", microbatch=2):
        pass
    t.add("allreduce", "comm", 5, 9, algorithm="ring", bytes=64)
    (name, cat, thread, t0, t1, args), second = t.events
    assert (name, cat, thread, args) == ("backward", "compute", threading.current_thread().name, {"microbatch": 2})
    assert t1 >= t0 and second == ("allreduce", "comm", thread, 5, 9, {"algorithm": "ring", "bytes": 64})


def test_clock_offsets_line_the_ranks_up():
    """Rank 1's clock runs 1 s behind rank 0's: with its offset its span lands where rank 0's
    clock says it happened."""
    ranks = [{"rank": 0, "host": "a", "offset_ns": 0, "events": [("x", "comm", "MainThread", 5_000_000, 6_000_000, {})]},
             {"rank": 1, "host": "b", "offset_ns": 1_000_000_000,
              "events": [("x", "comm", "psrt-comm", 5_000_000 - 1_000_000_000, 7_000_000 - 1_000_000_000, {})]}]
    trace = chrome_trace(ranks)
    spans = {e["pid"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert spans[0]["ts"] == spans[1]["ts"] == 0 and spans[1]["dur"] == 2000.0
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "rank 0 (a)", 1: "rank 1 (b)"}
    threads = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert threads == ["MainThread", "psrt-comm"]


def test_command_prints_totals_and_draws(tmp_path, capsys):
    ranks = [{"rank": r, "host": "h", "offset_ns": 0,
              "events": [("forward", "compute", "MainThread", 0, 2_000_000, {}),
                         ("allreduce", "comm", "psrt-comm", 1_000_000, 4_000_000, {"algorithm": "ring"})]}
             for r in range(2)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(chrome_trace(ranks)))
    assert main([str(path), "--png", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "   1  allreduce  comm          1       3.0" in out
    assert (tmp_path / "t.png").stat().st_size > 5000


def test_a_file_that_is_not_a_trace_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit) as exit_:
        main([str(bad)])
    assert exit_.value.code == 2
    assert "bad.json: no traceEvents list: not a Chrome trace" in capsys.readouterr().err


def test_the_file_of_a_several_strategy_run_is_named(tmp_path, capsys):
    """`--trace out/trace.json --dp ps,ring` writes trace.ps.json and trace.ring.json: asking
    for trace.json names them instead of saying only that it does not exist."""
    for dp in ("ps", "ring"):
        (tmp_path / f"trace.{dp}.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "trace.json")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "one per strategy" in err and "trace.ps.json" in err and "trace.ring.json" in err


def test_two_runs_drawn_together_keep_rows_of_their_own(tmp_path):
    """The demo draws the ps run and the ring run in one picture: both traces number their
    ranks from 0 and start their clocks at 0, so each run needs rows of its own."""
    from psrt.trace.view import side_by_side
    ranks = [{"rank": r, "host": "h", "offset_ns": 0,
              "events": [("forward", "compute", "MainThread", 0, 2_000_000, {})]} for r in range(2)]
    one = chrome_trace(ranks)["traceEvents"]
    both = side_by_side({"ps": one, "ring": one})
    lanes = {(e["pid"], e["tid"]) for e in both if e["ph"] == "X"}
    assert len(lanes) == 2 * len({(e["pid"], e["tid"]) for e in one if e["ph"] == "X"})
    names = sorted(e["args"]["name"] for e in both if e["ph"] == "M" and e["name"] == "process_name")
    assert names[0].startswith("ps ") and names[-1].startswith("ring ")
    draw(both, str(tmp_path / "both.png"))


def test_the_drawing_starts_at_the_first_step(tmp_path):
    """A run's spans start with the parameters' broadcast as its strategy is made, and its
    steps seconds later (set-up): the PNG starts at the first step, so the steps fill the
    picture, and two runs drawn together have their first steps at the same time."""
    from psrt.trace.view import from_first_step, side_by_side, totals
    ms = 1_000_000

    def run(setup_ms):
        return chrome_trace([{"rank": r, "host": "h", "offset_ns": 0,
                              "events": [("broadcast", "comm", "MainThread", 0, 1 * ms, {}),
                                         ("step", "step", "MainThread", setup_ms * ms, (setup_ms + 10) * ms, {}),
                                         ("forward", "compute", "MainThread", setup_ms * ms, (setup_ms + 4) * ms, {})]}
                             for r in range(2)])["traceEvents"]

    slow = run(5000)
    drawn = [e for e in from_first_step(slow) if e["ph"] == "X"]
    assert {e["name"] for e in drawn} == {"step", "forward"}
    assert min(e["ts"] for e in drawn) == 0 and max(e["ts"] + e["dur"] for e in drawn) == 10_000
    assert any(r["name"] == "broadcast" for r in totals(slow))     # the summary still counts it
    both = [e for e in side_by_side({"ps": run(100), "ring": slow}) if e["ph"] == "X" and e["name"] == "step"]
    assert {e["ts"] for e in both} == {0}
    no_steps = [e for e in slow if e.get("cat") != "step"]
    assert from_first_step(no_steps) == no_steps                   # nothing to align: drawn whole
    draw(side_by_side({"ps": run(100), "ring": slow}), str(tmp_path / "both.png"))


# ------------------------------------------------------------------ clock offsets, measured

class ThreadComm:
    """Two or more 'ranks' as threads, with mpi4py's lower-case send/recv/gather over queues."""

    def __init__(self, rank: int, size: int, boxes: dict):
        self.rank, self.size, self.boxes = rank, size, boxes

    def send(self, obj, dest: int, tag: int) -> None:
        self.boxes[(self.rank, dest, tag)].put(obj)

    def recv(self, source: int, tag: int):
        return self.boxes[(source, self.rank, tag)].get(timeout=10)

    def gather(self, obj, root: int = 0):
        if self.rank != root:
            self.send(obj, root, 1)
            return None
        return [obj if r == root else self.recv(r, 1) for r in range(self.size)]


def run_ranks(size: int, body):
    """body(comm) on `size` threads; their results in rank order."""
    import collections
    import queue
    boxes = collections.defaultdict(queue.Queue)
    results, errors = [None] * size, []

    def run(r):
        try:
            results[r] = body(ThreadComm(r, size, boxes))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return results


SKEW_NS = {0: 0, 1: -1_000 * 10**9, 2: 37 * 10**9}      # rank 1's clock 1000 s behind, rank 2's 37 s ahead


def skewed(rank: int):
    import time
    return lambda: time.perf_counter_ns() + SKEW_NS[rank]


def test_clock_offset_undoes_an_injected_skew():
    """Each rank's measured offset is minus its skew, within 50 ms (half a round trip at most,
    of the fastest of several: generous for a busy machine, tiny beside the skews): adding
    it puts the rank's times on rank 0's clock."""
    offsets = run_ranks(3, lambda comm: clock_offset(comm, clock=skewed(comm.rank)))
    assert offsets[0] == 0
    for r in (1, 2):
        assert abs(offsets[r] + SKEW_NS[r]) < 50_000_000, (r, offsets[r])


def test_written_timeline_lines_up_ranks_whose_clocks_disagree(tmp_path):
    """Three ranks leave a barrier together and each records a 0.2 s span on its own skewed
    clock: in the written trace the spans overlap (uncorrected, they would start 1000 s and
    37 s apart), and the offsets are in the file."""
    import time
    gate = threading.Barrier(3)
    path = tmp_path / "skew.json"

    def body(comm):
        tracer = Tracer(clock=skewed(comm.rank))
        gate.wait()
        with tracer.span("together", "wait"):
            time.sleep(0.2)
        tracer.write(comm, path, host=f"h{comm.rank}")
    run_ranks(3, body)
    trace = json.loads(path.read_text())
    spans = {e["pid"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert sorted(spans) == [0, 1, 2]
    assert max(e["ts"] for e in spans.values()) < min(e["ts"] + e["dur"] for e in spans.values()), spans
    offsets = trace["otherData"]["offsets_ns"]
    assert abs(offsets["1"] - 1_000 * 10**9) < 50_000_000 and abs(offsets["2"] + 37 * 10**9) < 50_000_000
