"""`python -m psrt.bench demo` without namespaces: it says why and falls back to local ranks."""
import subprocess

from psrt.bench import demo, suite
from psrt.bench.__main__ import build_parser


def test_falls_back_to_local_ranks_and_says_why(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(suite, "netns_ok", lambda: "the emulated cluster needs root")
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: seen.append(argv) or subprocess.CompletedProcess(argv, 3))
    args = build_parser().parse_args(["demo", "--steps", "2"])
    assert demo.command(args) == 3            # the job's exit code is the demo's
    err = capsys.readouterr().err
    assert "psrt demo: no emulated hosts (the emulated cluster needs root); running 4 local ranks instead" in err
    (argv,) = seen
    assert argv[1:3] == ["-np", "4"] and "--emulate" not in argv
    assert argv[argv.index("--dp") + 1] == "ps,ring" and argv[argv.index("--steps") + 1] == "2"


def test_emulated_hosts_by_default(monkeypatch):
    monkeypatch.setattr(suite, "netns_ok", lambda: None)
    args = build_parser().parse_args(["demo", "--hosts", "6", "--rate", "100mbit"])
    argv = demo.launch_argv(args, emulate=True)
    assert argv[1:6] == ["--emulate", "--hosts", "h0,h1,h2,h3,h4,h5", "--rate", "100mbit"]


def runs(ps_s: float, ring_s: float, predicted: float | None, steps: int = 10) -> dict:
    """Two strategies' metrics as read_runs gives them: summaries with wall time for `steps`."""
    ring = {"wall_s": ring_s * steps, "steps": steps}
    if predicted is not None:
        ring["pred_step_s"] = predicted
    return {"ps": {"steps": [], "summary": {"wall_s": ps_s * steps, "steps": steps}},
            "ring": {"steps": [], "summary": ring}}


def test_verdict_judges_the_goals_from_the_measured_steps():
    text = demo.verdict(runs(0.9, 0.3, 0.27))
    assert text.splitlines() == [
        "psrt demo: ring step 300 ms = 0.33x the parameter server's 900 ms; the alpha-beta model predicted 270 ms (+11%)",
        "psrt demo: goal met: ring step <= 0.5x the parameter server's: 0.33x",
        "psrt demo: goal met: ring step within 20% of the alpha-beta prediction: +11%"]
    # the ring at 0.6x the server and 25% under the model: both missed
    slow = demo.goals(runs(0.5, 0.3, 0.4))
    assert [(g.value, g.ok) for g in slow] == [("0.60x", False), ("-25%", False)]
    # the bounds themselves are met
    edge = demo.goals(runs(0.8, 0.4, 0.5))
    assert [(g.value, g.ok) for g in edge] == [("0.50x", True), ("-20%", True)]


def test_verdict_without_prediction_or_emulated_hosts_judges_nothing():
    no_model = demo.goals(runs(0.9, 0.3, None))
    assert (no_model[1].text, no_model[1].value, no_model[1].ok) == (
        "ring step within 20% of the alpha-beta prediction", "no prediction was made", None)
    local = demo.verdict(runs(0.9, 0.3, 0.3), emulated=False).splitlines()
    assert local[1] == ("psrt demo: goal n/a: ring step <= 0.5x the parameter server's (judged on emulated "
                        "hosts only: these were local ranks): 0.33x")
    assert local[2].startswith("psrt demo: goal n/a: ring step within 20%") and local[2].endswith(": +0%")
