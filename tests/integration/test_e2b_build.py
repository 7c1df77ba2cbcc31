"""E2B's template builds (``Template.build`` of its own SDK) against the suite's real
daemon: the steps run in a real guest (files copied from the build's context, the
environment, working directory and user every sandbox of the template starts with, a
service started before the snapshot), and the template is an ordinary forkd snapshot."""

from __future__ import annotations

from pathlib import Path

import e2b
import pytest
from e2b import Template

from forkd.client import Controller

pytestmark = pytest.mark.integration

APP = "import os\nprint(os.environ['STAGE'], os.getcwd())\n"
READY = "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 8123)).close()\""
FETCH = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/lib/util.py').read().decode())\""


def test_a_template_built_through_e2b_runs_its_steps_in_a_real_guest(
    e2b_env: str, ctl: Controller, tmp_path: Path
) -> None:
    (tmp_path / "app.py").write_text(APP)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "util.py").write_text("X = 1\n")
    template = (
        Template(file_context_path=tmp_path)
        .from_template(e2b_env)
        .copy("app.py", "/srv/app/")
        .copy("lib", "/srv/app/lib")
        .set_envs({"STAGE": "built"})
        .set_workdir("/srv/app")
        .run_cmd("python3 app.py > out.txt")
        .set_user("nobody")
        .copy("app.py", "mine.py", mode=0o640)
        .set_start_cmd("python3 -m http.server 8123", READY)
    )
    logs: list[str] = []
    try:
        Template.build(template, "e2b-built", on_build_logs=lambda e: logs.append(e.message))
        assert ctl.snapshot_info("e2b-built")["status"] == "ready"  # a forkd snapshot
        sbx = e2b.Sandbox.create("e2b-built")
        try:
            run = sbx.commands.run
            assert run("cat out.txt").stdout == "built /srv/app\n"  # ENV, WORKDIR, RUN
            assert run("echo $STAGE; pwd; id -un").stdout == "built\n/srv/app\nnobody\n"
            assert sbx.files.read("/srv/app/lib/util.py") == "X = 1\n"  # a directory's COPY
            mine = sbx.files.get_info("/srv/app/mine.py")  # relative, after USER
            assert (mine.owner, mine.permissions) == ("nobody", "-rw-r-----")
            assert sbx.files.get_info("/srv/app/app.py").owner == "root"
            assert run(FETCH).stdout == "X = 1\n\n"  # the started server, warm in the fork
        finally:
            sbx.kill()
    except BaseException:
        print("\n".join(logs))
        raise
    finally:
        if any(s["tag"] == "e2b-built" for s in ctl.list_snapshots()):
            ctl.delete_snapshot("e2b-built")


def test_a_failing_step_fails_the_e2b_build_and_leaves_nothing(
    e2b_env: str, ctl: Controller
) -> None:
    before = {s["id"] for s in ctl.list_sandboxes()}
    template = Template().from_template(e2b_env).run_cmd("echo so far").run_cmd("exit 5")
    with pytest.raises(e2b.BuildException, match="exited 5"):
        Template.build(template, "e2b-broken")
    assert "e2b-broken" not in {s["tag"] for s in ctl.list_snapshots()}
    assert {s["id"] for s in ctl.list_sandboxes()} == before  # the build's fork is gone


def test_a_template_built_from_an_image_through_e2b(e2b_env: str, ctl: Controller) -> None:
    template = (
        Template()
        .from_image("python")
        .set_envs({"MADE": "from-image"})
        .run_cmd("echo $MADE > /made.txt")
    )
    try:
        Template.build(template, "e2b-from-image", memory_mb=256)
        sbx = e2b.Sandbox.create("e2b-from-image")
        try:
            assert sbx.commands.run("cat /made.txt; echo $MADE").stdout == (
                "from-image\nfrom-image\n"
            )
        finally:
            sbx.kill()
    finally:
        if any(s["tag"] == "e2b-from-image" for s in ctl.list_snapshots()):
            ctl.delete_snapshot("e2b-from-image")
