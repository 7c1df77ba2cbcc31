"""What the egress proxy did, told to the daemon: every connection it let out or refused
as an event, and each refusal as a line of the audit log."""

from __future__ import annotations

import time
from collections.abc import Callable

from forkd.controller.audit import Throttle
from forkd.controller.services.events import EventBus
from forkd.egress.records import EgressRecord

AUDIT_REFUSALS_PER_SEC = 20  # a sandbox's refusals written to the audit log; the rest counted


class RefusalAudit:
    """Each connection the proxy refused, a line in the audit log (at most
    AUDIT_REFUSALS_PER_SEC a second a sandbox: a flood is one summary line)."""

    def __init__(self) -> None:
        self.write: Callable[..., None] | None = None  # set by the app with its audit log
        self._throttle = Throttle(AUDIT_REFUSALS_PER_SEC)

    def note(self, record: EgressRecord) -> None:
        if self.write is None or record.verdict != "refused":
            return
        second = int(time.monotonic())
        for sandbox_id, n in self._throttle.summaries(second):
            self.write(event="egress_refused", sandbox_id=sandbox_id, suppressed=n)
        if self._throttle.admit(record.sandbox_id, second):
            self.write(
                event="egress_refused",
                sandbox_id=record.sandbox_id,
                kind=record.kind,
                host=record.host,
                port=record.port,
                address=record.address,
                method=record.method,
                path=record.path,
                reason=record.reason,
            )


class EgressReport:
    """The proxy's ``notify``: each connection (and HTTP request) as it ends, an
    ``egress`` event; a refusal also in the audit log (:class:`RefusalAudit`)."""

    def __init__(self, events: EventBus) -> None:
        self.events = events
        self.refusals = RefusalAudit()

    def __call__(self, record: EgressRecord) -> None:
        self.refusals.note(record)
        fields = record.to_json()
        fields["record_id"], fields["began_at"] = fields.pop("id"), fields.pop("time")
        self.events.publish("egress", **fields)
