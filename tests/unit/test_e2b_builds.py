"""E2B's template builds (its SDK's ``Template.build``) against forkd's E2B port with fake
VMs: the SDK's own flow (request, upload links, files, start, status polled), each build
an ordinary forkd snapshot, and the refusals: a build forkd cannot run, an upload link
it did not sign, a name that is taken."""

from __future__ import annotations

import hashlib
from pathlib import Path

import e2b
import httpx
import pytest
from e2b import Template

from forkd.controller.e2b.builds import MAX_LINE_CHARS, MAX_LOG_CHARS, MAX_LOG_ENTRIES, Build
from tests.unit.conftest import TOKEN, Server
from tests.unit.e2b_port import UPLOAD_LIMIT
from tests.unit.e2b_port import forkd_client as _forkd


def _context(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text("print('hi')\n")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "util.py").write_text("X = 1\n")
    return tmp_path


def test_a_template_built_from_a_template_is_a_forkd_snapshot(
    server: Server, e2b_url: str, tmp_path: Path
) -> None:
    template = (
        Template(file_context_path=_context(tmp_path))
        .from_template("base")
        .copy("app.py", "/app/")
        .copy("lib", "/app/lib")
        .set_envs({"STAGE": "built"})
        .set_workdir("/app")
        .run_cmd("echo built")
    )
    logs: list[str] = []
    info = Template.build(template, "built", on_build_logs=lambda e: logs.append(e.message))
    assert info.template_id == "built" and info.build_id
    assert any("COPY app.py /app/" in line for line in logs)
    assert any("template 'built' is ready" in line for line in logs)
    with _forkd(server) as c:
        snap = c.get("/v1/snapshots/built").json()
        assert snap["status"] == "ready"
        assert c.get("/v1/sandboxes").json() == []  # the build's sandbox is gone
    assert Template.exists("built")
    sbx = e2b.Sandbox.create("built")
    assert sbx.get_info().template_id == "built"
    sbx.kill()


def test_a_template_built_from_an_image_is_forkds_template_build(
    server: Server, e2b_url: str
) -> None:
    template = Template().from_image("python").run_cmd("echo one").set_user("root")
    Template.build(template, "from-image")
    with _forkd(server) as c:
        snap = c.get("/v1/snapshots/from-image").json()
    assert snap["status"] == "ready" and snap["metadata"]["e2b-build"]


def test_a_failed_step_fails_the_build_at_that_step(server: Server, e2b_url: str) -> None:
    template = Template().from_template("base").run_cmd("echo fine").run_cmd("false")
    with pytest.raises(e2b.BuildException, match="exited 1"):
        Template.build(template, "broken")
    with _forkd(server) as c:
        assert c.get("/v1/snapshots/broken").status_code == 404  # nothing kept
        assert c.get("/v1/sandboxes").json() == []


def test_a_taken_name_and_tags_are_refused_before_anything_runs(
    server: Server, e2b_url: str
) -> None:
    template = Template().from_template("base").run_cmd("echo x")
    with pytest.raises(e2b.BuildException, match="exists"):
        Template.build(template, "base")
    with pytest.raises(e2b.BuildException, match="tags"):
        Template.build(template, "other:v2")
    with pytest.raises(e2b.BuildException, match="no template"):
        Template.build(Template().from_template("nope").run_cmd("true"), "other")


