"""The loop core of psrt.train (psrt/train/core.py) and its components, each driven alone
with fake events and a fake run: no MPI, no strategy."""
from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from psrt.dp.stats import StepStats
from psrt.errors import PsrtError
from psrt.train import core
from psrt.train.callbacks import user
from psrt.train.callbacks.checkpoints import Checkpoints
from psrt.train.callbacks.evaluation import Evaluation
from psrt.train.callbacks.heartbeat import Heartbeat
from psrt.train.callbacks.metrics import Metrics
from psrt.train.callbacks.progress import Progress
from psrt.train.callbacks.restarts import Restarts
from psrt.train.callbacks.routing import Routing
from psrt.train.callbacks.saving import save
from psrt.train.callbacks.summary import Summary
from psrt.train.config import TrainConfig
from psrt.train.events import EVENTS, Callback, Events, WithCallbacks

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "psrt" / "train"


class Ctl:
    """A one-rank stand-in for the loop's communicator."""
    rank, size = 0, 1

    def Barrier(self):
        pass

    def gather(self, obj, root=0):
        return [obj]

    def bcast(self, obj, root=0):
        return obj


class Layout:
    """A layout whose step returns the loss 1/(step+1) and can fail once at a chosen step."""

    def __init__(self, worker=True, fail_at=None):
        self.is_worker, self.fail_at, self.steps, self.served = worker, fail_at, 0, []
        self.finished = False
        self.components, self.num_workers, self.worker_rank = [], 1, 0
        self.state = SimpleNamespace(state_dict=lambda: {}, load_state_dict=lambda s: None, worker_rank=0)

    def step(self, batches):
        if self.fail_at == self.steps + 1:
            self.fail_at = None
            raise RuntimeError("peer lost")
        self.steps += 1
        return StepStats(loss=1 / self.steps, compute_s=0.01, comm_s=0.02, bytes_sent=100)

    def serve(self, rounds=None):
        self.served.append(rounds)

    def finish(self):
        self.finished = True

    def whole(self):
        return torch.nn.Linear(2, 1)

    def label(self, dp):
        return dp

    def params_count(self):
        return 3

    def bytes_sent(self):
        return 7


def fake_run(total=5, worker=True, fail_at=None, cfg=None, tmp=None):
    cfg = cfg or TrainConfig(steps=total, quiet=True)
    sampler = SimpleNamespace(steps_per_epoch=10, microbatches=lambda step: [[0]], position=lambda s: divmod(s, 10))
    built = SimpleNamespace(run=Layout(worker, fail_at), group=object(), sampler=sampler, scaler=None, lead=0,
                            criterion=None)
    from psrt.train.state import RunState
    job = SimpleNamespace(ctl=Ctl(), dog=None, world=SimpleNamespace(hostname="h"))
    data = SimpleNamespace(train_x=torch.zeros(4, 2), train_y=torch.zeros(4, 1), test_x=torch.zeros(0, 2),
                           test_y=torch.zeros(0), task="regression")
    return RunState(cfg, "ring", job, data, tracer=None, build=lambda: built)


class Recorder(Callback):
    def __init__(self, fix=False, resume=None, bounds=()):
        self.seen, self.fix, self.resume, self.bounds = [], fix, resume, set(bounds)

    def on_resume(self, run):
        self.seen.append(("resume",))
        return self.resume

    def boundaries(self, run):
        return self.bounds

    def on_run_start(self, run):
        self.seen.append(("start", run.start, run.resumed))

    def on_step_end(self, run, stats):
        self.seen.append(("step", run.step, None if stats is None else round(stats.loss, 3)))

    def on_failure(self, run, error):
        self.seen.append(("failure", str(error)))
        if self.fix:
            run.step -= 1            # goes on from the step before, as a recovery does
        return self.fix

    def on_recovered(self, run):
        self.seen.append(("recovered", run.step))

    def on_loop_end(self, run):
        self.seen.append(("loop_end", getattr(getattr(run, "layout", None), "finished", None)))

    def on_evaluate(self, run, model):
        self.seen.append(("evaluate", run.layout.finished, type(model).__name__))

    def on_gather(self, run, mine):
        mine["mine"] = 1
        self.seen.append(("gather",))

    def on_run_end(self, run, everyone, row):
        if row is not None:
            row["x"] = everyone
        self.seen.append(("end",))


