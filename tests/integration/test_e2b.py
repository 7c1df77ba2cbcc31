"""E2B's own SDK (``e2b``, sync and async) against the suite's real daemon and its E2B
port: a sandbox forked from the ``py`` template runs commands in a real guest, streams
their output, takes stdin, and its files are listed, made, moved and watched through
the guest kernel's own notifications; every sandbox is an ordinary forkd sandbox."""

from __future__ import annotations

import asyncio
import base64
import threading
import time

import e2b
import pytest
from e2b import FilesystemEventType, FileType, PtySize

from forkd.client import Controller

from .conftest import Daemon

pytestmark = pytest.mark.integration


def test_e2b_commands_and_files_in_a_real_guest(e2b_env: str, ctl: Controller) -> None:
    sbx = e2b.Sandbox.create(e2b_env, timeout=300, envs={"GREETING": "hello env"})
    try:
        assert sbx.sandbox_id in {s["id"] for s in ctl.list_sandboxes()}  # a forkd sandbox
        assert sbx.commands.run("echo $GREETING").stdout == "hello env\n"  # envVars
        run = sbx.commands.run("echo $((40 + 2)) && python3 -c 'print(6 * 7)'")
        assert (run.exit_code, run.stdout) == (0, "42\n42\n"), run
        lines: list[str] = []
        sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=lines.append)
        assert "".join(lines) == "1\n2\n3\n"
        with pytest.raises(e2b.CommandExitException) as failed:
            sbx.commands.run("echo oops >&2; exit 7")
        assert (failed.value.exit_code, failed.value.stderr) == (7, "oops\n")

        cat = sbx.commands.run("cat", background=True, stdin=True)
        sbx.commands.send_stdin(cat.pid, "through stdin")
        sbx.commands.close_stdin(cat.pid)
        assert cat.wait().stdout == "through stdin"

        files = sbx.files
        assert files.make_dir("/work/e2b/src") is True
        files.write("/work/e2b/src/app.py", "print('hi')\n")
        assert files.read("/work/e2b/src/app.py") == "print('hi')\n"
        info = files.get_info("/work/e2b/src/app.py")
        assert (info.type, info.size, info.owner) == (FileType.FILE, 12, "root")
        files.write("/tmp/theirs.txt", "owned", user="nobody")  # envd writes as the user
        assert files.get_info("/tmp/theirs.txt").owner == "nobody"
        with pytest.raises(e2b.SandboxException):
            files.write("/tmp/nobodys.txt", "x", user="no-such-user")
        assert not files.exists("/tmp/nobodys.txt")  # refused before anything was written
        assert [e.path for e in files.list("/work/e2b", depth=2)] == [
            "/work/e2b/src",
            "/work/e2b/src/app.py",
        ]
        files.rename("/work/e2b/src", "/work/e2b/lib")
        assert sbx.commands.run("python3 /work/e2b/lib/app.py").stdout == "hi\n"

        watch = files.watch_dir("/work/e2b", recursive=True)
        sbx.commands.run("touch /work/e2b/new.txt && echo more >> /work/e2b/lib/app.py")
        seen: set[tuple[str, FilesystemEventType]] = set()
        deadline = time.monotonic() + 20
        while (
            time.monotonic() < deadline
            and not {
                ("new.txt", FilesystemEventType.CREATE),
                ("lib/app.py", FilesystemEventType.WRITE),
            }
            <= seen
        ):
            seen |= {(e.name, e.type) for e in watch.get_new_events()}
            time.sleep(0.2)
        watch.stop()
        assert ("new.txt", FilesystemEventType.CREATE) in seen, seen
        assert ("lib/app.py", FilesystemEventType.WRITE) in seen, seen
        files.remove("/work/e2b")
        assert not files.exists("/work/e2b")
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in {s["id"] for s in ctl.list_sandboxes()}


