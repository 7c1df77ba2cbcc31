"""Secrets: create, list, update, delete (values are write-only)."""

from __future__ import annotations

from collections.abc import Sequence

from forkd.client.connection import JSONDict
from forkd.client.route_base import Call, RouteBase, drop_none, no_answer, quote_segment, route


class SecretCalls(RouteBase):
    """The JSON routes of secrets (:class:`~forkd.client.routes.Routes`)."""

    @route
    def create_secret(self, name: str, value: str, hosts: Sequence[str]) -> Call[JSONDict]:
        """``POST /v1/secrets``: a credential the daemon's egress proxy puts into requests
        bound for ``hosts`` (names, ``*.domain``) in place of ``${secrets.NAME}``; the
        guest holds only the placeholder. Returns its info, never the value.

        Example::

            ctl.create_secret("openai", key, ["api.openai.com"])
            ctl.create_snapshot("agent", env={"OPENAI_API_KEY": "${secrets.openai}"})
        """
        body = {"name": name, "value": value, "hosts": list(hosts)}
        return self._json("POST", "/v1/secrets", json_body=body)

    @route
    def list_secrets(self) -> Call[list[JSONDict]]:
        """``GET /v1/secrets``: names, hosts, ``created_at_unix``, ``last_used_unix``."""
        return self._json("GET", "/v1/secrets")

    @route
    def secret_info(self, name: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/secrets/{quote_segment(name)}")

    @route
    def update_secret(
        self, name: str, value: str | None = None, hosts: Sequence[str] | None = None
    ) -> Call[JSONDict]:
        """``PUT /v1/secrets/{name}``: rotate the value and/or change the hosts; the next
        request a sandbox sends uses them (no restart)."""
        body = drop_none({"value": value, "hosts": list(hosts) if hosts is not None else None})
        return self._json("PUT", f"/v1/secrets/{quote_segment(name)}", json_body=body)

    @route
    def delete_secret(self, name: str, force: bool = False) -> Call[None]:
        """``DELETE /v1/secrets/{name}``; 409 while running sandboxes' network rules name
        it, unless ``force``."""
        params = {"force": "true"} if force else None
        return self._request("DELETE", f"/v1/secrets/{quote_segment(name)}", params=params).then(
            no_answer
        )
