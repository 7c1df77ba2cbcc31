"""A sandbox's logs through E2B's API (the daemon's events of it) and envd's ``/envs``,
asked with E2B's own generated client and over HTTP as the SDK sends them."""

from __future__ import annotations

from typing import Any

import e2b
import httpx
from e2b.api.client.api.sandboxes import (
    get_sandboxes_sandbox_id_logs,
    get_v_2_sandboxes_sandbox_id_logs,
)
from e2b.api.client.models import LogLevel, LogsDirection, SandboxLogs, SandboxLogsV2Response
from e2b.api.client_sync import get_api_client
from e2b.connection_config import ConnectionConfig

from tests.unit.conftest import TOKEN, Server


def v1_logs(sandbox_id: str, **kw: Any) -> SandboxLogs:
    answer = get_sandboxes_sandbox_id_logs.sync(sandbox_id, **kw)
    assert isinstance(answer, SandboxLogs), answer
    return answer


def v2_logs(sandbox_id: str, **kw: Any) -> SandboxLogsV2Response:
    answer = get_v_2_sandboxes_sandbox_id_logs.sync(sandbox_id, **kw)
    assert isinstance(answer, SandboxLogsV2Response), answer
    return answer


def test_logs_are_the_sandboxs_own_events_filtered_as_asked(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base")
    other = e2b.Sandbox.create("base")
    sbx.pause()
    e2b.Sandbox.connect(sbx.sandbox_id)
    client = get_api_client(ConnectionConfig())
    v1 = v1_logs(sbx.sandbox_id, client=client)
    kinds = [e.fields["type"] for e in v1.log_entries]
    assert kinds[0] == "created" and "hibernated" in kinds and kinds[-1] == "resumed"
    assert [line.line.split()[0] for line in v1.logs] == kinds
    assert all(e.level == LogLevel.INFO for e in v1.log_entries)
    forward = v2_logs(sbx.sandbox_id, client=client, limit=2)
    assert [e.fields["type"] for e in forward.logs] == kinds[:2]
    back = v2_logs(sbx.sandbox_id, client=client, direction=LogsDirection.BACKWARD, limit=1)
    assert [e.fields["type"] for e in back.logs] == ["resumed"]
    found = v2_logs(sbx.sandbox_id, client=client, search="hibern")
    assert {e.fields["type"] for e in found.logs} == {"hibernated"}
    errors = v2_logs(sbx.sandbox_id, client=client, level=LogLevel.ERROR)
    assert errors.logs == []
    theirs = v1_logs(other.sandbox_id, client=client)
    assert [e.fields["type"] for e in theirs.log_entries] == ["created"]  # not sbx's
    other.kill()
    gone = get_sandboxes_sandbox_id_logs.sync_detailed(other.sandbox_id, client=client)
    assert gone.status_code == 404
    with httpx.Client(base_url=e2b_url) as c:
        assert c.get(f"/sandboxes/{sbx.sandbox_id}/logs").status_code == 401  # no key
        bad = c.get(
            f"/v2/sandboxes/{sbx.sandbox_id}/logs",
            params={"limit": 5000},
            headers={"X-API-Key": TOKEN},
        )
        assert bad.status_code == 400 and "limit" in bad.json()["message"]
    sbx.kill()


def test_envs_is_the_environment_commands_start_with(server: Server, e2b_url: str) -> None:
    sbx = e2b.Sandbox.create("base", envs={"GREETING": "hi"})
    headers = {
        "E2b-Sandbox-Id": sbx.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sbx._envd_access_token or "",
    }
    with httpx.Client(base_url=e2b_url) as c:
        envs = c.get("/envs", headers=headers)
        assert envs.status_code == 200, envs.text
        assert envs.json()["GREETING"] == "hi" and "PATH" in envs.json()
        refused = c.get("/envs", headers={**headers, "X-Access-Token": "wrong"})
        assert refused.status_code >= 400
    sbx.kill()
