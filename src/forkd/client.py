"""Python SDK for the forkd daemon (``forkd serve``).

Only the standard library and ``httpx`` are imported here, so the SDK installs
and imports without the daemon's dependencies (QEMU driver, FastAPI, ...).

Example::

    from forkd.client import Sandbox, Snapshot

    snap = Snapshot.create("py", warmup="import json")   # boot, warm up, snapshot
    with Sandbox("py") as sb:                             # fork one child
        print(sb.commands.run("uname -r").stdout)
        print(sb.eval("x = 41; x + 1").result)            # '42'
        sb.files.write("/tmp/hello.txt", "hi")
        branch = sb.branch()                              # pause, snapshot, resume
        print(branch.tag, branch.pause_ms, "ms")
        for child in branch.fork(3):                      # every child sees x == 41
            with child:
                print(child.eval("x").result)

The daemon's address comes from ``FORKD_URL`` (default ``http://127.0.0.1:8889``;
``unix:/path/to.sock`` for a unix socket) and its token from ``FORKD_TOKEN`` or
the file named by ``FORKD_TOKEN_FILE``. The lower-level :class:`Controller`
maps one method to each route of the HTTP API.
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit


def _import_httpx_light() -> None:
    """Import httpx without its own command line (``httpx._main``).

    httpx's ``__init__`` imports ``httpx._main`` whenever click, rich and
    pygments are installed (as they are next to the daemon), which triples the
    import time of this SDK. Marking that one submodule as absent during the
    import makes httpx fall back to its stub ``main``; the mark is removed
    afterwards, so an explicit ``import httpx._main`` later still works.
    """
    if "httpx" in sys.modules or "httpx._main" in sys.modules:
        return
    sys.modules["httpx._main"] = None  # type: ignore[assignment]
    try:
        import httpx  # noqa: F401
    finally:
        if sys.modules.get("httpx._main", 0) is None:
            del sys.modules["httpx._main"]


_import_httpx_light()

import httpx  # noqa: E402

from forkd import __version__  # noqa: E402

__all__ = [
    "DEFAULT_URL",
    "CommandResult",
    "Commands",
    "Controller",
    "ControllerError",
    "EvalResult",
    "Files",
    "Sandbox",
    "Snapshot",
]

DEFAULT_URL = "http://127.0.0.1:8889"
_UDS_BASE = "http://forkd"

JSONDict = dict[str, Any]


class ControllerError(Exception):
    """The daemon answered with an error, or could not be reached.

    ``status`` is the HTTP status, or 0 when no HTTP answer came back (daemon
    not reachable, connection dropped, client-side timeout, unreadable token
    file). ``body`` is the parsed JSON body (or its text), ``message`` the
    body's ``error`` field when present.

    Example::

        try:
            ctl.get_sandbox("sb-nope")
        except ControllerError as exc:
            print(exc.status, exc.message)   # 404 unknown sandbox sb-nope
    """

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body

    @property
    def unreachable(self) -> bool:
        """True when no HTTP answer came back (``status == 0``)."""
        return self.status == 0

    @classmethod
    def from_response(cls, resp: httpx.Response) -> ControllerError:
        body: Any
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        message = None
        if isinstance(body, dict):
            if isinstance(body.get("error"), str):
                message = body["error"]
            elif "detail" in body:  # FastAPI's default error shape
                detail = body["detail"]
                message = detail if isinstance(detail, str) else json.dumps(detail)
        elif isinstance(body, str) and body.strip():
            message = body.strip()[:500]
        if not message:
            message = resp.reason_phrase or "error"
        return cls(resp.status_code, message, body)


def _quote(segment: str) -> str:
    """Percent-encode one URL path segment (``/`` included)."""
    return quote(str(segment), safe="")


def _read_token_file(path: str | os.PathLike[str]) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as exc:
        raise ControllerError(0, f"cannot read token file {os.fspath(path)}: {exc}") from exc
    return token or None


def _resolve_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str | None:
    if token:
        return token
    if token_file:
        return _read_token_file(token_file)
    env = os.environ.get("FORKD_TOKEN", "").strip()
    if env:
        return env
    env_file = os.environ.get("FORKD_TOKEN_FILE")
    if env_file:
        return _read_token_file(env_file)
    return None


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exit_code_of(answer: dict[str, Any]) -> int:
    """The exit code in an exec/eval answer; 124 for a timeout, -1 when missing."""
    code = answer.get("exit_code")
    if code is None:
        return 124 if answer.get("timed_out") else -1
    return int(code)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


class Controller:
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
        url = (base_url or os.environ.get("FORKD_URL") or DEFAULT_URL).strip()
        self.url: str = url
        self.timeout = float(timeout)
        self.socket_path: str | None = None
        if url.startswith("unix:"):
            path = url[len("unix:") :]
            if path.startswith("//"):  # unix:///run/forkd.sock
                path = path[2:]
            if not path:
                raise ValueError(f"no socket path in {url!r}")
            self.socket_path = path
            base = _UDS_BASE
            trust_env = False
            if transport is None:
                transport = httpx.HTTPTransport(uds=path)
        else:
            if "://" not in url:
                url = "http://" + url
            base = url.rstrip("/")
            trust_env = not _is_loopback(urlsplit(base).hostname or "")
        self.base_url: str = base
        headers = {"User-Agent": f"forkd-client/{__version__}", "Accept": "application/json"}
        resolved = _resolve_token(token, token_file)
        if resolved:
            headers["Authorization"] = f"Bearer {resolved}"
        self._client = httpx.Client(
            base_url=base,
            headers=headers,
            timeout=self.timeout,
            transport=transport,
            trust_env=trust_env,
        )

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
        try:
            resp = self._client.request(
                method,
                path,
                json=json_body,
                params=params,
                content=content,
                headers=headers,
                timeout=self.timeout if timeout is None else timeout,
            )
        except httpx.ConnectError as exc:
            raise ControllerError(
                0,
                f"the forkd daemon is not reachable at {self.url} ({exc}); "
                "start it with `forkd serve`",
            ) from exc
        except httpx.TimeoutException as exc:
            raise ControllerError(
                0, f"no answer from the forkd daemon at {self.url} in time ({method} {path})"
            ) from exc
        except httpx.TransportError as exc:
            raise ControllerError(
                0, f"talking to the forkd daemon at {self.url} failed: {exc!r}"
            ) from exc
        if not resp.is_success:
            raise ControllerError.from_response(resp)
        return resp

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self._request(method, path, **kw)
        if resp.status_code == 204 or not resp.content:
            return None
        try:
            return resp.json()
        except ValueError as exc:
            raise ControllerError(
                resp.status_code,
                f"the daemon answered {method} {path} with something that is not JSON",
                resp.text,
            ) from exc

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

    def list_snapshots(self) -> list[JSONDict]:
        """``GET /v1/snapshots`` → list of SnapshotInfo."""
        return self._json("GET", "/v1/snapshots")

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

    def delete_snapshot(self, tag: str) -> None:
        """``DELETE /v1/snapshots/{tag}`` (running children keep running)."""
        self._request("DELETE", f"/v1/snapshots/{_quote(tag)}")

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
    ) -> list[JSONDict]:
        """``POST /v1/sandboxes``: fork ``n`` children of a snapshot (all or
        nothing) → list of SandboxInfo. ``timeout_secs`` is the sandbox's
        lifetime on the daemon, not an HTTP timeout."""
        body = _drop_none(
            {
                "snapshot_tag": snapshot_tag,
                "n": n,
                "memory_limit_mib": memory_limit_mib,
                "timeout_secs": timeout_secs,
                "internet": internet,
                "per_child_netns": per_child_netns,
            }
        )
        return self._json(
            "POST", "/v1/sandboxes", json_body=body, timeout=self.timeout + 2.0 * max(n, 0)
        )

    def list_sandboxes(self) -> list[JSONDict]:
        """``GET /v1/sandboxes`` → list of SandboxInfo."""
        return self._json("GET", "/v1/sandboxes")

    def get_sandbox(self, sandbox_id: str) -> JSONDict:
        """``GET /v1/sandboxes/{id}`` → SandboxInfo."""
        return self._json("GET", self._sb(sandbox_id))

    def kill_sandbox(self, sandbox_id: str) -> None:
        """``DELETE /v1/sandboxes/{id}``: kill the VM and free its files."""
        self._request("DELETE", self._sb(sandbox_id))

    def branch_sandbox(
        self, sandbox_id: str, tag: str | None = None, mode: str | None = None
    ) -> JSONDict:
        """``POST /v1/sandboxes/{id}/branch``: pause, snapshot, resume →
        SnapshotInfo with ``branched_from`` and ``pause_ms``."""
        body = _drop_none({"tag": tag, "mode": mode})
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

    def eval_code(self, sandbox_id: str, code: str) -> JSONDict:
        """``POST /v1/sandboxes/{id}/eval`` → ``{"result", "error", "exit_code"}``,
        in the sandbox's persistent warm interpreter."""
        return self._json("POST", f"{self._sb(sandbox_id)}/eval", json_body={"code": code})

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