def test_core_tells_each_event_in_order():
    r = Recorder()
    row = core.train(fake_run(total=3), Events([r]))
    assert r.seen == [("resume",), ("start", 0, False), ("step", 1, 1.0), ("step", 2, 0.5), ("step", 3, 0.333),
                      ("loop_end", False), ("evaluate", True, "Linear"), ("gather",), ("end",)]
    assert row == {"x": [{"mine": 1}]}


def test_core_resumes_where_a_component_restored_the_state():
    r = Recorder(resume=2)
    core.train(fake_run(total=4), Events([Recorder(), r]))
    assert r.seen[1] == ("start", 2, True)
    assert [s[1] for s in r.seen if s[0] == "step"] == [3, 4]


def test_a_failure_a_component_mends_goes_on_from_its_step():
    r = Recorder(fix=True)
    run = fake_run(total=4, fail_at=3)
    core.train(run, Events([r]))
    steps = [s for s in r.seen if s[0] in ("step", "failure", "recovered")]
    assert steps == [("step", 1, 1.0), ("step", 2, 0.5), ("failure", "peer lost"), ("recovered", 1),
                     ("step", 2, 0.333), ("step", 3, 0.25), ("step", 4, 0.2)]


def test_a_failure_nobody_mends_ends_the_run():
    with pytest.raises(RuntimeError, match="peer lost"):
        core.train(fake_run(total=4, fail_at=2), Events([Recorder(fix=False)]))


def test_a_server_serves_up_to_each_boundary_then_to_the_end():
    r = Recorder(bounds={2, 4, 9})           # 9 is past the run: left out
    run = fake_run(total=6, worker=False)
    core.train(run, Events([r]))
    assert run.layout.served == [2, 2, None]
    assert [s for s in r.seen if s[0] == "step"] == [("step", 2, None), ("step", 4, None)]


