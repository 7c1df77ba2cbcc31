"""The egress proxy from inside real guests: Python's own HTTPS and HTTP clients reach
the test's "internet" (a namespace of this test, tests/egress_world.py) by name, as
their sandbox's network policy says, and a template's policy is its forks' and its
branches'. The guest's /etc/hosts points every name at an address nobody listens on:
the proxy decides by the name the client sends, never by the guest's DNS answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.client import Controller
from forkd.vmm.jail import network
from tests import egress_world
from tests.egress_world import Outside

from .conftest import Daemon

pytestmark = pytest.mark.integration

if network.netns_problems():
    pytest.skip(
        "no network namespaces here: " + "; ".join(network.netns_problems()),
        allow_module_level=True,
    )

# Run in the guest: fetch each URL with Python's urllib, trusting the test CA; print
# what each gave (its JSON's host, or the error's kind).
FETCH = """
import json, ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile="/tmp/test-ca.pem")
out = {}
for url in sys.argv[1:]:
    try:
        with urllib.request.urlopen(url, context=ctx, timeout=15) as r:
            out[url] = json.load(r)["host"]
    except Exception as e:
        out[url] = type(e).__name__ + ": " + str(getattr(e, "reason", e))[:120]
print(json.dumps(out))
"""
API, OTHER = "https://api.test.example/echo", "https://other.test.example/echo"
PLAIN_OTHER = "http://other.test.example/echo"


SECRET = "sk-it-7f3e9a1c5b2d4e6f8a0b1c2d3e4f5a6b"  # what no file of a guest may hold


@pytest.fixture(scope="module")
def world(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outside]:
    ca = egress_world.made_ca(daemon.root / "egress-test-ca")  # the daemon trusts it
    try:
        with egress_world.outside(tmp_path_factory.mktemp("egress"), ca, SECRET) as made:
            (daemon.root / "egress-hosts").write_text(made.hosts_file.read_text())
            egress_world.wait_for(lambda: False, 1.2)  # the daemon reads it again
            yield made
    except RuntimeError as exc:
        pytest.skip(str(exc))
    finally:
        (daemon.root / "egress-hosts").write_text("")


def _guest_ready(ctl: Controller, sandbox_id: str, world: Outside) -> None:
    """The test CA where FETCH trusts it, every test name pointed nowhere."""
    ctl.write_file(sandbox_id, "/tmp/test-ca.pem", world.ca.cert.read_bytes())
    hosts = "".join(f"198.19.0.99 {n}\n" for n in egress_world.NAMES)
    ran = ctl.exec_command(sandbox_id, ["sh", "-c", f"printf '{hosts}' >> /etc/hosts"])
    assert ran["exit_code"] == 0, ran


def fetch(ctl: Controller, sandbox_id: str, *urls: str) -> dict[str, str]:
    ran = ctl.exec_command(sandbox_id, ["python3", "-c", FETCH, *urls], timeout_secs=90)
    assert ran["exit_code"] == 0, ran
    return json.loads(ran["stdout"])


@pytest.fixture(scope="module")
def agent(ctl: Controller, world: Outside) -> Iterator[str]:
    """A template whose policy lets out only api.test.example."""
    made = ctl.create_snapshot(
        "egress-agent", memory_mib=256, network={"allow_out": ["api.test.example"]}
    )
    assert made["tag"] == "egress-agent"
    yield "egress-agent"
    ctl.delete_snapshot("egress-agent", cascade=True)


def test_a_guests_https_and_http_go_out_by_name(
    ctl: Controller, api_template: str, world: Outside
) -> None:
    [sb] = ctl.spawn_sandboxes(api_template, network={"allow_out": ["api.test.example"]})
    try:
        _guest_ready(ctl, sb["id"], world)
        said = fetch(ctl, sb["id"], API, OTHER, PLAIN_OTHER, "http://api.test.example/echo")
        assert said[API] == "api.test.example"
        assert said["http://api.test.example/echo"] == "api.test.example"
        assert "access denied" in said[OTHER].lower() or "SSL" in said[OTHER], said
        assert said[PLAIN_OTHER].startswith("HTTPError"), said  # the proxy's 403
    finally:
        ctl.kill_sandbox(sb["id"])


def test_forks_and_branches_keep_their_templates_policy(
    ctl: Controller, agent: str, world: Outside
) -> None:
    [child] = ctl.spawn_sandboxes(agent)
    kids: list[dict[str, Any]] = [child]
    try:
        _guest_ready(ctl, child["id"], world)
        assert fetch(ctl, child["id"], API, OTHER)[API] == "api.test.example"
        branch = ctl.branch_sandbox(child["id"], "egress-branch")
        [grandchild] = ctl.spawn_sandboxes(branch["tag"])
        kids.append(grandchild)
        said = fetch(ctl, grandchild["id"], API, OTHER)  # its /etc/hosts came with it
        assert said[API] == "api.test.example" and said[OTHER] != "other.test.example"
        [wide] = ctl.spawn_sandboxes(branch["tag"], network={})  # a fork's own policy
        kids.append(wide)
        assert fetch(ctl, wide["id"], OTHER)[OTHER] == "other.test.example"
    finally:
        for kid in kids:
            ctl.kill_sandbox(kid["id"])


# Run in the guest: N requests to /check-token with the placeholder from the template's
# environment; print how many the host accepted. The host never echoes the token.
USE_TOKEN = """
import json, os, sys, urllib.request
ok = 0
for _ in range(int(sys.argv[1])):
    req = urllib.request.Request("https://api.test.example/check-token",
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    try:
        with urllib.request.urlopen(req, timeout=15) as r:
            ok += json.load(r)["authorized"]
    except Exception as e:
        print("failed:", type(e).__name__, str(e)[:200], file=sys.stderr)
print(json.dumps({"ok": ok, "env": os.environ["OPENAI_API_KEY"]}))
"""


def _holds(root: Path, needle: bytes, recursive: bool = True) -> list[str]:
    """Files under ``root`` with ``needle`` in them (read in chunks, overlapping)."""
    found = []
    for path in root.rglob("*") if recursive else root.iterdir():
        if not path.is_file() or path.is_symlink():
            continue
        with path.open("rb") as f:
            tail = b""
            while chunk := f.read(8 << 20):
                if needle in tail + chunk:
                    found.append(str(path))
                    break
                tail = chunk[-len(needle) :]
    return found


def test_a_secret_is_used_and_never_in_a_guests_files(
    ctl: Controller, daemon: Daemon, world: Outside, registry_address: str
) -> None:
    from tests.registry_server import RegistryServer

    ctl.create_secret("it_openai", SECRET, ["api.test.example"])
    made = ctl.create_snapshot(
        "egress-secrets",
        memory_mib=256,
        network={"allow_out": ["*.test.example"]},
        env={"OPENAI_API_KEY": "${secrets.it_openai}"},
    )
    assert made["tag"] == "egress-secrets"
    [sb] = ctl.spawn_sandboxes("egress-secrets")
    registry = RegistryServer(address=registry_address)  # the one the daemon lists
    try:
        _guest_ready(ctl, sb["id"], world)
        ran = ctl.exec_command(sb["id"], ["python3", "-c", USE_TOKEN, "25"], timeout_secs=180)
        said = json.loads(ran["stdout"])
        assert said == {"ok": 25, "env": "${secrets.it_openai}"}, ran["stderr"]
        assert ctl.secret_info("it_openai")["last_used_unix"] is not None
        branch = ctl.branch_sandbox(sb["id"], "egress-secrets-b")
        ctl.push_snapshot(branch["tag"], registry.ref("forkd/it", "secrets"))
        ctl.pause_sandbox(sb["id"], hibernate=True)  # its whole state to disk
        needle = SECRET.encode()
        assert _holds(daemon.state_dir / "snapshots", needle) == []  # branch, hibernation
        assert _holds(daemon.state_dir / "run", needle) == []  # the VMs' disks and logs
        assert _holds(registry.root, needle) == []  # every pushed blob
        assert _holds(daemon.state_dir, needle, recursive=False) == []  # the db: sealed
        assert needle not in (daemon.root / "daemon.log").read_bytes()
    finally:
        registry.stop()
        ctl.kill_sandbox(sb["id"])
        ctl.delete_snapshot("egress-secrets", cascade=True)
        ctl.delete_secret("it_openai", force=True)


def test_a_runtime_change_holds_through_hibernation(
    ctl: Controller, agent: str, world: Outside
) -> None:
    [sb] = ctl.spawn_sandboxes(agent)
    try:
        _guest_ready(ctl, sb["id"], world)
        assert fetch(ctl, sb["id"], OTHER)[OTHER] != "other.test.example"
        opened = ctl.update_sandbox_network(sb["id"], allow_out=["*.test.example"])
        assert opened["allow_out"] == ["*.test.example"]
        assert fetch(ctl, sb["id"], OTHER)[OTHER] == "other.test.example"  # at once
        ctl.pause_sandbox(sb["id"], hibernate=True)
        assert ctl.sandbox_network(sb["id"])["allow_out"] == ["*.test.example"]  # on disk
        ctl.resume_sandbox(sb["id"])
        assert fetch(ctl, sb["id"], OTHER)[OTHER] == "other.test.example"
        ctl.update_sandbox_network(sb["id"], deny_out=["*"])
        assert fetch(ctl, sb["id"], API)[API] != "api.test.example"  # DNS and TCP shut
        records = ctl.sandbox_egress(sb["id"])["records"]
        assert {r["host"] for r in records if r["verdict"] == "allowed"} >= {"other.test.example"}
    finally:
        ctl.kill_sandbox(sb["id"])


def test_a_restarted_daemon_listens_again_with_each_sandboxs_policy(
    image: object, world: Outside, tmp_path: Path
) -> None:
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="forkd-e-", dir="/tmp"))
    d = Daemon(root)
    hosts = root / "egress-hosts"
    hosts.write_text(world.hosts_file.read_text())
    args = (
        "--pool-size",
        "0",
        "--egress-hosts",
        str(hosts),
        "--egress-ca-file",
        str(world.ca.cert),
    )
    d.start(*args)
    try:
        with Controller(d.url, token=d.token, timeout=300) as own:
            own.create_snapshot("py", memory_mib=256)
            [sb] = own.spawn_sandboxes("py", network={"allow_out": ["api.test.example"]})
            _guest_ready(own, sb["id"], world)
            d.stop()
            d.start(*args)
            assert own.sandbox_network(sb["id"])["allow_out"] == ["api.test.example"]
            said = fetch(own, sb["id"], API, OTHER)
            assert said[API] == "api.test.example" and said[OTHER] != "other.test.example"
    finally:
        d.stop()
        d.kill_leftovers()
        shutil.rmtree(root, ignore_errors=True)


CLIENTS = Path(__file__).parent / "egress_clients"  # a recipe: curl, pip, git, node
NODE_FETCH = (
    "fetch('https://api.test.example/check-token', {headers: {Authorization: "
    "'Bearer ' + process.env.OPENAI_API_KEY}}).then(r => r.json())"
    ".then(j => console.log(JSON.stringify(j)))"
)


@pytest.fixture(scope="module")
def clients_image() -> str:
    """Built once (cached after): the first build fetches the packages from Debian."""
    from forkd.guest import image as guest_image

    return guest_image.build(recipe_dir=CLIENTS).name


def test_real_clients_get_their_credentials_from_the_proxy(
    ctl: Controller, world: Outside, clients_image: str
) -> None:
    """curl, pip, git and Node, as they come, each use a token that never enters the guest:
    by a rule's header (pip's index, git's server) or a placeholder in the environment."""
    hosts = ["pypi.test.example", "git.test.example", "api.test.example"]
    ctl.create_secret("it_clients", SECRET, hosts)
    bearer = [{"transform": {"headers": {"Authorization": "Bearer ${secrets.it_clients}"}}}]
    ctl.create_snapshot(
        "egress-clients",
        image=clients_image,
        network={
            "allow_out": ["*.test.example"],
            "rules": {"pypi.test.example": bearer, "git.test.example": bearer},
        },
        env={"OPENAI_API_KEY": "${secrets.it_clients}"},
    )
    [sb] = ctl.spawn_sandboxes("egress-clients")
    try:
        _guest_ready(ctl, sb["id"], world)

        def run(*argv: str) -> dict[str, Any]:
            return ctl.exec_command(sb["id"], list(argv), timeout_secs=180)

        curl = run(
            "sh",
            "-c",
            "curl -sS https://api.test.example/check-token "
            '-H "Authorization: Bearer $OPENAI_API_KEY"',
        )
        assert json.loads(curl["stdout"]) == {"authorized": True}, curl
        pip = run(
            "pip",
            "download",
            "--no-deps",
            "--index-url",
            "https://pypi.test.example/simple",
            "-d",
            "/tmp/pkgs",
            "forkd-probe",
        )
        assert pip["exit_code"] == 0, pip
        assert egress_world.WHEEL in run("ls", "/tmp/pkgs")["stdout"]
        git = run("git", "clone", "-q", "https://git.test.example/repo.git", "/tmp/repo")
        assert git["exit_code"] == 0, (git, ctl.sandbox_egress(sb["id"], limit=1000))
        assert run("cat", "/tmp/repo/README")["stdout"] == "cloned through the egress proxy\n"
        node = run("node", "-e", NODE_FETCH)
        assert json.loads(node["stdout"].strip().splitlines()[-1]) == {"authorized": True}, node
        used = {
            r["host"]
            for r in ctl.sandbox_egress(sb["id"], limit=1000)["records"]
            if r["secrets"] == ["it_clients"]
        }
        assert used == set(hosts)
        assert run("sh", "-c", "echo $OPENAI_API_KEY")["stdout"] == "${secrets.it_clients}\n"
    finally:
        ctl.kill_sandbox(sb["id"])
        ctl.delete_snapshot("egress-clients", cascade=True)
        ctl.delete_secret("it_clients", force=True)


RESOLVE = """
import json, socket, sys
out = {}
for name in sys.argv[1:]:
    try:
        out[name] = socket.gethostbyname(name)
    except OSError as e:
        out[name] = type(e).__name__
print(json.dumps(out))
"""


def test_a_guests_dns_is_the_daemons(ctl: Controller, agent: str, world: Outside) -> None:
    """No /etc/hosts here: the guest's own resolver (10.0.2.3) gets the pinned name, and
    nothing for a name its policy never lets it reach."""
    [sb] = ctl.spawn_sandboxes(agent)
    try:
        ran = ctl.exec_command(
            sb["id"], ["python3", "-c", RESOLVE, "api.test.example", "other.test.example"]
        )
        said = json.loads(ran["stdout"])
        assert said == {"api.test.example": egress_world.WEB, "other.test.example": "gaierror"}, ran
        ctl.write_file(sb["id"], "/tmp/test-ca.pem", world.ca.cert.read_bytes())
        assert fetch(ctl, sb["id"], API)[API] == "api.test.example"  # by its own DNS
    finally:
        ctl.kill_sandbox(sb["id"])
