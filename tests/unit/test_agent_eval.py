"""Eval in the guest agent (src/forkd/guest/files/forkd_eval.py): interrupt, timeout, display.

Interrupts and timeouts are tested on a real agent process serving a unix
socket, where evals run on its main thread as in the guest; display's pieces
are tested on the module itself.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.unit.test_agent import AGENT, Client, _agent_env, _stop

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _load_eval_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "forkd_eval_under_test", AGENT.parent / "forkd_eval.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


forkd_eval = _load_eval_module()


def _start_agent(path: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, str(AGENT), "--socket", str(path)], env=_agent_env())
    deadline = time.monotonic() + 10
    while True:
        try:
            Client(path).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc)
                raise
            time.sleep(0.02)


@pytest.fixture(scope="module")
def agent_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("eval-agent") / "agent.sock"
    proc = _start_agent(path)
    try:
        yield path
    finally:
        _stop(proc)


@pytest.fixture
def agent(agent_path: Path) -> Iterator[Client]:
    client = Client(agent_path, timeout=30)
    yield client
    client.close()


def _interrupt_once_at(agent: Client, marker: Path, within_s: float = 10) -> float:
    """Interrupt the eval in flight once it created ``marker`` (it is past its first
    lines); the monotonic time the interrupt was answered."""
    deadline = time.monotonic() + within_s
    while not marker.exists():
        assert time.monotonic() < deadline, "the eval never created its marker"
        time.sleep(0.01)
    assert agent.result("eval_interrupt") == {"interrupted": True}
    return time.monotonic()


# ----------------------------------------------------------------------------- interrupt


def test_interrupt_ends_a_sleep_with_keyboard_interrupt_and_keeps_the_state(
    agent: Client, agent_path: Path, tmp_path: Path
) -> None:
    agent.result("eval", code="kept_before = 41")
    marker = tmp_path / "sleeping"
    code = f"import time\nset_in_the_eval = 1\nopen({str(marker)!r}, 'w').close()\ntime.sleep(1000)"
    req_id = agent.send("eval", code=code)
    with contextlib.closing(Client(agent_path)) as other:  # another connection
        interrupted_at = _interrupt_once_at(other, marker)
    answer = agent.wait(req_id)["result"]
    assert time.monotonic() - interrupted_at < 2
    assert answer["exit_code"] == 1 and answer["timed_out"] is False
    assert answer["error"].rstrip().endswith("KeyboardInterrupt")
    assert "time.sleep(1000)" in answer["error"]  # the user's line, not the agent's
    assert "forkd_eval" not in answer["error"]
    assert agent.result("eval", code="kept_before + set_in_the_eval")["result"] == "42"


def test_interrupt_ends_a_blocking_socket_read(agent: Client, tmp_path: Path) -> None:
    marker = tmp_path / "reading"
    code = f"import socket\na, b = socket.socketpair()\nopen({str(marker)!r}, 'w').close()\n"
    code += "a.recv(1)"
    req_id = agent.send("eval", code=code)
    _interrupt_once_at(agent, marker)  # the same connection: requests run concurrently
    answer = agent.wait(req_id)["result"]
    assert "KeyboardInterrupt" in answer["error"]
    assert agent.result("eval", code="a.close(); b.close(); 'closed'")["result"] == "'closed'"


def test_interrupt_with_nothing_running_says_so(agent: Client) -> None:
    assert agent.result("eval_interrupt") == {"interrupted": False}
    assert agent.result("eval", code="1 + 1")["result"] == "2"  # no late interrupt lands here


def test_evals_run_on_the_main_thread(agent: Client) -> None:
    code = "import threading\nthreading.current_thread() is threading.main_thread()"
    assert agent.result("eval", code=code)["result"] == "True"


# ----------------------------------------------------------------------------- timeout


def test_timeout_interrupts_an_endless_loop(agent: Client) -> None:
    start = time.monotonic()
    answer = agent.result("eval", code="spins = 0\nwhile True:\n    spins += 1", timeout_s=1)
    assert time.monotonic() - start < 4
    assert answer["timed_out"] is True and answer["exit_code"] == 1
    assert "EvalTimeout" in answer["error"] and "timeout of 1 s" in answer["error"]
    assert int(agent.result("eval", code="spins")["result"]) > 0


def test_timeout_stops_code_that_swallows_keyboard_interrupt(agent: Client) -> None:
    code = (
        "import time\nwhile True:\n    try:\n        time.sleep(0.05)\n"
        "    except KeyboardInterrupt:\n        pass"
    )
    start = time.monotonic()
    answer = agent.result("eval", code=code, timeout_s=0.5)
    assert time.monotonic() - start < 3
    assert answer["timed_out"] is True and "EvalTimeout" in answer["error"]


def test_an_eval_that_never_stops_is_answered_and_later_evals_time_out_behind_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "agent.sock"
    proc = _start_agent(path)
    try:
        client = Client(path, timeout=30)
        stubborn = (
            "import time\nend = time.monotonic() + 6.5\nwhile time.monotonic() < end:\n"
            "    try:\n        time.sleep(0.05)\n    except BaseException:\n        pass"
        )
        start = time.monotonic()
        answer = client.result("eval", code=stubborn, timeout_s=0.5)
        grace = forkd_eval.STOP_GRACE_S
        assert grace <= time.monotonic() - start < grace + 3
        assert answer["timed_out"] is True and "did not stop" in answer["error"]
        queued = client.result("eval", code="'ran'", timeout_s=0.3)
        assert queued["timed_out"] is True and "waiting behind" in queued["error"]
        assert client.result("eval", code="'ran'", timeout_s=10)["result"] == "'ran'"
        client.close()
    finally:
        _stop(proc)


@pytest.mark.parametrize("bad", [0, -1, 1e9, "5", True, float("nan")])
def test_bad_timeout_is_a_request_error(agent: Client, bad: Any) -> None:
    answer = agent.call("eval", code="1", timeout_s=bad)
    assert answer["ok"] is False and answer["kind"] == "ValueError"
    assert "'timeout_s'" in answer["error"]


# ----------------------------------------------------------------------------- display


RICH_CLASSES = """
class Png:
    def _repr_png_(self):
        return b'\\x89PNG\\r\\n\\x1a\\nfake'
    def _repr_html_(self):
        return '<b>not chosen: png is richer</b>'

