"""The low-level SDK client: :class:`Controller`, one method per route of the HTTP API.

The JSON routes are :class:`~forkd.client.routes.Routes`, shared with the async
client; the streaming ones (processes, file streams, events, ports) are mixed in
from their own modules.
"""

from __future__ import annotations

import os
from typing import TypeVar

import httpx

from forkd.client.connection import send
from forkd.client.event_routes import EventRoutes
from forkd.client.file_routes import FileRoutes
from forkd.client.image_routes import ImageRoutes
from forkd.client.port_routes import PortRoutes
from forkd.client.process_routes import ProcessRoutes
from forkd.client.routes import EVAL_HTTP_MARGIN_SECS, KEEP, Call, Routes, SyncRunner
from forkd.client.volume_routes import _tar_directory

__all__ = ["EVAL_HTTP_MARGIN_SECS", "KEEP", "Controller", "_tar_directory"]

T = TypeVar("T")


class Controller(
    SyncRunner, Routes, ProcessRoutes, FileRoutes, EventRoutes, PortRoutes, ImageRoutes
):
    """A synchronous client of the forkd daemon: one method per HTTP route.

    Arguments:
        base_url: ``http://host:port`` or ``unix:/path/to.sock``; defaults to
            ``$FORKD_URL``, else ``http://127.0.0.1:8889``.
        token: bearer token; defaults to ``$FORKD_TOKEN``, else the contents
            of the file named by ``$FORKD_TOKEN_FILE``, else none.
        timeout: seconds to wait for an answer (exec, snapshot builds and
            large forks wait longer, see each method).
        token_file: read the token from this file instead (when ``token`` is
            not given).
        transport: an ``httpx.BaseTransport`` to use instead of the network
            (tests pass an ``httpx.MockTransport``).

    Every method raises :class:`ControllerError` on a non-2xx answer, or with
    ``status == 0`` when the daemon cannot be reached.

    Example::

        with Controller("unix:/run/forkd.sock") as ctl:
            ctl.create_snapshot("py", memory_mib=512, warmup="import numpy")
            [sb] = ctl.spawn_sandboxes("py", n=1)
            print(ctl.exec_command(sb["id"], ["python3", "-c", "print(2+2)"]))
            ctl.kill_sandbox(sb["id"])
    """

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float = 120.0,
        *,
        token_file: str | os.PathLike[str] | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        address, token = self._address(base_url, timeout, token, token_file)
        self._client = address.client(token, self.timeout, transport)

    # -- plumbing -----------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self._client.close()

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Controller({self.url!r})"

    def _run(self, call: Call[T]) -> T:
        """Send ``call`` and decode its answer (every JSON route goes through here)."""
        resp = send(
            self._client,
            self.url,
            call.method,
            call.path,
            json=call.json_body,
            params=call.params,
            content=call.content,
            headers=call.headers,
            timeout=self.timeout if call.timeout is None else call.timeout,
        )
        return call.decode(resp)
