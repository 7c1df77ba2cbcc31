"""A template's guest trusts the daemon's egress CA: the certificate in its stores,
the variables runtimes read naming it (under the image's own), so every fork
accepts the proxy's certificate for an intercepted host."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from forkd.controller.services import egress_trust
from tests.unit.fakes import FakeDriver


def test_a_template_gets_the_ca_and_the_variables_naming_it(
    client: TestClient, driver: FakeDriver
) -> None:
    services = client.app.state.services  # type: ignore[attr-defined]
    if services.host_network.egress is None:
        pytest.skip("this host gives VMs no namespaces: no egress proxy, no CA to install")
    assert client.post("/v1/snapshots", json={"tag": "py"}).status_code == 201
    template = driver.vms[-1]
    ca = services.egress.ca
    assert template.contents.files[egress_trust.CA_FILE] == ca.pem
    assert b"BEGIN CERTIFICATE" in ca.pem
    env = template.contents.defaults["env"]
    assert env["SSL_CERT_FILE"] == egress_trust.BUNDLE
    assert env["NODE_EXTRA_CA_CERTS"] == egress_trust.CA_FILE
    key = services.settings.state_dir / "egress-ca" / "ca.key"
    assert key.stat().st_mode & 0o777 == 0o600


def test_the_script_appends_once_and_touches_no_link() -> None:
    script = egress_trust._SCRIPT
    assert f'grep -q "{egress_trust.MARKER}"' in script  # once, however many builds
    assert '[ ! -L "$b" ]' in script  # a bundle that is a link is its target's business
    for bundle in egress_trust.SYSTEM_BUNDLES:
        assert bundle in script


def test_an_image_without_a_shell_or_root_gets_the_ca_file_and_builds_on() -> None:
    import asyncio

    from forkd.errors import AgentError

    class Bare:  # a distroless image: files can be written, nothing can be run
        def __init__(self) -> None:
            self.files: dict[str, bytes] = {}

        async def write_file(self, path: str, data: bytes) -> int:
            self.files[path] = data
            return len(data)

        async def exec(self, argv: list[str], **kw: object) -> dict[str, object]:
            raise AgentError("unable to find user root: no matching entries in /etc/passwd")

    bare = Bare()
    env = asyncio.run(egress_trust.install(bare, b"PEM", "bare"))  # type: ignore[arg-type]
    assert env == {"NODE_EXTRA_CA_CERTS": egress_trust.CA_FILE}
    assert bare.files == {egress_trust.CA_FILE: b"PEM"}
