"""A request's parameters as the guest agent reads them: each reader returns a checked
value or raises :class:`RequestError`, whose message the host shows as it is.

Imported by the agent's handlers from their own directory. Standard library only.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import math
import signal
from collections.abc import Iterator
from typing import Any

DEFAULT_EXEC_TIMEOUT_S = 30.0
MAX_PTY_SIDE = 1000  # columns or rows


class RequestError(ValueError):
    """A malformed request (bad or missing parameter)."""


@contextlib.contextmanager
def request_errors() -> Iterator[None]:
    """A helper's ValueErrors are about the request (no pty, offset too far, bad user)."""
    try:
        yield
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def require(req: dict[str, Any], name: str, kind: type, what: str) -> Any:
    value = req.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):  # JSON true is not 1
        raise RequestError(f"{name!r} must be {what}")
    return value


def optional(req: dict[str, Any], name: str, kind: type, what: str) -> Any:
    if req.get(name) is None:
        return None
    return require(req, name, kind, what)


def flag(req: dict[str, Any], name: str, default: bool = False) -> bool:
    value = req.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name!r} must be a boolean")
    return value


def path(req: dict[str, Any], name: str = "path") -> str:
    value = req.get(name)
    if not isinstance(value, str):
        raise RequestError(f"{name!r} must be a string")
    if not value.startswith("/"):
        raise RequestError(f"{name!r} must be an absolute path, got {value!r}")
    if "\0" in value:
        raise RequestError(f"{name!r} must not contain a NUL byte")
    return value


def base64_bytes(req: dict[str, Any], name: str) -> bytes:
    text = require(req, name, str, "a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(f"{name!r} is not valid base64: {exc}") from None


def int_param(
    req: dict[str, Any], name: str, low: int, high: int | None, default: int | None = None
) -> int:
    value = req.get(name)
    if value is None and default is not None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f"from {low} to {high}" if high is not None else f">= {low}"
        raise RequestError(f"{name!r} must be an integer {bounds}")
    return value


def seconds_param(req: dict[str, Any], name: str, default: float, high: float) -> float:
    value = req.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        raise RequestError(f"{name!r} must be a number of seconds from 0 to {high:g}")
    return float(value)


# --------------------------------------------------------------------------- commands


def exec_argv(req: dict[str, Any]) -> list[str]:
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise RequestError("'argv' must be a non-empty list of strings")
    if any("\0" in arg for arg in argv):
        raise RequestError("'argv' must not contain a NUL byte")
    return argv


def exec_timeout(req: dict[str, Any]) -> float:
    timeout = req.get("timeout")
    if timeout is None:
        timeout = DEFAULT_EXEC_TIMEOUT_S
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise RequestError("'timeout' must be a number of seconds")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise RequestError("'timeout' must be > 0 and finite")
    return float(timeout)


def env_vars(req: dict[str, Any]) -> dict[str, str]:
    """The request's own ``env`` (empty without one)."""
    extra = optional(req, "env", dict, "an object of strings or null") or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in extra.items()):
        raise RequestError("'env' must map strings to strings")
    for name, value in extra.items():
        if not name or "=" in name or "\0" in name + value:
            raise RequestError(f"'env' has an invalid variable: {name!r}")
    return dict(extra)


def cwd(req: dict[str, Any]) -> str | None:
    value = optional(req, "cwd", str, "a string or null")
    if value is not None and "\0" in value:
        raise RequestError("'cwd' must not contain a NUL byte")
    return value


def user(req: dict[str, Any]) -> str | None:
    value: str | None = optional(req, "user", str, "a string or null")
    return value


# --------------------------------------------------------------------------- background processes


def proc_argv(req: dict[str, Any]) -> list[str]:
    cmd = req.get("cmd")
    if isinstance(cmd, str) and cmd:
        argv = ["/bin/sh", "-c", cmd]
    elif isinstance(cmd, list) and cmd and all(isinstance(arg, str) for arg in cmd):
        argv = cmd
    else:
        raise RequestError("'cmd' must be a non-empty string or a non-empty list of strings")
    if any("\0" in arg for arg in argv):
        raise RequestError("'cmd' must not contain a NUL byte")
    return argv


def proc_timeout(req: dict[str, Any]) -> float | None:
    timeout = req.get("timeout_s")
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise RequestError("'timeout_s' must be a number of seconds or null")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise RequestError("'timeout_s' must be > 0 and finite")
    return float(timeout)


def pty_size(req: dict[str, Any]) -> tuple[int, int] | None:
    """(cols, rows) of the requested pseudo-terminal, or None for pipes."""
    pty = req.get("pty")
    if pty is None:
        return None
    if not isinstance(pty, dict) or set(pty) != {"cols", "rows"}:
        raise RequestError('\'pty\' must be null or {"cols": int, "rows": int}')
    return int_param(pty, "cols", 1, MAX_PTY_SIDE), int_param(pty, "rows", 1, MAX_PTY_SIDE)


def signal_number(req: dict[str, Any]) -> int:
    value = req.get("signal")
    if isinstance(value, str):
        name = value.upper() if value.upper().startswith("SIG") else "SIG" + value.upper()
        try:
            return int(signal.Signals[name])
        except KeyError:
            raise RequestError(f"unknown signal: {value!r}") from None
    if isinstance(value, int) and not isinstance(value, bool) and value in signal.valid_signals():
        return value
    raise RequestError('\'signal\' must be a signal number or a name like "SIGTERM" or "TERM"')