# -- high level ---------------------------------------------------------------


@dataclass
class CommandResult:
    """What a command printed and how it exited (124: killed by its timeout)."""

    stdout: str
    stderr: str
    exit_code: int
    raw: JSONDict = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def timed_out(self) -> bool:
        """True when the command was killed by its timeout."""
        return bool(self.raw.get("timed_out", self.exit_code == 124))


@dataclass
class EvalResult:
    """The repr of the code's final expression (``result``, None for plain
    statements) or the error text (``error``)."""

    result: str | None
    error: str | None
    exit_code: int
    stdout: str | None = None
    stderr: str | None = None
    raw: JSONDict = field(default_factory=dict, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0


class Commands:
    """``sandbox.commands``: run programs in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def run(
        self,
        cmd: str | list[str],
        timeout: float = 30,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        stdin: str | bytes | None = None,
    ) -> CommandResult:
        """Run ``cmd`` and wait for it; a str runs as ``/bin/sh -c cmd``.

        A non-zero exit is not an exception: check ``result.exit_code``.

        Example::

            r = sb.commands.run("echo $HOME; ls /nope", timeout=10)
            print(r.stdout, r.stderr, r.exit_code)
        """
        args = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(a) for a in cmd]
        sb = self._sandbox
        raw = sb.controller.exec_command(
            sb.id, args, timeout_secs=timeout, cwd=cwd, env=env, stdin=stdin
        )
        return CommandResult(
            stdout=raw.get("stdout") or "",
            stderr=raw.get("stderr") or "",
            exit_code=exit_code_of(raw),
            raw=raw,
        )


class Files:
    """``sandbox.files``: read and write files in the sandbox."""

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    def read(self, path: str) -> bytes:
        """The file's contents."""
        return self._sandbox.controller.read_file(self._sandbox.id, path)

    def read_text(self, path: str, encoding: str = "utf-8") -> str:
        """The file's contents, decoded."""
        return self.read(path).decode(encoding)

    def write(self, path: str, data: bytes | str) -> None:
        """Create or replace a file (a str is written as UTF-8)."""
        self._sandbox.controller.write_file(self._sandbox.id, path, data)

    def list(self, path: str) -> list[JSONDict]:
        """Entries of a directory: ``{"name", "type", "size", "mode", "mtime"}``."""
        return self._sandbox.controller.list_files(self._sandbox.id, path)

    def remove(self, path: str, recursive: bool = False) -> None:
        """Delete a file (or a directory tree with ``recursive=True``)."""
        self._sandbox.controller.remove_file(self._sandbox.id, path, recursive=recursive)


class Sandbox:
    """One running sandbox (a forked microVM).

    ``Sandbox(tag)`` forks a new child of snapshot ``tag``;
    ``Sandbox(sandbox_id=...)`` attaches to a running one. Used as a context
    manager it is killed on exit. Without ``controller=`` it makes its own
    :class:`Controller` from the environment (``FORKD_URL``, ``FORKD_TOKEN``).

    Example::

        with Sandbox("py", timeout_secs=600) as sb:
            r = sb.commands.run("python3 -c 'print(6*7)'")
            assert r.stdout == "42\\n"
            sb.files.write("/tmp/data.json", '{"a": 1}')
            print(sb.eval("import json; json.load(open('/tmp/data.json'))").result)
            snap = sb.branch()                  # keep this state for later
        kids = snap.fork(2)                     # two copies of it, after sb is gone
    """

    def __init__(
        self,
        tag: str | None = None,
        *,
        controller: Controller | None = None,
        sandbox_id: str | None = None,
        **spawn_kwargs: Any,
    ) -> None:
        if (tag is None) == (sandbox_id is None):
            raise ValueError("give a snapshot tag to fork from, or sandbox_id= to attach to")
        if sandbox_id is not None and spawn_kwargs:
            raise TypeError(f"spawn options given with sandbox_id: {sorted(spawn_kwargs)}")
        owns = controller is None
        ctl = controller if controller is not None else Controller()
        try:
            if tag is not None:
                info = ctl.spawn_sandboxes(tag, n=1, **spawn_kwargs)[0]
            else:
                assert sandbox_id is not None
                info = ctl.get_sandbox(sandbox_id)
        except BaseException:
            if owns:
                ctl.close()
            raise
        self._setup(ctl, info, owns)

    def _setup(self, controller: Controller, info: JSONDict, owns: bool) -> None:
        self._controller = controller
        self._info = info
        self._owns_controller = owns
        self._killed = False
        self.commands = Commands(self)
        self.files = Files(self)

    @classmethod
    def _wrap(cls, controller: Controller, info: JSONDict) -> Sandbox:
        """A Sandbox for a SandboxInfo the daemon already answered."""
        sb = cls.__new__(cls)
        sb._setup(controller, info, owns=False)
        return sb

    @classmethod
    def create(cls, tag: str, **kwargs: Any) -> Sandbox:
        """Fork one new sandbox from snapshot ``tag`` (same as ``Sandbox(tag, ...)``)."""
        return cls(tag, **kwargs)

    @property
    def id(self) -> str:
        return self._info["id"]

    @property
    def info(self) -> JSONDict:
        """The last SandboxInfo seen (see :meth:`refresh`)."""
        return self._info

    @property
    def controller(self) -> Controller:
        return self._controller

    @property
    def snapshot_tag(self) -> str | None:
        return self._info.get("snapshot_tag")

    def refresh(self) -> JSONDict:
        """Fetch the SandboxInfo again."""
        self._info = self._controller.get_sandbox(self.id)
        return self._info

    def ping(self) -> JSONDict:
        """Check the guest agent answers: ``{"pong": true, ...}``."""
        return self._controller.ping_sandbox(self.id)

    def eval(self, code: str) -> EvalResult:
        """Run Python in the sandbox's persistent interpreter.

        Example::

            sb.eval("import math; r = 2")
            print(sb.eval("math.pi * r ** 2").result)   # '12.566370614359172'
        """
        raw = self._controller.eval_code(self.id, code)
        return EvalResult(
            result=raw.get("result"),
            error=raw.get("error"),
            exit_code=int(raw.get("exit_code") or 0),
            stdout=raw.get("stdout"),
            stderr=raw.get("stderr"),
            raw=raw,
        )

    def branch(self, tag: str | None = None, mode: str | None = None) -> Snapshot:
        """Snapshot this running sandbox (it pauses briefly, then continues)."""
        info = self._controller.branch_sandbox(self.id, tag=tag, mode=mode)
        return Snapshot(info["tag"], controller=self._controller, info=info)

    def kill(self) -> None:
        """Kill the sandbox; killing it again (or one already gone) is a no-op."""
        if self._killed:
            return
        try:
            self._controller.kill_sandbox(self.id)
        except ControllerError as exc:
            if exc.status != 404:
                raise
        self._killed = True

    @property
    def killed(self) -> bool:
        return self._killed

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.kill()
        finally:
            if self._owns_controller:
                self._controller.close()

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r}, snapshot={self.snapshot_tag!r})"


