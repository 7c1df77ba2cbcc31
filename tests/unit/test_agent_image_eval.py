"""Eval in a container image (forkd_eval_proc.py, forkd-eval-worker.py, forkd_eval_worker.py):
the agent run on the host with ``--eval-in image``, as the guest's init starts it in one.

The "image" is the host: the worker is started with the python3 found on the
PATH the agent's defaults give (``configure``), by default the host's
/usr/bin/python3, and the other Pythons pyenv holds stand in for images with
older or newer ones. Each agent keeps its defaults in a file of the test's own.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.other_uid import world_readable_copy
from tests.unit.test_agent import AGENT, Client, _agent_env, _stop, agent_mod

HOST_PYTHON = "/usr/bin/python3"
PYENV = Path("/root/.pyenv/versions")
ENTROPY = base64.b64encode(os.urandom(32)).decode()


def _pyenv_bin(prefix: str) -> Path:
    """The bin directory of the pyenv Python ``prefix`` (``3.8``); skips if the host has none."""
    found = sorted(PYENV.glob(f"{prefix}.*/bin")) if PYENV.is_dir() else []
    if not found:
        pytest.skip(f"this host has no Python {prefix} under {PYENV} to stand in for an image's")
    return found[-1]


@pytest.fixture(scope="module")
def staged_agent() -> Iterator[Path]:
    """The agent's files where the image's user may read them: its eval worker runs as
    that user, and the checkout may be closed to it (tests/other_uid.py)."""
    with world_readable_copy(AGENT.parent, "forkd-agent-files-") as files:
        yield files / AGENT.name


def _start_agent(tmp: Path, agent: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    path = tmp / "agent.sock"
    argv = [
        sys.executable,
        str(agent),
        "--socket",
        str(path),
        "--defaults-file",
        str(tmp / "image.json"),
        *extra,
    ]
    proc = subprocess.Popen(argv, env=_agent_env())
    deadline = time.monotonic() + 10
    while True:
        try:
            Client(path).close()
            return proc, path
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise
            time.sleep(0.02)


@pytest.fixture
def image_agent(tmp_path: Path, staged_agent: Path) -> Iterator[Client]:
    """An agent whose evals go to a worker in the image's Python."""
    proc, path = _start_agent(tmp_path, staged_agent, "--eval-in", "image")
    client = Client(path, timeout=30)
    try:
        yield client
    finally:
        client.close()
        _stop(proc)


def _configure(agent: Client, **defaults: Any) -> None:
    assert agent.result("configure", **{"env": {}, "cwd": None, "user": None, **defaults}) == {}


def _eval(agent: Client, code: str, **params: Any) -> dict[str, Any]:
    return agent.result("eval", code=code, **params)


def _worker_pid(agent: Client) -> int:
    return int(_eval(agent, "import os; os.getpid()")["result"])


# ----------------------------------------------------------------------------- where eval runs


def test_eval_runs_in_the_images_python3_and_keeps_its_namespace(image_agent: Client) -> None:
    first = _eval(image_agent, "import json, sys\nx = 41\nsys.executable")
    assert first["error"] is None, first
    assert first["result"] == repr(HOST_PYTHON)  # the image's, not the agent's interpreter
    assert _eval(image_agent, "x + 1")["result"] == "42"
    assert _eval(image_agent, "json.dumps([1])")["result"] == "'[1]'"  # imports stay too
    assert _eval(image_agent, "__name__")["result"] == "'__main__'"
    # Imports look in the working directory first, as in a REPL; never in forkd's own.
    assert _eval(image_agent, "sys.path[0]")["result"] == "''"
    assert _eval(image_agent, "any('forkd' in p for p in sys.path)")["result"] == "False"
    assert _eval(image_agent, "'forkd_eval_proc' in sys.modules")["result"] == "False"


def test_a_recipe_image_keeps_eval_in_the_agents_own_interpreter(
    tmp_path: Path, staged_agent: Path
) -> None:
    proc, path = _start_agent(tmp_path, staged_agent)  # auto: not under /opt/forkd/rt
    try:
        with contextlib.closing(Client(path)) as agent:
            answer = _eval(agent, "import os, sys\n(sys.executable, os.getpid())")
            assert answer["result"] == repr((sys.executable, proc.pid))
    finally:
        _stop(proc)


def test_the_worker_runs_with_the_images_env_directory_and_user(
    image_agent: Client,
) -> None:
    cwd = tempfile.mkdtemp(prefix="forkd-image-cwd-")
    try:
        os.chmod(cwd, 0o755)
        _configure(image_agent, env={"GREETING": "hello"}, cwd=cwd, user="65534:65534")
        code = "import os\n(os.getuid(), os.getgid(), os.getcwd(), os.environ['GREETING'])"
        assert _eval(image_agent, code)["result"] == repr((65534, 65534, cwd, "hello"))
    finally:
        os.rmdir(cwd)