def test_upload_links_are_signed_and_bounded(server: Server, e2b_url: str) -> None:
    key = {"X-API-Key": TOKEN}
    with httpx.Client(base_url=e2b_url) as c:
        opened = c.post("/v3/templates", json={"name": "uploaded"}, headers=key)
        assert opened.status_code == 202, opened.text
        build = opened.json()["buildID"]
        digest = hashlib.sha256(b"files").hexdigest()
        assert c.get(f"/templates/uploaded/files/{digest}").status_code == 401  # no key
        assert c.get("/templates/uploaded/files/not-hex", headers=key).status_code == 400
        link = c.get(f"/templates/uploaded/files/{digest}", headers=key).json()
        assert link["present"] is False and link["url"].startswith(e2b_url)
        forged = link["url"].replace("signature=", "signature=0")
        assert c.put(forged, content=b"tar").status_code == 404
        assert (
            c.put(link["url"].replace("signature=", "signature=%C3%A9"), content=b"t").status_code
            == 404
        )
        other = hashlib.sha256(b"other").hexdigest()
        assert c.put(link["url"].replace(digest, other), content=b"tar").status_code == 404
        assert c.put(link["url"], content=b"tar").status_code == 200
        state_dir = server.app.state.services.settings.state_dir
        assert (state_dir / "e2b-builds" / build / digest).read_bytes() == b"tar"
        again = c.get(f"/templates/uploaded/files/{digest}", headers=key).json()
        assert again["present"] is True
        start = c.post(
            f"/v2/templates/uploaded/builds/{build}",
            json={"fromTemplate": "base", "steps": [{"type": "HEALTHCHECK", "args": []}]},
            headers=key,
        )
        assert start.status_code == 400 and "HEALTHCHECK" in start.json()["message"]
        missing = c.post(
            f"/v2/templates/uploaded/builds/{build}",
            json={
                "fromTemplate": "base",
                "steps": [{"type": "COPY", "args": ["a", "/a"], "filesHash": "f" * 64}],
            },
            headers=key,
        )
        assert missing.status_code == 400 and "not uploaded" in missing.json()["message"]
        status = c.get(f"/templates/uploaded/builds/{build}/status", headers=key).json()
        assert status["status"] == "waiting"  # refused starts changed nothing
        assert c.get(f"/templates/uploaded/builds/{'0' * 8}/status", headers=key).status_code == 404


def test_an_upload_past_the_limit_is_refused_and_not_kept(server: Server, e2b_url: str) -> None:
    key = {"X-API-Key": TOKEN}
    with httpx.Client(base_url=e2b_url) as c:
        opened = c.post("/v3/templates", json={"name": "big"}, headers=key).json()
        digest = hashlib.sha256(b"big").hexdigest()
        link = c.get(f"/templates/big/files/{digest}", headers=key).json()
        refused = c.put(link["url"], content=b"x" * (UPLOAD_LIMIT + 1))
        assert refused.status_code in (400, 413), refused.text
        again = c.get(f"/templates/big/files/{digest}", headers=key).json()
        assert again["present"] is False
        status = c.get(f"/templates/big/builds/{opened['buildID']}/status", headers=key)
        assert status.json()["status"] == "waiting"
    state_dir = server.app.state.services.settings.state_dir
    kept = list((state_dir / "e2b-builds").rglob("*"))
    assert [p for p in kept if p.is_file()] == []


def test_a_builds_log_is_bounded_and_says_so() -> None:
    build = Build("t", None, None)
    for _ in range(MAX_LOG_ENTRIES + 50):
        build.log("line")
    assert len(build.entries) == MAX_LOG_ENTRIES + 1
    assert build.entries[-1]["message"] == "(the rest of the build's log was cut)"
    huge = Build("t", None, None)
    for _ in range(1000):
        huge.log("x" * 100_000)  # each line cut to MAX_LINE_CHARS
    assert sum(len(e["message"]) for e in huge.entries) <= MAX_LOG_CHARS + MAX_LINE_CHARS
    huge.fail("it broke", "3")
    assert huge.entries[-1]["message"] == "it broke" and huge.reason == {
        "message": "it broke",
        "step": "3",
    }


def test_a_build_sandbox_a_restart_left_is_killed_at_the_next_build(
    server: Server, e2b_url: str
) -> None:
    with _forkd(server) as c:
        left = {"snapshot_tag": "base", "metadata": {"e2b-build": "a-build-of-an-earlier-run"}}
        [orphan] = c.post("/v1/sandboxes", json=left).json()
        [mine] = c.post("/v1/sandboxes", json={"snapshot_tag": "base"}).json()
    with httpx.Client(base_url=e2b_url) as c:
        opened = c.post("/v3/templates", json={"name": "next"}, headers={"X-API-Key": TOKEN})
        assert opened.status_code == 202
    with _forkd(server) as c:
        alive = {s["id"] for s in c.get("/v1/sandboxes").json() if s["state"] != "dead"}
    assert orphan["id"] not in alive and mine["id"] in alive
