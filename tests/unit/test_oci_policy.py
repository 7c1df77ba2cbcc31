"""The operator's registry policy (forkd.oci.policy) and the connections that enforce it
(forkd.oci.connect): plain HTTP and this host's own services only for listed registries,
short references only under a default registry, and nothing contacted or looked up for
a registry that is refused."""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from forkd.cli import app as cli_app
from forkd.controller.settings import Settings
from forkd.errors import Invalid, NotFound, UpstreamError
from forkd.oci import reference
from forkd.oci.policy import RegistryPolicy, is_this_host
from forkd.oci.reference import DOCKER_HUB, NoRegistry
from forkd.oci.registry import Registry
from tests.unit.listening_registry import Answer, listening

_real_getaddrinfo = socket.getaddrinfo


def _resolving(monkeypatch: pytest.MonkeyPatch, names: dict[str, str]) -> list[str]:
    """Names in ``names`` resolve to the address given; any other lookup is refused.
    Returns the names looked up."""
    looked_up: list[str] = []

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        looked_up.append(str(host))
        if host in names:
            return _real_getaddrinfo(names[host], *args, **kwargs)
        if isinstance(host, str) and host.replace(".", "").isdigit():
            return _real_getaddrinfo(host, *args, **kwargs)  # an address: no DNS
        raise socket.gaierror(f"no lookups in this test ({host})")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return looked_up


# ------------------------------------------------------------------ the policy


def test_the_options_are_checked_and_listed_hosts_matched_without_their_standard_port() -> None:
    policy = RegistryPolicy.of(["127.0.0.1:5000", "Registry.Local", "[::1]:5001"])
    assert policy.lists("127.0.0.1", 5000) and not policy.lists("127.0.0.1", 5001)
    assert policy.lists("registry.local", None) and policy.lists("registry.local", 443)
    assert policy.lists("registry.local", 80) and not policy.lists("registry.local", 5000)
    assert policy.lists("::1", 5001) and policy.lists("[::1]", 5001)
    for bad in (["http://r.io"], ["r.io/x"], ["r.io:99999"], [""]):
        with pytest.raises(Invalid, match="--insecure-registry"):
            RegistryPolicy.of(bad)
    with pytest.raises(Invalid, match="--default-registry"):
        RegistryPolicy.of([], "not a host")