def test_a_pty_through_e2bs_sdk_is_a_real_terminal(e2b_env: str) -> None:
    sbx = e2b.Sandbox.create(e2b_env, timeout=300)
    try:
        seen = bytearray()
        term = sbx.pty.create(PtySize(rows=24, cols=80), timeout=0)
        ended: list[int] = []

        def follow() -> None:
            try:
                term.wait(on_pty=seen.extend)
            except e2b.CommandExitException as exc:  # killed below
                ended.append(exc.exit_code)

        thread = threading.Thread(target=follow, daemon=True)
        thread.start()
        sbx.pty.send_stdin(term.pid, b"stty size; echo marker-$((6 * 7))\n")
        deadline = time.monotonic() + 30
        while b"marker-42" not in seen and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b"24 80" in seen and b"marker-42" in seen, bytes(seen)[-400:]
        sbx.pty.resize(term.pid, PtySize(rows=30, cols=100))
        sbx.pty.send_stdin(term.pid, b"stty size\n")
        while b"30 100" not in seen and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b"30 100" in seen, bytes(seen)[-400:]
        assert sbx.pty.kill(term.pid) is True
        thread.join(10)
        assert ended == [128 + 9]  # the terminal's stream ends with the kill
    finally:
        sbx.kill()


def test_the_async_sdk_streams_a_watch_of_a_real_guest(e2b_env: str) -> None:
    async def run() -> list[tuple[str, FilesystemEventType]]:
        sbx = await e2b.AsyncSandbox.create(e2b_env, timeout=300)
        try:
            seen: list[tuple[str, FilesystemEventType]] = []
            await sbx.files.make_dir("/work/watched")
            handle = await sbx.files.watch_dir(
                "/work/watched", on_event=lambda e: seen.append((e.name, e.type))
            )
            await sbx.commands.run("echo hi > /work/watched/a.txt")
            deadline = time.monotonic() + 20
            while ("a.txt", FilesystemEventType.CREATE) not in seen and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await handle.stop()
            return seen
        finally:
            await sbx.kill()

    assert ("a.txt", FilesystemEventType.CREATE) in asyncio.run(run())


PLOT = """
import matplotlib.pyplot as plt
plt.plot([1, 2, 3], [1, 4, 9])
plt.show()
"""