def test_core_is_at_most_forty_lines_and_no_function_of_psrt_train_over_sixty():
    for path in sorted(TRAIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                limit = 40 if path.name == "core.py" else 60
                assert length <= limit, f"{path.relative_to(ROOT)}:{node.lineno} {node.name} has {length} lines"


def imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return found


def test_the_core_and_its_components_form_layers():
    components = {p.stem for p in (TRAIN / "callbacks").glob("*.py") if p.stem != "__init__"}
    assert {"checkpoints", "restarts", "in_job", "metrics", "progress", "timeline", "routing", "ledger",
            "evaluation", "summary", "tensorboard", "user", "saving", "heartbeat"} <= components
    core_imports = imports(TRAIN / "core.py")
    assert not [m for m in core_imports if m.startswith("psrt.train.callbacks")], core_imports
    assert not [m for m in core_imports if m.startswith("psrt.train.") and m not in
                ("psrt.train.events", "psrt.train.events.Events")], core_imports
    for name in components:
        found = imports(TRAIN / "callbacks" / f"{name}.py")
        assert not [m for m in found if m.startswith(("psrt.train.core", "psrt.train.loop"))], (name, found)
        others = [m for m in found if m.startswith("psrt.train.callbacks") and m != f"psrt.train.callbacks.{name}"]
        assert not others, (name, others)
    # and every event a component can hear is one the core or WithCallbacks tells
    told = (TRAIN / "core.py").read_text() + (TRAIN / "events.py").read_text()
    assert all(f'"{e}"' in told for e in EVENTS if e not in ("on_resume", "on_failure")), EVENTS


# ---------------------------------------------------------------- components, one at a time
def step_stats(loss=0.5, **extra):
    return StepStats(loss=loss, compute_s=0.1, comm_s=0.2, bytes_sent=64, extra=extra)


def test_checkpoints_at_every_interval_and_at_the_end(monkeypatch, tmp_path):
    saved = []
    monkeypatch.setattr("psrt.train.checkpoint.save", lambda path, ctl, state, step, spe, config: saved.append(step))
    cfg = TrainConfig(steps=10, checkpoint=str(tmp_path / "c.pt"), checkpoint_every=3, quiet=True)
    run, c = fake_run(total=10, cfg=cfg), Checkpoints()
    assert c.boundaries(run) == {3, 6, 9}
    c.on_run_start(run)
    for run.step in range(1, 11):
        c.on_step_end(run, step_stats())
    c.on_evaluate(run, None)
    assert saved == [3, 6, 9, 10]
    run.start = 6                            # a resumed run: only the ones after its start
    assert c.boundaries(run) == {9}


def test_no_checkpoint_without_the_flag(monkeypatch):
    monkeypatch.setattr("psrt.train.checkpoint.save", lambda *a: pytest.fail("saved"))
    run, c = fake_run(total=10), Checkpoints()
    c.on_run_start(run)
    for run.step in range(1, 11):
        c.on_step_end(run, step_stats())
    c.on_evaluate(run, None)


def test_restarts_start_fresh_without_a_checkpoint_or_a_restart(monkeypatch):
    monkeypatch.delenv("PSRT_RESTART_COUNT", raising=False)
    run = fake_run()
    assert Restarts().on_resume(run) is None


def test_metrics_write_a_line_per_step_with_what_others_noted(tmp_path):
    path = tmp_path / "m.jsonl"
    run, m = fake_run(cfg=TrainConfig(steps=3, metrics=str(path), quiet=True)), Metrics()
    m.on_run_start(run)
    for run.step in (1, 2):
        run.notes = {"restart": 1} if run.step == 2 else {}
        m.on_step_end(run, step_stats(loss=float("nan") if run.step == 1 else 0.25, dp_bytes_sent=5))
    m.on_step_end(run, None)                 # a server's boundary: nothing to write
    m.on_run_end(run, None, None)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["loss"], r.get("restart"), r["dp_bytes_sent"]) for r in lines] == \
        [(1, None, None, 5), (2, 0.25, 1, 5)]


def test_progress_speaks_on_the_lead_worker_only(capsys):
    run, p = fake_run(total=2, cfg=TrainConfig(steps=2)), Progress()
    p.on_run_start(run)
    run.step, run.notes = 2, {"dropped": 3}
    p.on_step_end(run, step_stats())
    assert "ring: 2/2 steps loss 0.5000 dropped 3" in capsys.readouterr().err
    run.built.lead = 1                       # another rank leads now
    p.on_run_start(run)
    p.on_step_end(run, step_stats())
    assert capsys.readouterr().err == ""


def test_heartbeat_tells_the_watchdog_each_step():
    run, beats = fake_run(), []
    run.job.dog = SimpleNamespace(step=beats.append)
    for run.step in (1, 2):
        Heartbeat().on_step_end(run, step_stats())
    Heartbeat().on_step_end(run, None)
    assert beats == [1, 2]


def test_summary_row_from_every_rank_figures():
    run, s = fake_run(total=2), Summary()
    for run.step in (1, 2):
        s.on_step_end(run, step_stats(loss=0.5 / run.step))
    run.wall, run.model = 2.0, torch.nn.Linear(2, 1)
    mine = {"test_loss": 0.1, "test_acc": None}
    s.on_gather(run, mine)
    server = dict(mine, worker=False, bytes=1000, opt=9)
    row = {}
    s.on_run_end(run, [mine, server], row)
    assert row["dp"] == "ring" and row["workers"] == 1 and row["ranks"] == 2 and row["steps"] == 2
    assert row["train_loss"] == 0.25 and row["samples_per_s"] == 2 * 64 / 2.0
    assert row["bytes_per_rank"] == 128 and row["bytes_max_rank"] == 1000 and row["opt_state_bytes"] == 9
    assert row["grad_bytes"] == 3 * 4 and row["comm_s"] == pytest.approx(0.4)


