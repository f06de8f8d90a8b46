"""psrt.trace: spans, the Chrome-trace layout with clock offsets, and `python -m psrt.trace`."""
import json
import threading

import pytest

from psrt.trace import OFF, Tracer, chrome_trace
from psrt.trace.__main__ import main


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
