"""Secrets: credentials the egress proxy puts into a guest's requests, on their way
out, for the hosts each belongs to. A guest holds only the placeholder
``${secrets.NAME}``; the value stays in the daemon (sealed at rest by
:mod:`forkd.controller.secret_box`, known to the log filter so no log line
holds it) and is never sent back through any API.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from forkd import limits
from forkd.controller import log_redaction
from forkd.controller.models.network import SecretCreate, SecretInfo, SecretUpdate
from forkd.controller.secret_box import SecretBox, SecretKeyError
from forkd.controller.store import Store
from forkd.controller.store_rows import SecretRow
from forkd.errors import Conflict, Invalid, NotFound
from forkd.host_names import Destination, parse_destinations

log = logging.getLogger(__name__)
USE_FLUSH_SECS = 10.0  # last_used_unix reaches the database at most this often a secret


def _hosts(given: list[str]) -> list[str]:
    parsed = parse_destinations(given, names_only=True, limit=limits.MAX_SECRET_HOSTS)
    return [d.text for d in parsed]


class SecretService:
    def __init__(self, store: Store, box: SecretBox) -> None:
        self.store = store
        self.box = box
        self._lock = threading.Lock()
        self._values: dict[str, str] = {}  # name -> value, opened at start or when set
        self._hosts: dict[str, list[Destination]] = {}
        self._used: dict[str, float] = {}  # uses not yet in the database
        self._flushed_at = 0.0

    def start(self) -> None:
        """Check the key and open every secret (a value that does not open is logged by
        name and left out: requests get its placeholder until it is set again)."""
        self.box.check()
        for row in self.store.list_secrets():
            try:
                self._remember(row.name, self.box.open(row.name, row.sealed), row.hosts)
            except SecretKeyError as exc:
                log.error("%s", exc)

    def _remember(self, name: str, value: str, hosts: list[str]) -> None:
        with self._lock:
            self._values[name] = value
            self._hosts[name] = parse_destinations(hosts, names_only=True)
        log_redaction.SECRET_VALUES.know(name, value)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._values.pop(name, None)
            self._hosts.pop(name, None)
            self._used.pop(name, None)
        log_redaction.SECRET_VALUES.forget(name)

    # ------------------------------------------------------------ the API's

    def create(self, body: SecretCreate) -> SecretInfo:
        hosts = _hosts(body.hosts)
        value = body.value.get_secret_value()
        now = time.time()
        row = SecretRow(body.name, self.box.seal(body.name, value), hosts, now, now)
        self.store.add_secret(row, limits.MAX_SECRETS)
        self._remember(body.name, value, hosts)
        log.info("secret %s created for %s", body.name, ", ".join(hosts))
        return self._info(row)

    def list(self) -> list[SecretInfo]:
        return [self._info(row) for row in self.store.list_secrets()]

    def info(self, name: str) -> SecretInfo:
        return self._info(self._row(name))

    def update(self, name: str, body: SecretUpdate) -> SecretInfo:
        if body.value is None and body.hosts is None:
            raise Invalid("nothing to change: give a new value, new hosts, or both")
        old = self._row(name)
        hosts = _hosts(body.hosts) if body.hosts is not None else None
        value = body.value.get_secret_value() if body.value is not None else None
        sealed = self.box.seal(name, value) if value is not None else None
        row = self.store.replace_secret(name, time.time(), sealed, hosts)
        if value is None:
            with self._lock:
                value = self._values.get(name)
        if value is not None:
            self._remember(name, value, row.hosts)
        changed = [w for w, new in (("value", sealed), ("hosts", hosts)) if new is not None]
        log.info(
            "secret %s: new %s (hosts were %s)", name, " and ".join(changed), ", ".join(old.hosts)
        )
        return self._info(row)

    def delete(self, name: str, *, named_by: Sequence[str], force: bool = False) -> None:
        """``named_by``: the running sandboxes whose network rules name the secret
        (:meth:`~.network.NetworkService.rules_naming`); :class:`Conflict` while there
        are some, unless ``force``."""
        self._row(name)
        users = named_by
        if users and not force:
            raise Conflict(
                f"secret {name!r} is named by the network rules of {', '.join(users[:5])}"
                f"{' and more' if len(users) > 5 else ''}: change their rules first, or "
                "delete with force=true (their requests then carry the placeholder)"
            )
        self.store.delete_secret(name)
        self._forget(name)
        log.info("secret %s deleted", name)

    def _row(self, name: str) -> SecretRow:
        row = self.store.get_secret(name)
        if row is None:
            raise NotFound(f"no secret {name!r}")
        return row

    def _info(self, row: SecretRow) -> SecretInfo:
        with self._lock:
            pending = self._used.get(row.name)
        last = max(row.last_used_unix or 0.0, pending or 0.0) or None
        return SecretInfo(
            name=row.name,
            hosts=row.hosts,
            created_at_unix=row.created_at_unix,
            updated_at_unix=row.updated_at_unix,
            last_used_unix=last,
        )

    # ------------------------------------------------------------ the proxy's

    def names(self) -> set[str]:
        with self._lock:
            return set(self._values)

    def value_for(self, name: str, host: str) -> str | None:
        """The value of ``name`` when ``host`` (canonical) is one of its hosts; else None:
        the placeholder goes out as it came. Counts a use."""
        with self._lock:
            value = self._values.get(name)
            hosts = self._hosts.get(name, [])
            if value is None or not any(d.matches_name(host) for d in hosts):
                return None
            self._used[name] = time.time()
        return value

    def any_for(self, host: str) -> bool:
        """Is ``host`` (canonical) one of some secret's hosts (then it is intercepted)?"""
        with self._lock:
            return any(d.matches_name(host) for hosts in self._hosts.values() for d in hosts)

    def flush_uses(self, force: bool = False) -> None:
        """Write the uses counted since the last flush (at most every USE_FLUSH_SECS)."""
        now = time.monotonic()
        with self._lock:
            if not self._used or (not force and now - self._flushed_at < USE_FLUSH_SECS):
                return
            used, self._used, self._flushed_at = self._used, {}, now
        self.store.mark_secrets_used(used)
