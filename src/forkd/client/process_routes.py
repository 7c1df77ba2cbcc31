"""A sandbox's background processes as methods of :class:`~forkd.client.Controller`."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import httpx
from httpx_sse import EventSource, ServerSentEvent

from forkd.client.connection import JSONDict
from forkd.client.errors import ControllerError
from forkd.client.results import OutputEvent
from forkd.client.route_base import Call, RouteBase, no_answer, route, written_of

STREAM_READ_TIMEOUT_SECS = 60.0  # the daemon sends a keep-alive every 15 s of silence


def _event(sse: ServerSentEvent) -> OutputEvent:
    body = json.loads(sse.data)
    kind = sse.event
    if kind in ("stdout", "stderr", "pty"):
        raw = body["data"]
        data = base64.b64decode(raw) if body.get("encoding") == "base64" else raw.encode()
        return OutputEvent(kind, data, body["offset"], body["next_offset"])
    if kind == "gap":
        return OutputEvent(kind, offset=body["from"], next_offset=body["to"])
    if kind == "exit":
        return OutputEvent(kind, exit_code=body.get("exit_code"))
    if kind == "error":
        raise ControllerError(int(body.get("status") or 502), str(body.get("error")), body)
    return OutputEvent(kind)  # a kind this SDK does not know yet: passed on, empty


class ProcessCalls(RouteBase):
    """The JSON routes of processes (:class:`~forkd.client.routes.Routes`)."""

    # -- processes (their output streams: ProcessRoutes) ----------------------

    def _procs(self, sandbox_id: str, pid: int | None = None) -> str:
        base = f"{self._sb(sandbox_id)}/processes"
        return base if pid is None else f"{base}/{int(pid)}"

    @route
    def start_process(
        self,
        sandbox_id: str,
        cmd: list[str] | str,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bool = False,
        pty: tuple[int, int] | None = None,
        timeout_s: float | None = None,
        user: str | None = None,
    ) -> Call[JSONDict]:
        """``POST /v1/sandboxes/{id}/processes`` → ProcessInfo (``pid``, ``running``, ...).

        A str ``cmd`` runs as ``/bin/sh -c cmd``; ``pty`` is ``(cols, rows)``;
        ``timeout_s`` kills it (exit code 124). It keeps running after this returns.
        """
        body: JSONDict = {
            "cmd": cmd if isinstance(cmd, str) else [str(a) for a in cmd],
            "stdin": stdin,
        }
        for key, value in (("env", env), ("cwd", cwd), ("timeout_s", timeout_s), ("user", user)):
            if value is not None:
                body[key] = value
        if pty is not None:
            body["pty"] = {"cols": pty[0], "rows": pty[1]}
        return self._json("POST", self._procs(sandbox_id), json_body=body)

    @route
    def list_processes(self, sandbox_id: str) -> Call[list[JSONDict]]:
        """``GET /v1/sandboxes/{id}/processes``: running ones and recently exited ones."""
        return self._json("GET", self._procs(sandbox_id))

    @route
    def get_process(self, sandbox_id: str, pid: int) -> Call[JSONDict]:
        """``GET /v1/sandboxes/{id}/processes/{pid}`` → ProcessInfo."""
        return self._json("GET", self._procs(sandbox_id, pid))

    @route
    def send_stdin(
        self, sandbox_id: str, pid: int, data: str | bytes, eof: bool = False
    ) -> Call[int]:
        """``POST .../processes/{pid}/stdin``; the bytes written. ``eof`` closes stdin after."""
        if isinstance(data, bytes):
            body = {"data": base64.b64encode(data).decode(), "encoding": "base64", "eof": eof}
        else:
            body = {"data": data, "eof": eof}
        answer = self._json("POST", f"{self._procs(sandbox_id, pid)}/stdin", json_body=body)
        return answer.then(written_of)

    @route
    def signal_process(
        self, sandbox_id: str, pid: int, signal: int | str = "SIGTERM"
    ) -> Call[None]:
        """``POST .../processes/{pid}/signal``: to its whole process group."""
        path = f"{self._procs(sandbox_id, pid)}/signal"
        return self._request("POST", path, json_body={"signal": signal}).then(no_answer)

    @route
    def resize_process(self, sandbox_id: str, pid: int, cols: int, rows: int) -> Call[None]:
        """``POST .../processes/{pid}/resize``: its terminal's size."""
        path = f"{self._procs(sandbox_id, pid)}/resize"
        return self._request("POST", path, json_body={"cols": cols, "rows": rows}).then(no_answer)


class ProcessRoutes(ProcessCalls):
    """Mixed into Controller: a process's output stream (its other routes: ProcessCalls)."""

    _client: httpx.Client

    def process_output(
        self, sandbox_id: str, pid: int, offset: int = 0, follow: bool = True
    ) -> Iterator[OutputEvent]:
        """``GET .../processes/{pid}/output``: its output from ``offset`` as it comes.

        With ``follow`` the events end with ``exit``; without, at what there is
        now. A lost connection raises :class:`ControllerError` (status 0): call
        again from the last event's ``next_offset`` to resume.

        Example::

            for ev in ctl.process_output(sid, pid):
                print(ev.kind, ev.text if ev.data else ev.exit_code)
        """
        path = f"{self._procs(sandbox_id, pid)}/output"
        params = {"offset": offset, "follow": "true" if follow else "false"}
        timeout = httpx.Timeout(self.timeout, read=max(self.timeout, STREAM_READ_TIMEOUT_SECS))
        headers = {"Accept": "text/event-stream"}
        try:
            with self._client.stream(
                "GET", path, params=params, headers=headers, timeout=timeout
            ) as resp:
                if not resp.is_success:
                    resp.read()
                    raise ControllerError.from_response(resp)
                for sse in EventSource(resp).iter_sse():
                    # httpx-sse makes an event of a keep-alive (a comment) once an
                    # earlier event set an id; the SSE spec dispatches no event
                    # without data.
                    if sse.data:
                        yield _event(sse)
        except httpx.TransportError as exc:
            raise ControllerError(
                0, f"the output stream of the forkd daemon at {self.url} failed: {exc!r}"
            ) from exc