def test_routing_notes_each_step_and_sums_the_run():
    cfg = TrainConfig(model="moe", experts=2, steps=2)
    run, r = fake_run(cfg=cfg), Routing()
    moe = {"routed": torch.tensor([3, 1]), "dropped": torch.tensor([1, 0]), "a2a_bytes": 10, "layers": 1,
           "aux_loss": 0.1}
    for run.step in (1, 2):
        run.notes = {}
        r.on_step_end(run, step_stats(moe=moe))
    assert run.notes["dropped"] == 1 and run.notes["routed"] == [3, 1]
    assert r.routing.routed.tolist() == [6, 2] and r.routing.a2a == 20
    mine = {}
    r.on_gather(run, mine)
    assert mine == {"a2a": 20}


def test_evaluation_on_the_lead_worker():
    run, e = fake_run(), Evaluation()
    run.dataset.test_x, run.dataset.test_y = torch.ones(4, 2), torch.ones(4, 1)
    run.built.criterion = torch.nn.MSELoss()
    model = torch.nn.Linear(2, 1)
    torch.nn.init.zeros_(model.weight), torch.nn.init.zeros_(model.bias)
    e.on_evaluate(run, model)
    mine = {}
    e.on_gather(run, mine)
    assert mine["test_loss"] == pytest.approx(1.0)


def test_a_save_that_fails_keeps_the_parameters_and_names_where(tmp_path):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(PsrtError) as err:
        save(model, "/proc/psrt-final.pt")   # no file can be made there, root or not
    message = str(err.value)
    assert message.startswith("--save /proc/psrt-final.pt: cannot write it") and "\n" not in message
    spare = message.rsplit(" ", 1)[-1]
    state = torch.load(spare, weights_only=True)
    assert torch.equal(state["weight"], model.weight.detach())
    Path(spare).unlink()


def test_user_components_by_name_each_error_one_line():
    made = user.load("psrt.train.events:Callback")
    assert len(made) == 1 and isinstance(made[0], Callback)
    for spec, words in [("no_such_module_x:A", "cannot import no_such_module_x"),
                        ("psrt.train.events:Nothing", "has no Nothing"),
                        ("psrt.train.events:EVENTS", "is not a class"),
                        ("collections:OrderedDict", "has none of the events")]:
        with pytest.raises(PsrtError, match=words):
            user.load(spec)


@pytest.mark.parametrize("spec", ["mod", "mod:", "a b:C", "mod:A,", ""])
def test_a_callback_that_is_no_import_path_is_refused_with_the_config(spec):
    with pytest.raises(PsrtError, match="--callback .*expected module:Class"):
        TrainConfig(callback=spec)
    assert TrainConfig(callback="pkg.mod:A, other:B.C").callback     # a comma list of import paths


def test_a_component_need_not_subclass_callback():
    class Counts:
        steps = 0

        def on_step_end(self, run, stats):
            self.steps += 1
    c = Counts()
    core.train(fake_run(total=3), Events([c]))
    assert c.steps == 3


def test_with_callbacks_tells_a_user_loop_events():
    class Driver:
        name, is_worker, is_server, worker_rank, group, stats = "ring", True, False, 0, SimpleNamespace(rank=0), []
        finished = False

        def step(self, loss_fn, batch):
            self.stats.append(1)
            return step_stats(loss=loss_fn(batch))

        def finish(self):
            self.finished = True

    r = Recorder()
    d = WithCallbacks(Driver(), [r], total=2)
    assert d.step(lambda b: b, 0.5).loss == 0.5 and d.step(lambda b: b, 0.25).loss == 0.25
    d.finish()
    assert d.driver.finished and d.name == "ring"
    assert [s[0] for s in r.seen] == ["start", "step", "step", "loop_end", "end"]
    assert r.seen[2] == ("step", 2, 0.25) and d.run.total == 2 and d.run.is_lead