class Snapshot:
    """A snapshot on the daemon: a template or a branch of a sandbox.

    Example::

        snap = Snapshot.create("py", memory_mib=512, setup=["pip install numpy"],
                               warmup="import numpy")
        kids = snap.fork(10, timeout_secs=300)
        branch = kids[0].branch()
        print(branch.branched_from, branch.pause_ms)   # 'sb-67a1b3-0001' 212
        grandkids = branch.fork(3)
    """

    def __init__(
        self,
        tag: str,
        *,
        controller: Controller | None = None,
        info: JSONDict | None = None,
    ) -> None:
        self.tag = tag
        self._controller = controller if controller is not None else Controller()
        self._info = info

    @classmethod
    def create(
        cls, tag: str, controller: Controller | None = None, **create_kwargs: Any
    ) -> Snapshot:
        """Build a template snapshot (``POST /v1/snapshots``); keyword arguments
        as :meth:`Controller.create_snapshot`."""
        ctl = controller if controller is not None else Controller()
        info = ctl.create_snapshot(tag, **create_kwargs)
        return cls(info.get("tag", tag), controller=ctl, info=info)

    @property
    def controller(self) -> Controller:
        return self._controller

    @property
    def info(self) -> JSONDict:
        """The SnapshotInfo (fetched from the daemon on first use)."""
        if self._info is None:
            self.refresh()
        assert self._info is not None
        return self._info

    @property
    def branched_from(self) -> str | None:
        """The sandbox this was branched from; None for templates."""
        return self.info.get("branched_from")

    @property
    def pause_ms(self) -> float | None:
        """How long the source sandbox was paused for the branch; None for templates."""
        return self.info.get("pause_ms")

    def refresh(self) -> JSONDict:
        """Fetch ``GET /v1/snapshots/{tag}/info`` again."""
        self._info = self._controller.snapshot_info(self.tag)
        return self._info

    def fork(self, n: int = 1, **spawn_kwargs: Any) -> list[Sandbox]:
        """Fork ``n`` sandboxes from this snapshot (all or nothing); keyword
        arguments as :meth:`Controller.spawn_sandboxes`."""
        infos = self._controller.spawn_sandboxes(self.tag, n=n, **spawn_kwargs)
        return [Sandbox._wrap(self._controller, info) for info in infos]

    def delete(self) -> None:
        """Delete the snapshot (sandboxes forked from it keep running)."""
        self._controller.delete_snapshot(self.tag)

    def __repr__(self) -> str:
        return f"Snapshot({self.tag!r})"


def _tar_directory(path: Path) -> bytes:
    """The contents of a local directory as an uncompressed tar archive."""
    import io
    import tarfile

    if not path.is_dir():
        raise ControllerError(0, f"{path} is not a directory")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for child in sorted(path.iterdir()):
            tar.add(child, arcname=child.name)
    return buf.getvalue()
