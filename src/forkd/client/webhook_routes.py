"""Webhooks: endpoints the daemon's events are delivered to, their deliveries, a test."""

from __future__ import annotations

from collections.abc import Sequence

from forkd.client.connection import JSONDict
from forkd.client.route_base import Call, RouteBase, drop_none, no_answer, quote_segment, route


class WebhookCalls(RouteBase):
    """The JSON routes of webhooks (:class:`~forkd.client.routes.Routes`)."""

    @route
    def create_webhook(
        self,
        url: str,
        events: Sequence[str] = ("*",),
        secret: str | None = None,
        description: str = "",
    ) -> Call[JSONDict]:
        """``POST /v1/webhooks``: the daemon's ``events`` (``sandbox.killed``, ..., or
        ``*``) are delivered to ``url`` from now on, signed as Standard Webhooks sign them.
        Without ``secret`` the daemon makes one, in this answer only (``secret``).

        Example::

            hook = ctl.create_webhook("https://ops.example.com/forkd", ["sandbox.killed"])
            Webhook(hook["secret"]).verify(body, headers)  # the receiver, standardwebhooks
        """
        body = drop_none(
            {"url": url, "events": list(events), "secret": secret, "description": description}
        )
        return self._json("POST", "/v1/webhooks", json_body=body)

    @route
    def list_webhooks(self) -> Call[list[JSONDict]]:
        return self._json("GET", "/v1/webhooks")

    @route
    def webhook_info(self, webhook_id: str) -> Call[JSONDict]:
        return self._json("GET", f"/v1/webhooks/{quote_segment(webhook_id)}")

    @route
    def delete_webhook(self, webhook_id: str) -> Call[None]:
        path = f"/v1/webhooks/{quote_segment(webhook_id)}"
        return self._request("DELETE", path).then(no_answer)

    @route
    def webhook_deliveries(self, webhook_id: str, limit: int = 100) -> Call[list[JSONDict]]:
        """Its latest deliveries, newest first: status, attempts, the last answer."""
        path = f"/v1/webhooks/{quote_segment(webhook_id)}/deliveries"
        return self._json("GET", path, params={"limit": str(limit)})

    @route
    def test_webhook(self, webhook_id: str) -> Call[JSONDict]:
        """A ``webhook.test`` message to that endpoint; ``{"msg_id"}``."""
        return self._json("POST", f"/v1/webhooks/{quote_segment(webhook_id)}/test")
