"""Issue 36, items 10 and 14 to 17: the original forkd's command line, written from its
documented usage (its README, docs and --help), against the real daemon app over the
fake VM driver: kill by sandbox id, --all and --tag; spawn, ls, ping, where, images,
from-image, workspace; --daemon-url and --daemon-token after any verb; the original's
snapshot, fork, exec and eval flags; rmi's HTTP 409; snapshot-compact's flat result; and
what this command line adds for the same users (-o json, --sh, close matches)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from forkd.client import Controller
from tests.unit.conftest import Invoke, RecordingTransport, Server, make_app

runner = CliRunner()


@pytest.fixture
def forkd(server: Server, sent: RecordingTransport) -> Invoke:
    """The original's way: FORKD_URL and FORKD_TOKEN (no token file) in the environment."""
    app = make_app(sent)
    env = {"FORKD_URL": server.url, "FORKD_TOKEN": server.token}
    return lambda *args: runner.invoke(app, list(args), env=env)


def _ids(ctl: Controller) -> set[str]:
    return {sb["id"] for sb in ctl.list_sandboxes()}


def test_kill_takes_sandbox_ids_all_and_tag(forkd: Invoke, ctl: Controller, py: str) -> None:
    ctl.create_snapshot("other", memory_mib=128)
    a, b, c = (sb["id"] for sb in ctl.spawn_sandboxes(py, n=3))
    (o,) = (sb["id"] for sb in ctl.spawn_sandboxes("other", n=1))
    res = forkd("kill", a, b)
    assert res.exit_code == 0, res.output
    assert _ids(ctl) == {c, o}
    res = forkd("kill", "--tag", py)
    assert res.exit_code == 0 and _ids(ctl) == {o}
    res = forkd("kill", "--tag", py)
    assert res.exit_code == 0 and "no matching sandboxes" in res.stderr
    res = forkd("kill", "--all")
    assert res.exit_code == 0 and _ids(ctl) == set()
    res = forkd("kill")
    assert res.exit_code == 1 and "--all or --tag" in res.stderr
    assert forkd("kill", "--all", "--tag", py).exit_code == 2


def test_kill_with_a_process_id_signals_that_process(
    forkd: Invoke, ctl: Controller, sent: RecordingTransport, sid: str
) -> None:
    pid = ctl.start_process(sid, ["sleep", "60"])["pid"]
    res = forkd("kill", sid, str(pid), "-s", "KILL")
    assert res.exit_code == 0, res.output
    signals = [r for r in sent.requests if r.url.path.endswith(f"/processes/{pid}/signal")]
    assert signals and json.loads(signals[-1].content)["signal"] == "KILL"
    assert sid in _ids(ctl)  # the sandbox lives on


def test_spawn_and_ls(forkd: Invoke, ctl: Controller, py: str) -> None:
    res = forkd("spawn", "--tag", py, "--n", "2", "--per-child-netns", "--memory-limit-mib", "256")
    assert res.exit_code == 0, res.output
    lines = [line for line in res.stdout.splitlines() if line.strip()]
    assert len(lines) == 2 and all(line.startswith("  \u2713 sb-") for line in lines)
    assert "--per-child-netns is accepted and has no effect" in res.stderr
    made = ctl.list_sandboxes()
    assert {sb["memory_limit_mib"] for sb in made} == {256}
    res = forkd("ls")
    assert res.exit_code == 0 and all(sb["id"] in res.stdout for sb in made)
    assert "2 sandboxes" in res.stdout
    assert forkd("kill", "--all").exit_code == 0
    res = forkd("ls")
    assert res.exit_code == 0 and "no live sandboxes" in res.stderr


def test_the_connection_flags_come_after_any_verb(
    server: Server, sent: RecordingTransport, py: str
) -> None:
    app = make_app(sent)
    res = runner.invoke(
        app, ["ls", "--daemon-url", server.url, "--daemon-token", server.token], env={}
    )
    assert res.exit_code == 0, res.output
    assert sent.requests[-1].headers["authorization"] == f"Bearer {server.token}"
    res = runner.invoke(
        app,
        [
            "snapshot",
            "ls",
            "-o",
            "json",
            "--daemon-url",
            server.url,
            "--daemon-token",
            server.token,
        ],
        env={},
    )
    assert res.exit_code == 0, res.output
    assert [s["tag"] for s in json.loads(res.stdout)] == [py]
    res = runner.invoke(app, ["ls", "--daemon-url", server.url, "--daemon-token", "wrong"], env={})
    assert res.exit_code == 1 and "--token-file" in res.stderr  # the 401's hint


def test_snapshot_from_sandbox_takes_the_originals_flags(
    forkd: Invoke, ctl: Controller, sent: RecordingTransport, sid: str, py: str
) -> None:
    res = forkd("snapshot", "--from-sandbox", sid, "--tag", "d1", "--diff")
    assert res.exit_code == 0, res.output
    assert json.loads(sent.requests[-1].content)["mode"] == "diff"
    assert ctl.snapshot_info("d1")["mode"] == "diff"
    res = forkd("snapshot", "--from-sandbox", sid, "--tag", "l1", "--live", "--no-wait")
    assert res.exit_code == 0, res.output
    body = json.loads(sent.requests[-1].content)
    assert body["mode"] == "live" and body["wait"] is False
    assert forkd("snapshot", "--diff", "--live", "--from-sandbox", sid).exit_code == 2
    assert forkd("snapshot", "--diff").exit_code == 2  # needs --from-sandbox
    res = forkd("snapshot", "--tag", "x", "--kernel", "vmlinux", "--rootfs", "r.ext4")
    assert res.exit_code == 2 and "snapshot create --tag T --image" in res.stderr