@pytest.mark.parametrize(
    ("host", "here"),
    [
        ("127.0.0.1", True),
        ("127.8.9.1", True),
        ("localhost", True),
        ("LocalHost.", True),
        ("api.localhost", True),
        ("::1", True),
        ("[::1]", True),
        ("0.0.0.0", True),
        ("::", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("registry.local", False),
        ("ghcr.io", False),
    ],
)
def test_what_counts_as_this_host(host: str, here: bool) -> None:
    assert is_this_host(host) is here


def test_a_registry_on_this_host_is_refused_unless_listed() -> None:
    nothing = RegistryPolicy()
    for text in ("127.0.0.1:5000/a", "localhost:5000/a", "[::1]:5000/a", "0.0.0.0:5000/a"):
        with pytest.raises(Invalid, match="--insecure-registry"):
            nothing.scheme(reference.parse(text))
    assert nothing.scheme(reference.parse("ghcr.io/a")) == "https"
    assert nothing.scheme(reference.parse("10.0.0.1:5000/a")) == "https"
    listed = RegistryPolicy.of(["127.0.0.1:5000", "10.0.0.1:5000"])
    assert listed.scheme(reference.parse("127.0.0.1:5000/a")) == "http"
    assert listed.scheme(reference.parse("10.0.0.1:5000/a"), plain_asked=True) == "http"
    with pytest.raises(Invalid, match="--insecure-registry"):
        listed.scheme(reference.parse("127.0.0.1:5001/a"))  # another port: another service


def test_a_request_may_not_ask_for_plain_http_the_operator_did_not_allow() -> None:
    with pytest.raises(Invalid, match=r"plain HTTP to registry ghcr\.io is refused"):
        RegistryPolicy().scheme(reference.parse("ghcr.io/a"), plain_asked=True)


@pytest.mark.parametrize("text", ["0", "python:3.12", "acme/py:v2", "py@sha256:" + "a" * 64])
def test_a_short_reference_needs_a_default_registry(text: str) -> None:
    with pytest.raises(NoRegistry, match=r"give a full reference.*--default-registry"):
        RegistryPolicy().parse(text)


def test_a_short_reference_is_under_the_default_registry() -> None:
    own = RegistryPolicy.of(["127.0.0.1:5000"], "127.0.0.1:5000")
    assert own.parse("0") == reference.Reference("127.0.0.1:5000", "0")
    assert own.parse("acme/py:v2") == reference.Reference("127.0.0.1:5000", "acme/py", "v2")
    assert own.parse("ghcr.io/a:b").registry == "ghcr.io"  # a full one is as it is
    for hub in ("docker.io", "index.docker.io", "Registry-1.Docker.io"):
        policy = RegistryPolicy.of([], hub)
        assert policy.parse("0") == reference.Reference(DOCKER_HUB, "library/0")
        assert policy.parse("python:3.12") == reference.Reference(
            DOCKER_HUB, "library/python", "3.12"
        )
        assert policy.parse("acme/py").repository == "acme/py"


def test_forkd_serve_takes_the_registry_options_and_refuses_bad_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken: list[Settings] = []
    monkeypatch.setattr("forkd.controller.server.serve", lambda s, *_a, **_k: taken.append(s))
    monkeypatch.setattr("forkd.cli.daemon._use_qemu_user", lambda *_args: None)
    monkeypatch.delenv("FORKD_INSECURE_REGISTRIES", raising=False)
    monkeypatch.delenv("FORKD_DEFAULT_REGISTRY", raising=False)
    base = ["serve", "--state-dir", str(tmp_path), "--cgroup-parent", "none", "--accel", "tcg"]
    options = [
        "--insecure-registry",
        "127.0.0.1:5000",
        "--insecure-registry",
        "r.local",
        "--default-registry",
        "docker.io",
    ]
    for args in ([], options):
        result = CliRunner().invoke(cli_app, base + args)
        assert result.exit_code == 0, result.output
    assert (taken[0].insecure_registries, taken[0].default_registry) == ((), None)
    assert taken[1].insecure_registries == ("127.0.0.1:5000", "r.local")
    assert taken[1].default_registry == "docker.io"
    for bad in (["--insecure-registry", "http://r.local"], ["--default-registry", "a b"]):
        result = CliRunner().invoke(cli_app, base + bad)
        assert result.exit_code != 0 and "is not HOST[:PORT]" in result.output, result.output
    assert len(taken) == 2  # a bad option: the daemon did not start
    # The deployments' empty variable lists nothing, as no option does.
    result = CliRunner().invoke(cli_app, base, env={"FORKD_INSECURE_REGISTRIES": ""})
    assert result.exit_code == 0 and taken[-1].insecure_registries == (), result.output


# ------------------------------------------------------------------ the connections


def test_a_refused_registry_is_neither_looked_up_nor_contacted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    looked_up = _resolving(monkeypatch, {})
    with listening() as srv:
        port = srv.address.rsplit(":", 1)[1]
        for text in (f"127.0.0.1:{port}/a:v1", f"localhost:{port}/a:v1"):
            with pytest.raises(Invalid, match="--insecure-registry"):
                Registry(reference.parse(text))
        assert srv.accepted == 0
    assert looked_up == []


def _refused_on_connect(registry: Registry, action: Callable[[Registry], Any]) -> None:
    with registry as reg, pytest.raises(Invalid, match=r"own address.*--insecure-registry"):
        action(reg)


def test_a_name_that_resolves_to_this_host_is_refused_when_connecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # HTTPS is allowed to any host: but not to this one by a name that resolves here.
    with listening() as srv:
        port = srv.address.rsplit(":", 1)[1]
        _resolving(monkeypatch, {"here.example": "127.0.0.1", "any.example": "0.0.0.0"})
        # Names, and addresses written so that only a lookup tells (no DNS for these).
        for host in ("here.example", "any.example", "127.1", "2130706433"):
            ref = reference.parse(f"{host}:{port}/forkd/x:v1")
            _refused_on_connect(Registry(ref), lambda reg: reg.get_manifest("v1"))
        assert srv.accepted == 0
        # Listed, the same name is reached (over plain HTTP).
        listed = RegistryPolicy.of([f"here.example:{port}"])
        ref = reference.parse(f"here.example:{port}/forkd/x:v1")
        with Registry(ref, policy=listed) as reg, pytest.raises(NotFound):
            reg.get_manifest("v1")
        assert srv.paths == ["GET /v2/forkd/x/manifests/v1"]


def test_a_redirect_may_not_lead_to_this_host_or_to_plain_http(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blob = b"content"
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    with listening() as target:
        port = target.address.rsplit(":", 1)[1]
        _resolving(monkeypatch, {"storage.example": "127.0.0.1"})
        for location in (
            f"http://127.0.0.1:{port}/b",  # plain HTTP, not listed
            f"http://storage.example:{port}/b",
            f"https://storage.example:{port}/b",  # a name for this host
            f"https://127.0.0.1:{port}/b",
            f"https://localhost:{port}/b",
        ):
            with listening(Answer(307, headers={"Location": location})) as registry:
                policy = RegistryPolicy.of([registry.address])
                reg = Registry(reference.parse(f"{registry.address}/forkd/x"), policy=policy)
                with reg, pytest.raises(Invalid, match="--insecure-registry"):
                    reg.get_blob(digest, len(blob))
                assert registry.accepted == 1, location
        assert target.accepted == 0


def test_a_registry_that_cannot_be_reached_says_only_that(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _resolving(monkeypatch, {"far.example": "192.0.2.1"})  # TEST-NET-1: never answers
    monkeypatch.setattr("forkd.oci.registry.TIMEOUT", 0.3)
    for text, policy in [
        ("127.0.0.1:1/a", RegistryPolicy.of(["127.0.0.1:1"])),  # refused
        ("far.example/a", RegistryPolicy()),  # times out
        ("nowhere.example/a", RegistryPolicy()),  # no such name
    ]:
        with (
            Registry(reference.parse(text), policy=policy) as reg,
            pytest.raises(UpstreamError) as exc,
        ):
            reg.get_manifest("v1")
        registry = text.split("/")[0]
        scheme = "http" if registry.startswith("127.") else "https"
        assert str(exc.value) == f"registry {registry} is unreachable over {scheme}"