def test_configure_restarts_a_running_worker_under_the_new_defaults(image_agent: Client) -> None:
    _eval(image_agent, "kept = 1")
    before = _worker_pid(image_agent)
    _configure(image_agent, env={"MODE": "new"})
    assert _eval(image_agent, "import os; os.environ.get('MODE')")["result"] == "'new'"
    assert _worker_pid(image_agent) != before
    assert "NameError" in _eval(image_agent, "kept")["error"]


def test_output_written_to_fd_1_does_not_reach_the_protocol(image_agent: Client) -> None:
    answer = _eval(
        image_agent, "import os\nos.write(1, b'{\"id\": 1}\\nnot json\\n')\nos.system('echo hi')"
    )
    assert answer["result"] == "0" and answer["error"] is None
    assert _eval(image_agent, "2 * 21")["result"] == "42"


# ----------------------------------------------------------------------------- forks


def test_restore_reseeds_the_workers_random_module(image_agent: Client) -> None:
    seeded = _eval(image_agent, "import random\nrandom.seed(1)\nrandom.random()")["result"]
    # Control: without a restore the seeded sequence is reproduced in the worker.
    assert _eval(image_agent, "random.seed(1)\nrandom.random()")["result"] == seeded
    _eval(image_agent, "random.seed(1)")
    result = image_agent.result("restore", time_ns=time.time_ns(), entropy=ENTROPY, hostname="f")
    assert result["random_reseeded"] is True
    assert _eval(image_agent, "random.random()")["result"] != seeded


def test_restore_before_any_eval_starts_no_worker(image_agent: Client) -> None:
    result = image_agent.result("restore", time_ns=time.time_ns(), entropy=ENTROPY, hostname="f")
    assert result["random_reseeded"] is True
    assert image_agent.result("eval_interrupt") == {"interrupted": False}


# ----------------------------------------------------------------------------- interrupts, ends


def test_interrupt_and_timeout_stop_an_eval_in_the_worker(
    image_agent: Client, tmp_path: Path
) -> None:
    marker = tmp_path / "sleeping"
    code = f"import time\nopen({str(marker)!r}, 'w').close()\ntime.sleep(1000)"
    req_id = image_agent.send("eval", code=code)
    deadline = time.monotonic() + 10
    while not marker.exists():
        assert time.monotonic() < deadline, "the eval never started"
        time.sleep(0.01)
    assert image_agent.result("eval_interrupt") == {"interrupted": True}
    answer = image_agent.wait(req_id)["result"]
    assert answer["error"].rstrip().endswith("KeyboardInterrupt") and not answer["timed_out"]
    assert "time.sleep(1000)" in answer["error"]

    start = time.monotonic()
    answer = _eval(image_agent, "spins = 0\nwhile True:\n    spins += 1", timeout_s=1)
    assert time.monotonic() - start < 4
    assert answer["timed_out"] is True and "timeout of 1 s" in answer["error"]
    assert int(_eval(image_agent, "spins")["result"]) > 0  # the same worker, its state kept


@pytest.mark.parametrize(
    ("code", "how"),
    [
        ("import os\nos._exit(3)", "exit status 3"),
        ("import ctypes\nctypes.string_at(0)", "killed by SIGSEGV"),
    ],
)
def test_a_worker_that_dies_answers_that_eval_and_the_next_starts_fresh(
    image_agent: Client, code: str, how: str
) -> None:
    _eval(image_agent, "x = 41")
    before = _worker_pid(image_agent)
    answer = _eval(image_agent, code)
    assert answer["exit_code"] == 1 and answer["result"] is None
    assert f"the image's Python ({HOST_PYTHON}) exited during this eval ({how})" in answer["error"]
    assert "state (variables, imports) is gone" in answer["error"]
    assert "NameError" in _eval(image_agent, "x")["error"]
    assert _worker_pid(image_agent) != before


def test_output_caps_are_as_in_the_agent(image_agent: Client) -> None:
    answer = _eval(image_agent, "print('y' * (2 * 1024 * 1024))")
    assert answer["stdout_truncated"] is True and len(answer["stdout"]) == 1024 * 1024


# ----------------------------------------------------------------------------- which Python


def test_an_image_without_python_is_refused_saying_to_use_exec(image_agent: Client) -> None:
    _configure(image_agent, env={"PATH": "/nonexistent/bin:relative/bin"})
    msg = image_agent.call("eval", code="1")
    assert msg["ok"] is False and msg["kind"] == "NoImagePython"
    assert "no python3 on its PATH" in msg["error"] and "use exec" in msg["error"]
    # exec still works there (it finds its programs by absolute path)
    assert image_agent.result("exec", argv=["/bin/true"])["exit_code"] == 0


