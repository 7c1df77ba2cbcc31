"""``forkd network`` and ``forkd egress``, and the SDK's routes under them, against the
real daemon app (fake VMs)."""

from __future__ import annotations

from forkd.client import Controller, Sandbox
from forkd.egress.records import EgressRecord
from tests.unit.conftest import Invoke, RecordingTransport, Server


def test_network_shows_and_replaces_keeping_the_rules(
    forkd: Invoke, ctl: Controller, py: str, sent: RecordingTransport
) -> None:
    rules = {"api.test": [{"transform": {"headers": {"X-Key": "${secrets.k}"}}}]}
    [sb] = ctl.spawn_sandboxes(py, network={"allow_out": ["api.test"], "rules": rules})
    shown = forkd("network", sb["id"])
    assert shown.exit_code == 0, shown.output
    assert "api.test" in shown.output
    cut = forkd("network", sb["id"], "--deny-out", "*")
    assert cut.exit_code == 0, cut.output
    assert sent.body(-1) == {"allow_out": [], "deny_out": ["*"], "rules": rules}
    assert "connections closed" in cut.output
    opened = forkd("network", sb["id"], "--open", "--json")
    assert opened.exit_code == 0 and '"deny_out": []' in opened.output


def test_egress_lists_what_was_reached(
    forkd: Invoke, ctl: Controller, py: str, server: Server
) -> None:
    [sb] = ctl.spawn_sandboxes(py)
    log = server.app.state.services.egress.proxy.log
    log.add(
        EgressRecord(
            sb["id"],
            "refused",
            "http",
            "evil.test",
            80,
            reason="not allowed",
            method="GET",
            path="/x",
        )
    )
    res = forkd("egress", sb["id"])
    assert res.exit_code == 0, res.output
    assert "evil.test:80" in res.output and "GET /x" in res.output and "refused" in res.output
    page = ctl.sandbox_egress(sb["id"])
    assert page["records"][0]["reason"] == "not allowed"
    with Sandbox.connect(sb["id"], controller=ctl) as handle:
        assert handle.network()["proxied"] in (True, False)
        assert handle.set_network(deny_out=["*"])["deny_out"] == ["*"]
        assert handle.egress()["records"][0]["host"] == "evil.test"