class Html:
    def _repr_html_(self):
        return '<b>bold</b>'

class Broken:
    def _repr_html_(self):
        raise RuntimeError('no html today')
"""


def test_display_shows_each_object_in_its_richest_form(agent: Client) -> None:
    agent.result("eval", code=RICH_CLASSES)
    answer = agent.result("eval", code="display(Png(), Html(), [1, 2])\ndisplay(Broken)\nBroken()")
    mimes = [item["mime"] for item in answer["display"]]
    assert mimes == ["image/png", "text/html", "text/plain", "text/plain"]
    png = base64.b64decode(answer["display"][0]["data"])
    assert png.startswith(PNG_SIGNATURE)
    assert answer["display"][1]["data"] == "<b>bold</b>"
    assert answer["display"][2]["data"] == "[1, 2]"
    assert answer["display"][3]["data"] == "<class '__main__.Broken'>"  # a class: its repr
    assert "no html today" in answer["stderr"]  # the last value's failing repr is reported
    assert answer["error"] is None and answer["result"].startswith("<__main__.Broken object")


def test_a_rich_last_value_is_displayed_beside_its_repr(agent: Client) -> None:
    agent.result("eval", code=RICH_CLASSES)
    answer = agent.result("eval", code="Html()")
    assert answer["display"] == [{"mime": "text/html", "data": "<b>bold</b>"}]
    assert answer["result"].startswith("<__main__.Html object")
    assert agent.result("eval", code="42")["display"] == []


def test_open_matplotlib_figures_come_back_as_png_and_are_closed(agent: Client) -> None:
    """A stand-in for matplotlib.pyplot: the agent only calls what pyplot offers."""
    fake_pyplot = """
