"""The low-level SDK client: :class:`Controller`, one method per route of the HTTP API."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from forkd import limits
from forkd.client.connection import Address, JSONDict, _resolve_token, json_of, send
from forkd.client.errors import ControllerError
from forkd.client.event_routes import EventRoutes
from forkd.client.file_routes import FileRoutes
from forkd.client.port_routes import PortRoutes
from forkd.client.process_routes import ProcessRoutes

# An eval's answer comes within its timeout plus the agent's grace to stop it
# and the daemon's margin (15 s): the HTTP wait allows a little more.
EVAL_HTTP_MARGIN_SECS = 30.0


def _quote(segment: str) -> str:
    """Percent-encode one URL path segment (``/`` included)."""
    return quote(str(segment), safe="")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


KEEP: Any = object()  # an optional setting left as the daemon has it


class Controller(ProcessRoutes, FileRoutes, EventRoutes, PortRoutes):
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
        address = Address.parse(base_url)
        self.url: str = address.url
        self.timeout = float(timeout)
        self.socket_path: str | None = address.socket_path
        self.base_url: str = address.base_url
        token = _resolve_token(token, token_file)
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

    def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        return send(
            self._client,
            self.url,
            method,
            path,
            json=json_body,
            params=params,
            content=content,
            headers=headers,
            timeout=self.timeout if timeout is None else timeout,
        )

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return json_of(self._request(method, path, **kw), method, path)

    @staticmethod
    def _sb(sandbox_id: str) -> str:
        return f"/v1/sandboxes/{_quote(sandbox_id)}"

    # -- discovery ----------------------------------------------------------

    def health(self) -> JSONDict:
        """``GET /healthz`` → ``{"ok": true}`` (needs no token)."""
        return self._json("GET", "/healthz")

    def version(self) -> JSONDict:
        """``GET /version`` → ``{"version": "...", "api": "v1"}``."""
        return self._json("GET", "/version")

    # -- snapshots ----------------------------------------------------------

    def list_snapshots(self, metadata: dict[str, str] | None = None) -> list[JSONDict]:
        """``GET /v1/snapshots`` → list of SnapshotInfo, those labelled with every pair
        of ``metadata`` only."""
        return self._json("GET", "/v1/snapshots", params=_label_filters(metadata))

    def snapshot_info(self, tag: str) -> JSONDict:
        """``GET /v1/snapshots/{tag}/info``: SnapshotInfo plus sizes and lineage
        (``parent_tag``, ``chain_depth``, ``ancestors``, ``dependents``)."""
        return self._json("GET", f"/v1/snapshots/{_quote(tag)}/info")

    def create_snapshot(
        self,
        tag: str,
        image: str | None = None,
        memory_mib: int | None = None,
        vcpus: int | None = None,
        setup: list[str] | str | None = None,
        warmup: str | None = None,
        boot_wait_secs: float | None = None,
        **extra: Any,
    ) -> JSONDict:
        """``POST /v1/snapshots``: boot a template VM, warm it, snapshot it.

        Fields left as None are not sent (the daemon's defaults apply); extra
        keyword arguments (e.g. ``kernel=``, ``rootfs=``) are sent as given.
        Waits at least 30 minutes for the answer: setup commands may be slow.
        """
        if isinstance(setup, str):
            setup = [setup]
        body = _drop_none(
            {
                "tag": tag,
                "image": image,
                "memory_mib": memory_mib,
                "vcpus": vcpus,
                "setup": setup,
                "warmup": warmup,
                "boot_wait_secs": boot_wait_secs,
                **extra,
            }
        )
        return self._json("POST", "/v1/snapshots", json_body=body, timeout=max(self.timeout, 1800))

    def delete_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> None:
        """``DELETE /v1/snapshots/{tag}`` (running children keep running). A snapshot that
        diff snapshots are over is a 409 unless ``cascade`` (they are deleted too) or
        ``force`` (they are compacted into full snapshots and kept)."""
        params = {k: "true" for k, v in (("cascade", cascade), ("force", force)) if v}
        self._request("DELETE", f"/v1/snapshots/{_quote(tag)}", params=params or None)

    def compact_snapshot(self, tag: str) -> JSONDict:
        """``POST /v1/snapshots/{tag}/compact``: flatten a diff snapshot's chain into a full
        ``memory.bin`` in place → SnapshotInfo (``mode`` ``"full"``)."""
        return self._json(
            "POST", f"/v1/snapshots/{_quote(tag)}/compact", timeout=max(self.timeout, 600)
        )

    def snapshot(self, tag: str) -> JSONDict:
        """``GET /v1/snapshots/{tag}``: the SnapshotInfo without /info's detail."""
        return self._json("GET", f"/v1/snapshots/{_quote(tag)}")

    # -- volumes ------------------------------------------------------------

    def create_volume(
        self, name: str, size: str | int = "1G", from_dir: str | os.PathLike[str] | None = None
    ) -> JSONDict:
        """``POST /v1/volumes``: an ext4 volume; ``from_dir`` (local) is copied into it.

        Example::

            ctl.create_volume("data", "2G", from_dir="./dataset")
            ctl.create_snapshot("py", volumes=[{"name": "data", "path": "/mnt/data"}])
        """
        content = _tar_directory(Path(from_dir)) if from_dir is not None else b""
        return self._json(
            "POST", "/v1/volumes", params={"name": name, "size": str(size)}, content=content,
            headers={"Content-Type": "application/x-tar"}, timeout=max(self.timeout, 600),
        )  # fmt: skip

    def list_volumes(self) -> list[JSONDict]:
        """``GET /v1/volumes``: each with ``size_bytes``, ``allocated_bytes``, ``used_by``."""
        return self._json("GET", "/v1/volumes")

    def volume_info(self, name: str) -> JSONDict:
        return self._json("GET", f"/v1/volumes/{_quote(name)}")

    def delete_volume(self, name: str) -> None:
        """``DELETE /v1/volumes/{name}``; 409 while a snapshot or sandbox uses it."""
        self._request("DELETE", f"/v1/volumes/{_quote(name)}")

    # -- sandboxes ----------------------------------------------------------

    def spawn_sandboxes(
        self,
        snapshot_tag: str,
        n: int = 1,
        memory_limit_mib: int | None = None,
        timeout_secs: float | None = None,
        internet: bool | None = None,
        per_child_netns: bool | None = None,
        metadata: dict[str, str] | None = None,
        on_timeout: str | None = None,
        timeout_s: float | None = None,
        idle_timeout_s: float | None = None,
    ) -> list[JSONDict]:
        """``POST /v1/sandboxes``: fork ``n`` children of a snapshot (all or
        nothing) → list of SandboxInfo. ``timeout_s`` (or ``timeout_secs``) is the sandbox's
        lifetime on the daemon, not an HTTP timeout, and ``on_timeout`` what it
        does then (``"kill"``, ``"pause"``, ``"hibernate"`` or ``"branch"``), also
        after ``idle_timeout_s`` seconds with no API call and no process output;
        ``metadata`` labels them (over the snapshot's labels, which they inherit)."""
        body = _drop_none(
            {
                "snapshot_tag": snapshot_tag,
                "n": n,
                "memory_limit_mib": memory_limit_mib,
                "timeout_secs": timeout_secs,
                "internet": internet,
                "per_child_netns": per_child_netns,
                "metadata": metadata,
                "on_timeout": on_timeout,
                "timeout_s": timeout_s,
                "idle_timeout_s": idle_timeout_s,
            }
        )
        return self._json(
            "POST", "/v1/sandboxes", json_body=body, timeout=self.timeout + 2.0 * max(n, 0)
        )

    def list_sandboxes(
        self,
        state: str | None = None,
        snapshot: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> list[JSONDict]:
        """``GET /v1/sandboxes`` → list of SandboxInfo: those in ``state``, forked from
        ``snapshot`` and labelled with every pair of ``metadata``, when given."""
        params = {**_drop_none({"state": state, "snapshot": snapshot}), **_label_filters(metadata)}
        return self._json("GET", "/v1/sandboxes", params=params)

    def get_sandbox(self, sandbox_id: str) -> JSONDict:
        """``GET /v1/sandboxes/{id}`` → SandboxInfo."""
        return self._json("GET", self._sb(sandbox_id))

    def kill_sandbox(self, sandbox_id: str) -> None:
        """``DELETE /v1/sandboxes/{id}``: kill the VM and free its files."""
        self._request("DELETE", self._sb(sandbox_id))

    def set_sandbox_timeout(
        self, sandbox_id: str, timeout_s: float | None, idle_timeout_s: Any = KEEP
    ) -> JSONDict:
        """``POST /v1/sandboxes/{id}/timeout``: its timeout ``timeout_s`` from now (None:
        none), and its idle timeout when given (None removes it) → SandboxInfo with
        ``expires_at``."""
        body: JSONDict = {"timeout_s": timeout_s}
        if idle_timeout_s is not KEEP:
            body["idle_timeout_s"] = idle_timeout_s
        return self._json("POST", f"{self._sb(sandbox_id)}/timeout", json_body=body)

    def pause_sandbox(self, sandbox_id: str, hibernate: bool = False) -> JSONDict:
        """``POST /v1/sandboxes/{id}/pause``: stop its vCPUs, memory kept; with
        ``hibernate``, write it to disk and end its QEMU → SandboxInfo."""
        body = {"hibernate": True} if hibernate else None
        return self._json("POST", f"{self._sb(sandbox_id)}/pause", json_body=body)

    def resume_sandbox(self, sandbox_id: str, timeout_s: float | None = None) -> JSONDict:
        """``POST /v1/sandboxes/{id}/resume``: run it again, clock set, or wake it from
        hibernation; ``timeout_s`` a new timeout from now → SandboxInfo."""
        body = {"timeout_s": timeout_s} if timeout_s is not None else None
        return self._json("POST", f"{self._sb(sandbox_id)}/resume", json_body=body)

    def branch_sandbox(
        self,
        sandbox_id: str,
        tag: str | None = None,
        mode: str | None = None,
        metadata: dict[str, str] | None = None,
        wait: bool = True,
    ) -> JSONDict:
        """``POST /v1/sandboxes/{id}/branch``: pause, snapshot, resume →
        SnapshotInfo with ``branched_from`` and ``pause_ms``; ``metadata`` labels
        the branch (over the sandbox's labels). ``mode``: ``"full"`` (default),
        ``"diff"`` (only the pages that differ from the sandbox's snapshot) or
        ``"live"`` (taken as full). ``wait=False``: answered at once with ``status``
        ``"pending"``; poll :meth:`snapshot` until ``"ready"`` or ``"failed"``."""
        body = _drop_none({"tag": tag, "mode": mode, "metadata": metadata})
        if not wait:
            body["wait"] = False
        return self._json("POST", f"{self._sb(sandbox_id)}/branch", json_body=body)

    def exec_command(
        self,
        sandbox_id: str,
        args: list[str],
        timeout_secs: float = 30,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
    ) -> JSONDict:
        """``POST /v1/sandboxes/{id}/exec`` → ``{"stdout", "stderr", "exit_code"}``.

        ``timeout_secs`` bounds the command in the guest (exit code 124 when it
        runs out); the HTTP request waits 30 s longer than that.
        """
        if isinstance(stdin, bytes):
            stdin = stdin.decode("utf-8")
        body = _drop_none(
            {
                "args": list(args),
                "timeout_secs": timeout_secs,
                "cwd": cwd,
                "env": env,
                "stdin": stdin,
            }
        )
        return self._json(
            "POST",
            f"{self._sb(sandbox_id)}/exec",
            json_body=body,
            timeout=float(timeout_secs) + 30.0,
        )

    def eval_code(self, sandbox_id: str, code: str, timeout_s: float | None = None) -> JSONDict:
        """``POST /v1/sandboxes/{id}/eval`` → ``{"result", "error", "exit_code", "display",
        ...}``, in the sandbox's persistent warm interpreter. The guest interrupts the
        code after ``timeout_s`` (default: the daemon's, 60 s)."""
        body = _drop_none({"code": code, "timeout_s": timeout_s})
        wait = limits.EVAL_TIMEOUT_SECS if timeout_s is None else float(timeout_s)
        return self._json(
            "POST", f"{self._sb(sandbox_id)}/eval", json_body=body,
            timeout=max(self.timeout, wait + EVAL_HTTP_MARGIN_SECS),
        )  # fmt: skip

    def interrupt_eval(self, sandbox_id: str) -> JSONDict:
        """``POST /v1/sandboxes/{id}/eval/interrupt`` → ``{"interrupted": bool}``:
        KeyboardInterrupt in the running eval (false when none was running)."""
        return self._json("POST", f"{self._sb(sandbox_id)}/eval/interrupt")

    def ping_sandbox(self, sandbox_id: str) -> JSONDict:
        """``POST /v1/sandboxes/{id}/ping`` → ``{"pong": true, ...}``."""
        return self._json("POST", f"{self._sb(sandbox_id)}/ping")

    # -- files --------------------------------------------------------------

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        """``GET /v1/sandboxes/{id}/files?path=`` → the file's bytes."""
        resp = self._request("GET", f"{self._sb(sandbox_id)}/files", params={"path": path})
        return resp.content

    def write_file(self, sandbox_id: str, path: str, data: bytes | str) -> None:
        """``PUT /v1/sandboxes/{id}/files?path=`` with the raw bytes (a str is
        written as UTF-8)."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        self._request(
            "PUT",
            f"{self._sb(sandbox_id)}/files",
            params={"path": path},
            content=bytes(data),
            headers={"Content-Type": "application/octet-stream"},
        )

    def list_files(self, sandbox_id: str, path: str) -> list[JSONDict]:
        """``GET /v1/sandboxes/{id}/files/list?path=`` → entries
        ``{"name", "type", "size", "mode", "mtime"}``."""
        body = self._json("GET", f"{self._sb(sandbox_id)}/files/list", params={"path": path})
        if isinstance(body, dict) and isinstance(body.get("entries"), list):
            return body["entries"]
        return body

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> None:
        """``DELETE /v1/sandboxes/{id}/files?path=&recursive=true|false``."""
        self._request(
            "DELETE",
            f"{self._sb(sandbox_id)}/files",
            params={"path": path, "recursive": "true" if recursive else "false"},
        )


def _tar_directory(path: Path) -> bytes:
    """The contents of a local directory as a gzip-compressed tar archive.

    Compressed, more fits in the daemon's 32 MiB body limit; the daemon tells
    gzip from plain tar by its first bytes (and always has).
    """
    import io
    import tarfile

    if not path.is_dir():
        raise ControllerError(0, f"{path} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=6) as tar:
        for child in sorted(path.iterdir()):
            tar.add(child, arcname=child.name)
    return buf.getvalue()


def _label_filters(metadata: dict[str, str] | None) -> dict[str, str]:
    """``metadata`` as the list routes' query parameters: ``metadata.KEY=VALUE``."""
    return {f"metadata.{key}": value for key, value in (metadata or {}).items()}
