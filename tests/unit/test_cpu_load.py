"""The CPU-bound verdict (psrt/train/cpu_load.py) from scheduler statistics, without MPI."""
import time

from psrt.train import cpu_load


def test_verdict_marks_a_run_whose_ranks_waited_for_cores():
    quiet = [{"cpu_busy": 0.05, "run_queue": 0.01}, {"cpu_busy": 0.1, "run_queue": 0.03}]
    crowded = [{"cpu_busy": 0.3, "run_queue": 0.5}, {"cpu_busy": 0.2, "run_queue": 0.3}]
    assert cpu_load.verdict(quiet)["cpu_bound"] is False
    v = cpu_load.verdict(crowded)
    assert v["cpu_bound"] is True and abs(v["run_queue"] - 0.4) < 1e-12 and abs(v["cpu_busy"] - 0.25) < 1e-12


def test_unknown_run_queue_is_not_a_verdict():
    assert cpu_load.verdict([{"cpu_busy": 0.9, "run_queue": None}]) == \
        {"cpu_busy": 0.9, "run_queue": None, "cpu_bound": False}


def test_a_sleeping_process_is_not_busy():
    start = cpu_load.sample()
    time.sleep(0.2)
    s = cpu_load.shares(start, cpu_load.sample())
    assert s["cpu_busy"] < 0.2