@pytest.mark.parametrize("version", ["3.8", "3.9", "3.10", "3.12", "3.13"])
def test_eval_runs_on_every_python_an_image_may_have(image_agent: Client, version: str) -> None:
    _configure(image_agent, env={"PATH": str(_pyenv_bin(version))})
    code = "import sys, random\nx = [i * i for i in range(3)]\nprint('on', sys.version_info[:2])"
    answer = _eval(image_agent, code + "\nx")
    assert answer["error"] is None, answer
    assert answer["result"] == "[0, 1, 4]"
    assert answer["stdout"] == f"on {tuple(int(p) for p in version.split('.'))}\n"
    result = image_agent.result("restore", time_ns=time.time_ns(), entropy=ENTROPY, hostname="f")
    assert result["random_reseeded"] is True
    assert "EvalTimeout" in _eval(image_agent, "while True: pass", timeout_s=0.5)["error"]


@pytest.mark.parametrize(("version", "shown"), [("3.7", "3.7."), ("3.6", "3.6."), ("2.7", "2.7.")])
def test_a_python_older_than_38_is_refused_naming_its_version(
    image_agent: Client, version: str, shown: str
) -> None:
    # 2.7's bin has only `python`: the fallback when there is no python3.
    _configure(image_agent, env={"PATH": str(_pyenv_bin(version))})
    msg = image_agent.call("eval", code="1")
    assert msg["ok"] is False and msg["kind"] == "ImagePythonUnsupported"
    assert f"this sandbox's image has Python {shown}" in msg["error"]
    assert "3.8 or later" in msg["error"] and "use exec" in msg["error"]


def test_a_python_that_cannot_start_is_refused_with_its_stderr(
    image_agent: Client, tmp_path: Path
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text("#!/bin/sh\necho 'libpython: cannot open shared object' >&2\nexit 127\n")
    fake.chmod(0o755)
    _configure(image_agent, env={"PATH": str(bin_dir)})
    msg = image_agent.call("eval", code="1")
    assert msg["kind"] == "ImagePythonUnsupported"
    assert "exited at start (exit status 127)" in msg["error"]
    assert "cannot open shared object" in msg["error"]


# ----------------------------------------------------------------------------- the worker's answers

eval_proc = agent_mod.forkd_eval_proc


def test_runtime_detection_is_the_agents_prefix_under_opt_forkd_rt() -> None:
    assert eval_proc.in_runtime("/opt/forkd/rt/usr") is True
    assert eval_proc.in_runtime("/opt/forkd/rt") is True
    assert eval_proc.in_runtime("/usr") is False
    assert eval_proc.in_runtime("/opt/forkd/rtx") is False


def test_find_python_prefers_python3_and_never_forkds_own(tmp_path: Path) -> None:
    for name in ("python", "python3"):
        (tmp_path / name).write_text("")
        (tmp_path / name).chmod(0o755)
    assert eval_proc.find_python(f"/opt/forkd:{tmp_path}") == str(tmp_path / "python3")
    (tmp_path / "python3").chmod(0o644)  # not executable: not a candidate
    assert eval_proc.find_python(str(tmp_path)) == str(tmp_path / "python")
    assert eval_proc.find_python("bin:/nonexistent") is None


def test_a_forged_answer_is_capped_or_refused() -> None:
    cap = agent_mod.handlers.forkd_eval.MAX_OUTPUT_CHARS
    answer = eval_proc.checked_answer({"result": "r", "stdout": "x" * (cap + 5), "extra": 1})
    assert answer["stdout_truncated"] is True and len(answer["stdout"]) == cap
    assert "extra" not in answer and answer["exit_code"] == 0 and answer["error"] is None
    huge = [{"mime": "text/plain", "data": "d" * (1 << 20)}] * 20  # 20 MiB of displays
    answer = eval_proc.checked_answer({"display": huge})
    assert answer["display_truncated"] is True
    assert sum(len(item["data"]) for item in answer["display"]) <= 8 * 1024 * 1024
    bad: object
    for bad in (None, [], {"result": 1}, {"stdout": None}, {"display": [{"mime": 1}]}):
        with pytest.raises(ValueError):
            eval_proc.checked_answer(bad)


def test_pipe_lines_are_joined_across_reads_and_an_overlong_one_is_dropped() -> None:
    read_lines = eval_proc.forkd_eval_worker.read_lines
    r, w = os.pipe()
    data = b"a" * 10 + b"\n" + b"x" * 300_000 + b"\nkept" + b"y" * 200_000 + b"\n\nlast"

    def write() -> None:
        os.write(w, data)
        os.close(w)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        lines = list(read_lines(r, 250_000))
    finally:
        writer.join()
        os.close(r)
    assert lines == [b"a" * 10, b"kept" + b"y" * 200_000, b""]  # an unended last line: none