def test_exec_and_eval_take_the_sandbox_as_child(
    forkd: Invoke, sent: RecordingTransport, sid: str
) -> None:
    res = forkd("exec", "--child", sid, "--", "echo", "hi")
    assert res.exit_code == 0, res.output
    assert "hi" in res.stdout
    res = forkd("exec", sid, "--sh", "echo one; echo two")
    assert res.exit_code == 0, res.output
    started = [r for r in sent.requests if r.url.path.endswith("/processes")]
    assert json.loads(started[-1].content)["cmd"] == ["/bin/sh", "-c", "echo one; echo two"]
    res = forkd("eval", "--target", sid, "--", "6", "*", "7")
    assert res.exit_code == 0, res.output
    assert (
        json.loads([r for r in sent.requests if r.url.path.endswith("/eval")][-1].content)["code"]
        == "6 * 7"
    )
    assert forkd("exec", "--child", sid).exit_code == 2  # no command


def test_fork_takes_the_originals_flags_and_prints_the_wall_clock_line(
    forkd: Invoke, ctl: Controller, py: str
) -> None:
    res = forkd(
        "fork",
        "--tag",
        py,
        "--n",
        "2",
        "--memory-limit-mib",
        "256",
        "--per-child-netns",
        "--hugepages",
    )
    assert res.exit_code == 0, res.output
    wall = [line for line in res.stdout.splitlines() if "total wall-clock" in line]
    assert len(wall) == 1 and wall[0].split()[3].isdigit()  # what its bench scripts awk
    assert "--hugepages is accepted and has no effect" in res.stderr
    assert {sb["memory_limit_mib"] for sb in ctl.list_sandboxes()} == {256}


def test_a_mistyped_tag_lists_close_matches(forkd: Invoke, py: str) -> None:
    res = forkd("fork", "--tag", "pz")
    assert res.exit_code == 1 and "did you mean py?" in res.stderr


def test_rmi_of_a_diff_base_says_http_409(
    forkd: Invoke, ctl: Controller, sid: str, py: str
) -> None:
    ctl.branch_sandbox(sid, tag="d1", mode="diff")
    res = forkd("rmi", py)
    assert res.exit_code == 1 and "HTTP 409" in res.stderr
    assert py in {s["tag"] for s in ctl.list_snapshots()}


def test_snapshot_compact_to_is_flat(forkd: Invoke, ctl: Controller, sid: str) -> None:
    ctl.branch_sandbox(sid, tag="d1", mode="diff")
    res = forkd("snapshot-compact", "--from", "d1", "--to", "flat", "--json")
    assert res.exit_code == 0, res.output
    info = ctl.snapshot_info("flat")
    assert info["parent_tag"] is None and info["chain_depth"] == 0 and info["mode"] == "full"


def test_workspaces(forkd: Invoke, ctl: Controller, py: str) -> None:
    res = forkd("workspace", "create", "ws1", "--snapshot", py)
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith("ws1") and f"source={py}" in res.stdout
    assert forkd("workspace", "suspend", "ws1").exit_code == 0
    assert "suspended" in forkd("workspace", "list").stdout
    assert forkd("workspace", "resume", "ws1").exit_code == 0
    res = forkd("workspace", "delete", "ws1")
    assert res.exit_code == 0 and "deleted workspace 'ws1'" in res.stdout
    assert forkd("workspace", "list").stdout.strip() == "(no workspaces)"


def test_images_where_and_from_image(
    forkd: Invoke, ctl: Controller, py: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    res = forkd("images")
    assert res.exit_code == 0 and py in res.stdout
    res = forkd("where")
    assert res.exit_code == 0 and res.stdout.strip()
    res = forkd("from-image", "python", "--tag", "fromimg", "--mem-size-mib", "128")
    assert res.exit_code == 0, res.output
    assert ctl.snapshot_info("fromimg")["memory_mib"] == 128


def test_top_in_a_pipe_prints_a_table_each_interval(
    forkd: Invoke, sid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    naps: list[float] = []

    def nap(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("forkd.cli.usage.time.sleep", nap)
    res = forkd("top", "--interval", "0.5")
    assert res.exit_code == 0, res.output
    assert res.stdout.count(sid) == 2 and naps == [0.5, 0.5]


@pytest.mark.parametrize(
    "listing",
    [
        ["ps"],
        ["snapshot", "ls"],
        ["image", "ls"],
        ["volume", "ls"],
        ["ls"],
        ["workspace", "list"],
        ["images"],
    ],
)
def test_every_listing_prints_json_with_o_json(forkd: Invoke, sid: str, listing: list[str]) -> None:
    res = forkd(*listing, "-o", "json")
    assert res.exit_code == 0, res.output
    assert isinstance(json.loads(res.stdout), list)
    assert forkd(*listing, "--format", "yaml").exit_code == 2


def test_doctor_checks_the_daemon_it_is_pointed_at(server: Server, py: str) -> None:
    from forkd.cli import app

    args = ["doctor", "-o", "json", "--daemon-url", server.url]
    res = runner.invoke(app, [*args, "--daemon-token", server.token])
    daemon = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "daemon")
    assert daemon["ok"] and "1 snapshot(s)" in daemon["detail"]
    res = runner.invoke(app, [*args, "--daemon-token", "wrong"])
    daemon = next(c for c in json.loads(res.stdout)["checks"] if c["name"] == "daemon")
    assert not daemon["ok"] and "FORKD_TOKEN" in daemon["fix"]


def test_bench_takes_the_originals_netns_value(forkd: Invoke, py: str) -> None:
    res = forkd("bench", "--tag", py, "--n", "2", "--per-child-netns", "false")
    assert res.exit_code == 0, res.output
    assert "fanout (n=2)" in res.stdout and "--per-child-netns is accepted" in res.stderr
