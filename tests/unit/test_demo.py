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
