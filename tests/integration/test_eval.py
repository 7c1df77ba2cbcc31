"""Eval against a real daemon and real VMs: interrupt from another request, timeout_s,
display outputs, and the built-in python-data image (numpy and pandas warm in every
child, matplotlib figures as PNG)."""

from __future__ import annotations

import base64
import concurrent.futures
import time

import pytest

from forkd.client import Controller, EvalResult, Sandbox

pytestmark = pytest.mark.integration

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A real 1x1 PNG made with the standard library, shown through _repr_png_.
TINY_PNG_CLASS = """
import struct, zlib

def _chunk(kind, data):
    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))

class Dot:
    def _repr_png_(self):
        header = struct.pack('>IIBBBBB', 1, 1, 8, 2, 0, 0, 0)
        pixels = zlib.compress(b'\\x00\\xff\\x00\\x00')
        return (b'\\x89PNG\\r\\n\\x1a\\n' + _chunk(b'IHDR', header) + _chunk(b'IDAT', pixels)
                + _chunk(b'IEND', b''))
"""


def _interrupt_once_running(sb: Sandbox, marker: str, within_s: float = 60) -> float:
    """Interrupt the sandbox's eval once it created the file ``marker`` (so it is past
    its first lines); when the interrupt was asked for."""
    deadline = time.monotonic() + within_s
    while sb.controller.exec_command(sb.id, ["test", "-e", marker])["exit_code"] != 0:
        assert time.monotonic() < deadline, f"the eval never created {marker}"
        time.sleep(0.1)
    asked_at = time.monotonic()
    assert sb.interrupt() is True
    return asked_at


def test_interrupt_ends_a_long_sleep_and_keeps_the_interpreter(sb: Sandbox) -> None:
    sb.eval("before = 'kept'")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        code = "import time\nduring = 'set'\nopen('/tmp/sleeping', 'w').close()\ntime.sleep(600)"
        pending = pool.submit(sb.eval, code, 900)
        interrupted_at = _interrupt_once_running(sb, "/tmp/sleeping")
        result = pending.result(timeout=60)
        latency_s = time.monotonic() - interrupted_at
    print(f"interrupt: the eval answered {latency_s * 1000:.0f} ms after the interrupt was asked")
    assert latency_s < 10
    assert result.exit_code == 1 and "KeyboardInterrupt" in (result.error or "")
    assert "time.sleep(600)" in (result.error or "")
    assert sb.eval("before + ' ' + during").result == "'kept set'"
    assert sb.interrupt() is False  # nothing runs now


def test_an_interrupt_stays_in_its_own_sandbox(ctl: Controller, api_template: str) -> None:
    with (
        Sandbox(api_template, controller=ctl) as a,
        Sandbox(api_template, controller=ctl) as b,
        concurrent.futures.ThreadPoolExecutor(2) as pool,
    ):
        sleep = "import time\nopen('/tmp/sleeping', 'w').close()\ntime.sleep({})\n7"
        slow_a = pool.submit(a.eval, sleep.format(600), 900)
        slow_b = pool.submit(b.eval, sleep.format(5))
        _interrupt_once_running(a, "/tmp/sleeping")
        assert "KeyboardInterrupt" in (slow_a.result(timeout=60).error or "")
        b_result: EvalResult = slow_b.result(timeout=120)
    assert b_result.ok and b_result.result == "7", b_result.error


def test_timeout_s_stops_an_endless_loop(sb: Sandbox) -> None:
    start = time.monotonic()
    result = sb.eval("n = 0\nwhile True:\n    n += 1", timeout=2)
    took = time.monotonic() - start
    print(f"timeout_s=2: answered after {took:.2f} s")
    assert result.timed_out is True and result.exit_code == 1
    assert "EvalTimeout" in (result.error or "")
    assert took < 2 + 10
    assert int(sb.eval("n").result or "0") > 0  # the interpreter lives on


def test_display_of_an_object_with_a_png_repr(sb: Sandbox) -> None:
    sb.eval(TINY_PNG_CLASS)
    result = sb.eval("display(Dot())\nDot()")
    assert result.ok, result.error
    assert [d.mime for d in result.display] == ["image/png", "image/png"]  # display() and last
    assert all(d.content.startswith(PNG_SIGNATURE) for d in result.display)
    assert result.raw["display"][0]["data"] == base64.b64encode(result.display[0].content).decode()


def test_python_data_children_start_warm(ctl: Controller, pydata_template: str) -> None:
    with Sandbox(pydata_template, controller=ctl) as sb:
        # No import here: the recipe's warmup ran in the template.
        res = sb.eval("numpy.zeros(5).sum()")
        assert res.error is None, res.error
        assert res.result in ("0.0", "np.float64(0.0)")  # numpy 1 / numpy 2 repr
        res = sb.eval("pandas.DataFrame({'a': [1, 2, 3]})['a'].sum()")
        assert res.result in ("6", "np.int64(6)"), res.raw


def test_matplotlib_figures_come_back_as_png(ctl: Controller, pydata_template: str) -> None:
    with Sandbox(pydata_template, controller=ctl) as sb:
        started = time.monotonic()
        result = sb.eval("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('forkd')")
        print(f"plot in a fork: {time.monotonic() - started:.2f} s")
        assert result.ok, result.error
        assert [d.mime for d in result.display] == ["image/png"]
        assert result.display[0].content.startswith(PNG_SIGNATURE)
        assert sb.eval("len(plt.get_fignums())").result == "0"  # closed once shown
        assert sb.eval("import matplotlib\nmatplotlib.get_backend().lower()").result == "'agg'"
