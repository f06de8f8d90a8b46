"""The training loop's components seen from outside: a user's own --callback, the TensorBoard
log read back, and the same components in a user's psrt.data_parallel loop."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, RankRun, mpirun_argv

pytestmark = pytest.mark.mpi


def launch(np_: int, *argv: str, cwd, extra_env: dict) -> RankRun:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_COMM_", "OMPI_MCA_orte_", "OMPI_MCA_ess", "PMIX_", "PMI_"))}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'examples'}", OMP_NUM_THREADS="1", **extra_env)
    return RankRun(subprocess.run(mpirun_argv(np_) + [sys.executable, *argv], capture_output=True, text=True,
                                  timeout=300, env=env, cwd=cwd, stdin=subprocess.DEVNULL)).check()


def scalars(logdir, tag: str) -> dict[int, float]:
    """{step: value} of `tag` in the TensorBoard event files of `logdir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(tag)}


def hparams(logdir) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    return {k: v.ListFields()[0][1] for k, v in data.session_start_info.hparams.items()}


def test_callback_counts_steps_and_tensorboard_logs_every_step(tmp_path):
    """One launch, two strategies (ps with a dedicated server, ring): the user's component
    hears every step of each, and TensorBoard's loss is the metrics' loss at every step."""
    launch(3, "-m", "psrt.train", "--dp", "ps,ring", "--servers", "1", "--steps", "6", "--batch-size", "36",
           "--callback", "callback_steps:StepCounter", "--tensorboard", "tb", "--metrics", "m.jsonl", "--quiet",
           cwd=tmp_path, extra_env={"STEP_COUNT_FILE": "steps.json"})
    counted = [json.loads(line) for line in (tmp_path / "steps.json").read_text().splitlines()]
    assert [(c["dp"], c["start"], c["steps"], c["last_step"]) for c in counted] == [("ps", 0, 6, 6), ("ring", 0, 6, 6)]
    for dp in ("ps", "ring"):
        steps = [json.loads(line) for line in (tmp_path / f"m.{dp}.jsonl").read_text().splitlines()]
        losses = {r["step"]: r["loss"] for r in steps if not r.get("summary")}
        logged = scalars(tmp_path / "tb" / dp, "loss")
        assert sorted(logged) == list(range(1, 7)) == sorted(losses)
        assert all(logged[k] == pytest.approx(losses[k], rel=1e-6) for k in losses), (logged, losses)
        assert sorted(scalars(tmp_path / "tb" / dp, "time/comm_s")) == list(range(1, 7))
        assert sorted(scalars(tmp_path / "tb" / dp, "throughput/samples_per_s")) == list(range(1, 7))
        hp = hparams(tmp_path / "tb" / dp)
        assert hp["dp"] == dp and hp["batch_size"] == 36 and hp["steps"] == 6
        assert counted[["ps", "ring"].index(dp)]["loss"] == pytest.approx(losses[6], rel=1e-6)


def test_components_in_a_data_parallel_loop(tmp_path):
    """examples/callback_steps.py: psrt.data_parallel wrapped by WithCallbacks, with the
    user's counter, psrt's Metrics and TensorBoard components."""
    launch(2, str(ROOT / "examples" / "callback_steps.py"), "--steps", "5", "--metrics", "m.jsonl",
           "--tensorboard", "tb", cwd=tmp_path, extra_env={"STEP_COUNT_FILE": "steps.json"})
    counted = [json.loads(line) for line in (tmp_path / "steps.json").read_text().splitlines()]
    assert [(c["dp"], c["steps"]) for c in counted] == [("ring", 5)]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5] and all(r["bytes_sent"] > 0 for r in lines)
    logged = scalars(tmp_path / "tb" / "ring", "loss")
    assert sorted(logged) == [1, 2, 3, 4, 5]
    assert all(logged[r["step"]] == pytest.approx(r["loss"], rel=1e-6) for r in lines)


@pytest.mark.parametrize("flag", ["--checkpoint", "--save", "--metrics", "--trace"])
def test_an_output_that_cannot_be_written_is_refused_before_the_first_step(tmp_path, flag):
    """/proc takes no new file, root or not: refused at once in one line, not at the first
    checkpoint or after the whole run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    out = subprocess.run([sys.executable, "-m", "psrt.train", "--steps", "50", flag, "/proc/psrt-out.pt"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, stdin=subprocess.DEVNULL,
                         env=dict(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"psrt.train: error: {flag} /proc/psrt-out.pt: cannot write in /proc"), \
        out.stderr
    assert "steps" not in out.stderr
