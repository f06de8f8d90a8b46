"""The suite's warm `python` (tests/forkserver.py) behaves as the interpreter it stands for:
argv, environment, directory, streams, exit codes and signals; and it starts cold where a fork
would differ.  Also a cold launch of the main entry points, so the plain start keeps a test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import PYTHON, ROOT, launch_ranks

WARM = "import sys; print('warm' if 'torch' in sys.modules else 'cold')"


def python(*args, env=None, cwd=None, **kw):
    """`python ARGS` as the tests start it (sys.executable is the warm one in this session)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env=env, cwd=cwd, stdin=subprocess.DEVNULL, **kw)


@pytest.fixture
def script(tmp_path):
    def write(text):
        path = tmp_path / "s.py"
        path.write_text(text)
        return str(path)
    return write


def warm_session():
    if sys.executable == PYTHON:
        pytest.skip("this session starts its pythons cold (--cold)")


def test_a_script_sees_what_a_fresh_interpreter_would(script, tmp_path):
    warm_session()
    path = script("import os, sys\n" + WARM + "\n"
                  "print(sys.argv[1:], os.getcwd(), os.environ['ONLY_HERE'], sys.path[0])\n")
    out = python(path, "a", "b c", env=dict(os.environ, ONLY_HERE="yes"), cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["warm", f"['a', 'b c'] / yes {tmp_path}"]


def test_exit_codes_tracebacks_and_signals_come_back(script):
    warm_session()
    assert python(script("import sys; sys.exit(3)")).returncode == 3
    assert python(script("import sys; sys.exit('bye')")).returncode == 1
    failed = python(script("raise ValueError('boom')"))
    assert failed.returncode == 1 and "ValueError: boom" in failed.stderr
    killed = python(script("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"))
    assert killed.returncode == -signal.SIGKILL
    # a signal to the process mpirun knows reaches the forked one
    proc = subprocess.Popen([sys.executable, script("import time\nprint('up', flush=True)\ntime.sleep(60)")],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM


def test_an_exit_does_what_the_interpreters_shutdown_does(script, tmp_path):
    """The forked process leaves without clearing its modules (tests/forkserver.py, _leave),
    yet as the interpreter would: other threads finish, atexit handlers run, files left open
    are flushed and closed, the exit code is the program's."""
    warm_session()
    text, raw = tmp_path / "t.txt", tmp_path / "b.bin"
    path = script("import atexit, sys, threading, time\n"
                  f"t = open({str(text)!r}, 'w'); t.write('text')\n"
                  f"b = open({str(raw)!r}, 'wb'); b.write(b'bytes')\n"
                  "atexit.register(print, 'atexit')\n"
                  "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
                  "sys.stdout.write('main')\n"
                  "sys.exit(int(sys.argv[1]))\n")
    for code in (0, 3):
        out = python(path, str(code))
        assert (out.returncode, out.stdout.split(), out.stderr) == (code, ["mainthread", "atexit"], "")
        assert (text.read_text(), raw.read_bytes()) == ("text", b"bytes")


def test_a_killed_stub_takes_its_process_with_it(script, tmp_path):
    warm_session()
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen([sys.executable, script(f"import os, time\nopen({str(pidfile)!r}, 'w').write(str(os.getpid()))\n"
                                                    "time.sleep(60)")])
    for _ in range(600):
        if pidfile.exists() and pidfile.read_text():
            break
        proc.poll()
        time.sleep(0.05)
    forked = int(pidfile.read_text())
    proc.kill()
    proc.wait()
    for _ in range(200):
        try:
            os.kill(forked, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"process {forked} outlived its stub")


@pytest.mark.parametrize("how", ["flags", "library path", "blas threads"])
def test_what_a_fork_cannot_be_starts_cold(script, how):
    warm_session()
    path = script(WARM)
    args, env = [path], dict(os.environ)
    if how == "flags":
        args = ["-X", "utf8", path]
    elif how == "library path":
        env["LD_LIBRARY_PATH"] = "/nonexistent"
    else:
        env["OPENBLAS_NUM_THREADS"] = "1"
    out = python(*args, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "cold", out.stderr


def test_unbuffered_and_torchrun_start_warm(script):
    """`python -u` (how torchrun starts its workers) forks, with unbuffered streams; `torchrun`
    runs in the server's python, so its workers do too."""
    warm_session()
    path = script(WARM + "\nprint(sys.stdout.write_through)")
    out = python("-u", path)
    assert out.returncode == 0 and out.stdout.split() == ["warm", "True"], out.stderr
    out = subprocess.run(["torchrun", "--standalone", "--nproc-per-node", "1", path], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and out.stdout.split() == ["warm", "True"], out.stderr


@pytest.mark.parametrize("threads", ["1", "2"])
def test_omp_num_threads_is_what_torch_uses(script, threads):
    warm_session()
    out = python(script(WARM + "\nimport torch; print(torch.get_num_threads())"),
                 env=dict(os.environ, OMP_NUM_THREADS=threads))
    assert out.returncode == 0 and out.stdout.split() == ["warm", threads], out.stderr


@pytest.mark.mpi
def test_the_entry_points_start_cold_too(tmp_path):
    """Ranks started as fresh interpreters (as users start them) train and agree."""
    save = tmp_path / "m.pt"
    launch_ranks(2, "-m", "psrt.train", "--dp", "ring", "--steps", "2", "--quiet", "--save", str(save), warm=False).check()
    assert save.stat().st_size > 0
    run = launch_ranks(2, str(ROOT / "examples" / "ps_vs_ring.py"), warm=False)
    assert run.returncode == 0, run.stderr[-2000:]