def test_the_code_interpreter_starts_warm_and_returns_a_real_png(
    daemon: Daemon, pydata_template: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """E2B's code interpreter SDK on a fork of a python-data template: the interpreter
    its template warmed (numpy, pandas, matplotlib imported) is the fork's, a figure
    comes back as a PNG, an error as E2B's."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    for name in ("E2B_API_URL", "E2B_SANDBOX_URL"):
        monkeypatch.setenv(name, daemon.e2b_url)
    monkeypatch.setenv("E2B_API_KEY", daemon.token)
    sbx = CodeSandbox.create(pydata_template, timeout=300)
    try:
        warm = sbx.run_code("numpy.arange(4).sum()")  # no import: the template's warmup did
        assert warm.error is None and warm.text in ("6", "np.int64(6)"), warm
        plot = sbx.run_code(PLOT)
        assert plot.error is None, plot.error
        [png] = [r.png for r in plot.results if r.png]
        assert base64.b64decode(png).startswith(b"\x89PNG\r\n\x1a\n")
        failed = sbx.run_code("undefined_name")
        assert failed.error is not None and failed.error.name == "NameError"
        # Output streams as it comes: the first line arrives well before the end.
        arrived: list[tuple[str, float]] = []
        started = time.monotonic()
        sbx.run_code(
            "import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(1)",
            on_stdout=lambda m: arrived.append((m.line, time.monotonic() - started)),
        )
        ended = time.monotonic() - started
        assert "".join(line for line, _ in arrived) == "0\n1\n2\n"
        assert arrived[0][1] < ended - 1.5, (arrived, ended)
    finally:
        sbx.kill()


def test_code_contexts_of_their_own_in_a_real_guest(e2b_env: str) -> None:
    """A second Python context is a worker of its own in the guest: its own names and
    directory, restarted fresh; the warm default context is untouched."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(e2b_env, timeout=300)
    try:
        assert sbx.run_code("x = 'warm'").error is None
        ctx = sbx.create_code_context(language="python", cwd="/tmp")
        mine = sbx.run_code("import os\nx = 'mine'\nprint(os.getcwd())\nx", context=ctx)
        assert mine.error is None, mine.error
        assert (mine.text, mine.logs.stdout) == ("'mine'", ["/tmp\n"])
        assert sbx.run_code("x").text == "'warm'"  # the default context's own
        sbx.restart_code_context(ctx)
        fresh = sbx.run_code("x", context=ctx)
        assert fresh.error is not None and fresh.error.name == "NameError"
        envs = {"E2B_RUN": "only now"}
        assert sbx.run_code("import os\nos.environ['E2B_RUN']", envs=envs).text == "'only now'"
        assert sbx.run_code("os.environ.get('E2B_RUN')").text is None  # put back
        shell = sbx.run_code("echo $E2B_RUN", language="bash", envs=envs)
        assert shell.logs.stdout == ["only now\n"]
        no_node = sbx.run_code("1 + 1", language="js")  # the python image has no node
        assert no_node.error is not None and "node" in no_node.error.value
    finally:
        sbx.kill()


def test_javascript_runs_where_the_image_has_node(e2b_env: str, ctl: Controller) -> None:
    """run_code(language="js") in a template of an image with Node.js (the egress
    tests' clients image): its globals kept between executions, errors as E2B's."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    from forkd.guest import image as guest_image

    from .test_egress import CLIENTS

    ctl.create_snapshot("e2b-node", image=guest_image.build(recipe_dir=CLIENTS).name)
    try:
        sbx = CodeSandbox.create("e2b-node", timeout=300)
        try:
            ran = sbx.run_code(
                "const a = [1, 2]\nconsole.log('js')\na.map((x) => x * 21)", language="js"
            )
            assert ran.error is None, ran.error
            assert (ran.logs.stdout, ran.text) == (["js\n"], "[ 21, 42 ]")
            assert sbx.run_code("a.length", language="javascript").text == "2"
            env = sbx.run_code("process.env.JS_RUN", language="js", envs={"JS_RUN": "yes"})
            assert env.text == "'yes'"
            assert sbx.run_code("process.env.JS_RUN", language="js").text is None
            failed = sbx.run_code("null.x", language="js")
            assert failed.error is not None and failed.error.name == "TypeError"
        finally:
            sbx.kill()
    finally:
        ctl.delete_snapshot("e2b-node")


def test_e2b_lifecycle_in_a_real_guest(e2b_env: str, ctl: Controller, daemon: Daemon) -> None:
    """Through E2B's SDK, on a real guest: a large file both ways, a command's timeout and
    a kill while it runs, pause and connect (hibernate, wake), a snapshot a sandbox is
    created from, and a fork of two."""
    sbx = e2b.Sandbox.create(e2b_env, timeout=300)
    made: list[e2b.Sandbox] = []
    try:
        big = bytes(range(256)) * (32 << 10)  # 8 MiB, every byte value
        sbx.files.write("/tmp/big.bin", big)
        assert sbx.files.read("/tmp/big.bin", format="bytes") == big
        with pytest.raises(e2b.TimeoutException):
            sbx.commands.run("sleep 30", timeout=2)
        running = sbx.commands.run("sleep 300", background=True)
        assert sbx.commands.kill(running.pid) is True
        with pytest.raises(e2b.CommandExitException):
            running.wait()
        sbx.commands.run("echo kept > /tmp/state")
        assert sbx.pause() is True
        assert ctl.get_sandbox(sbx.sandbox_id)["state"] == "hibernated"
        again = e2b.Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run("cat /tmp/state").stdout == "kept\n"  # its disk came back
        snapshot = sbx.create_snapshot()
        made.append(e2b.Sandbox.create(snapshot.snapshot_id, timeout=120))
        assert made[0].commands.run("cat /tmp/state").stdout == "kept\n"
        forks = sbx.fork(count=2)
        assert all(isinstance(f, e2b.Sandbox) for f in forks), forks
        made += [f for f in forks if isinstance(f, e2b.Sandbox)]
        assert len({f.sandbox_id for f in made[1:]}) == 2
        for child in made[1:]:
            assert child.commands.run("cat /tmp/state").stdout == "kept\n"
    except BaseException:
        print((daemon.root / "daemon.log").read_text()[-6000:])  # why, when it fails
        raise
    finally:
        for child in made:
            child.kill()
        sbx.kill()
        for snap in ctl.list_snapshots():
            if snap.get("branched_from") == sbx.sandbox_id:
                ctl.delete_snapshot(snap["tag"], cascade=True)
