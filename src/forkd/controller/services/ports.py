"""A sandbox's TCP ports: connections to them for the proxy and tunnel, and preview URLs.

The HTTP side (:mod:`forkd.controller.port_proxy`, :mod:`forkd.controller.port_ws`)
asks here for a :class:`GuestLink` to a port: where to connect, held as one
of the sandbox's at most :data:`MAX_CONNECTIONS_PER_SANDBOX` proxied
connections, and a way to learn that the sandbox has gone (a namespace
removed under an open socket leaves its reads waiting forever).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime

from forkd import limits
from forkd.controller.models import PreviewInfo, PreviewRequest
from forkd.controller.services.live_vms import LiveVMs
from forkd.controller.services.preview_tokens import PreviewKey, parse
from forkd.controller.services.records import Records
from forkd.controller.services.sandbox_vm import SandboxVM
from forkd.controller.services.waking import Waker
from forkd.controller.settings import Settings
from forkd.controller.store import Store
from forkd.errors import Busy, Forbidden, NotFound
from forkd.states import SandboxState
from forkd.vmm.agent.ports import check_guest_port

MAX_CONNECTIONS_PER_SANDBOX = 64
# Of those, what preview URLs (anyone holding one) may hold: the rest stay for the
# sandbox's owner (the proxy and tunnels behind the bearer token).
PREVIEW_CONNECTIONS_PER_SANDBOX = 48
MAX_CONNECTIONS = 1024  # all sandboxes together: each holds two sockets and some buffer


def proxied_cap() -> int:
    """``MAX_CONNECTIONS``, or a quarter of the open-file limit when that is less: each
    proxied connection holds a guest socket beside its client's (which the connection
    cap keeps under half the limit), and the VMs' sockets, pipes and files need the rest."""
    return min(MAX_CONNECTIONS, limits.default_max_proxied())


def preview_cap() -> int:
    """What preview URLs' holders may hold of :func:`proxied_cap`: the rest stays for
    sandboxes' owners."""
    return max(1, proxied_cap() * 3 // 4)


@dataclass
class GuestLink:
    """Where one proxied connection goes, and whether its sandbox still runs."""

    sandbox_id: str
    port: int
    host: str
    host_port: int
    _vms: LiveVMs
    _vm: SandboxVM

    def alive(self) -> bool:
        """False once the sandbox was killed, died or left its VM (hibernated)."""
        return self._vms.get(self.sandbox_id) is self._vm and self._vm.is_alive()


def parse_port(text: str) -> int:
    """A guest port from a path segment; :class:`Invalid` unless one a caller may reach."""
    number = int(text) if text.isdigit() and len(text) <= 5 else 0
    check_guest_port(number)
    return number


class PortService:
    def __init__(
        self,
        settings: Settings,
        store: Store,
        records: Records,
        vms: LiveVMs,
        waker: Waker,
    ) -> None:
        self.settings = settings
        self.store = store
        self.records = records
        self.vms = vms
        self.waker = waker
        self.key = PreviewKey(self.settings.state_dir)
        self._open: dict[str, int] = {}  # sandbox id -> its proxied connections now
        self._previews: dict[str, int] = {}  # sandbox id -> those of preview URLs' holders

    @contextlib.asynccontextmanager
    async def link(
        self, sandbox_id: str, port: int, *, by_preview: bool = False
    ) -> AsyncIterator[GuestLink]:
        """Hold one of the sandbox's proxied connections to guest ``port`` for the block
        (``by_preview``: for a preview URL's holder, who may hold only a share of them).

        :class:`Invalid` for a port no one may reach, :class:`Conflict` unless
        the sandbox runs (a paused or hibernated one is woken first, unless made with
        ``auto_resume`` false), :class:`Busy` at the cap.
        """
        check_guest_port(port)
        vm = await self.waker.running(sandbox_id)
        held = self._open.get(sandbox_id, 0)
        if held >= MAX_CONNECTIONS_PER_SANDBOX:
            raise Busy(
                f"sandbox {sandbox_id!r} has {held} proxied connections open, the most "
                "it may have: close some and retry"
            )
        previews = self._previews.get(sandbox_id, 0)
        if by_preview and previews >= PREVIEW_CONNECTIONS_PER_SANDBOX:
            raise Busy(
                f"preview URLs of sandbox {sandbox_id!r} have {previews} connections "
                "open, the most they may (the rest are kept for its owner): retry "
                "shortly"
            )
        cap = proxied_cap()
        if sum(self._open.values()) >= cap:
            raise Busy(
                f"this daemon has {cap} proxied connections open, the most it keeps: retry shortly"
            )
        if by_preview and sum(self._previews.values()) >= preview_cap():
            raise Busy(
                f"preview URLs hold {preview_cap()} of this daemon's proxied "
                "connections, the most they may (the rest are kept for sandboxes' "
                "owners): retry shortly"
            )
        counts = [self._open, self._previews] if by_preview else [self._open]
        for count in counts:
            count[sandbox_id] = count.get(sandbox_id, 0) + 1
        try:
            host, host_port = await vm.guest_port_address(port)
            yield GuestLink(sandbox_id, port, host, host_port, self.vms, vm)
        finally:
            for count in counts:
                left = count.get(sandbox_id, 1) - 1
                if left > 0:
                    count[sandbox_id] = left
                else:
                    count.pop(sandbox_id, None)

    def connections(self, sandbox_id: str) -> int:
        return self._open.get(sandbox_id, 0)

    # ------------------------------------------------------------ preview URLs

    def create_preview(self, sandbox_id: str, req: PreviewRequest, base_url: str) -> PreviewInfo:
        """A signed URL to guest ``req.port`` for ``req.ttl_s`` seconds."""
        port = req.port
        check_guest_port(port)
        row = self.records.sandbox_row(sandbox_id)
        # (a hibernated one that wakes on demand is woken by its first request)
        if not (row.state == SandboxState.HIBERNATED and row.auto_resume):
            self.vms.live(sandbox_id, paused_ok=True)
        expires = int(time.time()) + req.ttl_s
        token = self.key.sign(sandbox_id, row.created_at_unix, port, expires)
        domain = self.settings.preview_domain
        url = (
            domain.url(sandbox_id, port, token, base_url)
            if domain
            else f"{base_url.rstrip('/')}/v1/preview/{token}/"
        )
        return PreviewInfo(
            url=url,
            token=token,
            expires_at=datetime.fromtimestamp(expires, tz=UTC).isoformat(),
            expires_at_unix=expires,
            port=port,
        )

    def resolve_preview(self, token: str) -> tuple[str, int]:
        """The sandbox and port a valid, unexpired token grants.

        :class:`Forbidden` for anything but a token this daemon's key signed for a
        sandbox that still has its record (so a wrong MAC and an unknown sandbox
        read the same), or one that expired; :class:`NotFound` once its sandbox
        is dead. Nothing about the sandbox is told before the MAC is checked.
        """
        claim = parse(token)
        row = self.store.get_sandbox(claim.sandbox_id)
        if row is None:
            raise Forbidden("not a valid preview URL")
        self.key.verify(claim, row.created_at_unix)
        if claim.expires_at_unix <= time.time():
            raise Forbidden("this preview URL has expired")
        if row.state == SandboxState.DEAD:
            raise NotFound(f"sandbox {claim.sandbox_id!r} of this preview URL is dead")
        return claim.sandbox_id, claim.port