import sys, types
class Figure:
    def savefig(self, buf, format):
        buf.write(b'\\x89PNG\\r\\n\\x1a\\n' + format.encode())
Figure.__module__ = 'matplotlib.figure'
figures = {1: Figure(), 2: Figure()}
pyplot = types.ModuleType('matplotlib.pyplot')
pyplot.get_fignums = lambda: sorted(figures)
pyplot.figure = lambda number: figures[number]
pyplot.close = lambda fig: figures.pop(next(n for n, f in figures.items() if f is fig))
sys.modules['matplotlib.pyplot'] = pyplot
display(figures[2])  # shown once, not again at the end
"""
    try:
        answer = agent.result("eval", code=fake_pyplot)
        assert [item["mime"] for item in answer["display"]] == ["image/png"] * 2
        for item in answer["display"]:
            assert base64.b64decode(item["data"]) == PNG_SIGNATURE + b"png"
        assert agent.result("eval", code="len(figures)")["result"] == "0"
    finally:
        agent.result("eval", code="del sys.modules['matplotlib.pyplot']")


def test_matplotlib_backend_is_agg(agent: Client) -> None:
    assert agent.result("eval", code="import os\nos.environ['MPLBACKEND']")["result"] == "'Agg'"


def test_display_is_capped_with_a_marker() -> None:
    displays = forkd_eval.Displays(cap=120)
    displays.add("text/plain", "a" * 30)
    displays.add("text/html", "b" * 200)  # over the cap: dropped
    displays.add("text/plain", "c" * 10)  # still fits
    items = displays.items()
    assert [item["data"][:1] for item in items[:2]] == ["a", "c"]
    assert displays.truncated is True
    assert items[-1]["mime"] == "text/plain"
    assert items[-1]["data"] == "[display truncated: 1 output(s) dropped past 120 bytes]"


def test_display_total_is_capped_through_the_agent(agent: Client) -> None:
    big = forkd_eval.MAX_DISPLAY_BYTES // 3
    code = f"class Big:\n    def _repr_html_(self):\n        return 'x' * {big}\n"
    answer = agent.result("eval", code=code + "for _ in range(4):\n    display(Big())")
    assert answer["display_truncated"] is True
    assert len(answer["display"]) == 3  # two fit, then the marker
    assert "truncated" in answer["display"][-1]["data"]


# ----------------------------------------------------------------------------- peek


def test_a_running_eval_can_be_peeked_for_what_it_printed_so_far(
    agent: Client, agent_path: Path, tmp_path: Path
) -> None:
    """E2B's code interpreter streams an eval's output as it comes: eval_peek gives what
    the eval of a tag printed past an offset while it runs, and nothing for another tag."""
    marker = tmp_path / "printed"
    code = (
        f"import sys, time\nprint('first')\nprint('warn', file=sys.stderr)\n"
        f"open({str(marker)!r}, 'w').close()\ntime.sleep(1.5)\nprint('second')"
    )
    req_id = agent.send("eval", code=code, tag="run-1")
    with contextlib.closing(Client(agent_path)) as other:
        deadline = time.monotonic() + 10
        while not marker.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        peek = other.result("eval_peek", tag="run-1", stdout_from=0, stderr_from=0)
        assert peek == {"running": True, "stdout": "first\n", "stderr": "warn\n"}
        later = other.result("eval_peek", tag="run-1", stdout_from=6, stderr_from=5)
        assert later == {"running": True, "stdout": "", "stderr": ""}
        assert other.result("eval_peek", tag="other", stdout_from=0, stderr_from=0) == {
            "running": False,
            "stdout": "",
            "stderr": "",
        }
    answer = agent.wait(req_id)["result"]
    assert answer["stdout"] == "first\nsecond\n"
    done = agent.result("eval_peek", tag="run-1", stdout_from=0, stderr_from=0)
    assert done["running"] is False
