"""Python for E2B's code interpreter: the code runs in the sandbox's warm interpreter
(forkd's eval), its output passed on as it comes (the guest is asked every
:data:`PEEK_SECS` what the eval printed so far), then each rich output, the last value
as the main result or the error, as E2B's lines. A client that goes away interrupts it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio

from forkd import limits
from forkd.controller.models import EvalRequest, EvalResult
from forkd.controller.services import Services
from forkd.errors import ForkdError, Invalid

PEEK_SECS = 0.2
# E2B's result fields, by the MIME type forkd's eval reports a display output as.
RESULT_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}


def env_code(language: str, env: dict[str, str], name: str) -> tuple[str, str]:
    """Code that gives one execution ``env`` (E2B's ``envs`` of ``run_code``), and code
    that puts back what the variables were (kept meanwhile in the global ``name``). The
    values go in as a JSON text in a string literal, parsed in the guest: never spliced
    into code as code."""
    text = json.dumps(env)
    if language == "javascript":
        return (
            f"globalThis.{name} = JSON.parse({json.dumps(text)}); globalThis.{name} = "
            f"[Object.entries(globalThis.{name}).map(([k]) => [k, process.env[k]]), "
            f"globalThis.{name}]; for (const [k, v] of Object.entries(globalThis.{name}[1])) "
            f"process.env[k] = v; undefined",
            f"for (const [k, v] of globalThis.{name}[0]) {{ if (v === undefined) delete "
            f"process.env[k]; else process.env[k] = v }}; delete globalThis.{name}; undefined",
        )
    return (
        f"{name} = (lambda os, env: ({{k: os.environ.get(k) for k in env}}, "
        f"os.environ.update(env))[0])(__import__('os'), __import__('json').loads({text!r}))",
        "(lambda os, saved: [os.environ.pop(k, None) if v is None else "
        "os.environ.__setitem__(k, v) for k, v in saved.items()])(__import__('os'), "
        f"{name})\ndel {name}",
    )


async def python_lines(
    svc: Services,
    sandbox_id: str,
    code: str,
    context: str | None = None,
    env: dict[str, str] | None = None,
    language: str = "python",
) -> AsyncGenerator[dict[str, Any], None]:
    """The eval's lines; ``context``: in that eval context (a worker of its own, Python or
    JavaScript: its output comes when it ends), not the warm interpreter; ``env``: the
    execution's own variables, set before it and put back after it (:func:`env_code`)."""
    wrap = env_code(language, env, f"__forkd_env_{secrets.token_hex(6)}") if env else None
    try:
        if wrap is not None:
            await _setup_eval(svc, sandbox_id, wrap[0], context)
        async for line in _eval_lines(svc, sandbox_id, code, context):
            yield line
    finally:
        if wrap is not None:  # also after a setup that failed part way
            with anyio.CancelScope(shield=True), contextlib.suppress(ForkdError):
                await _setup_eval(svc, sandbox_id, wrap[1], context)


async def _setup_eval(svc: Services, sandbox_id: str, code: str, context: str | None) -> None:
    done = await svc.guest.eval(sandbox_id, EvalRequest(code=code, timeout_s=30), context=context)
    if done.error:
        raise Invalid(f"the execution's envs could not be set: {done.error}")


async def _eval_lines(
    svc: Services, sandbox_id: str, code: str, context: str | None
) -> AsyncIterator[dict[str, Any]]:
    tag = secrets.token_hex(8)
    request = EvalRequest(code=code, timeout_s=limits.MAX_EVAL_TIMEOUT_SECS)
    task = asyncio.ensure_future(svc.guest.eval(sandbox_id, request, tag=tag, context=context))
    sent = {"stdout": 0, "stderr": 0}
    try:
        while not (await asyncio.wait({task}, timeout=PEEK_SECS))[0]:
            if context is None:  # a context's worker tells its output at the end
                for line in await _printed(svc, sandbox_id, tag, sent):
                    yield line
        outcome = task.result()
    finally:
        if not task.done():  # the client went away: the eval is interrupted
            with anyio.CancelScope(shield=True), contextlib.suppress(ForkdError):
                await svc.guest.eval_interrupt(sandbox_id, context)
            task.cancel()
    for stream in ("stdout", "stderr"):
        rest = str(getattr(outcome, stream))[sent[stream] :]
        if rest:
            yield {"type": stream, "text": rest, "timestamp": time.time_ns()}
    for line in _results(outcome):
        yield line


async def _printed(
    svc: Services, sandbox_id: str, tag: str, sent: dict[str, int]
) -> list[dict[str, Any]]:
    """What the eval printed since ``sent``'s offsets (which move past it)."""
    try:
        peek = await svc.guest.call(
            sandbox_id,
            lambda vm: vm.guest.eval_peek(tag, sent["stdout"], sent["stderr"]),
            wake=False,
        )
    except ForkdError:  # an older agent, or none just now: the answer brings it all
        return []
    if not peek["running"]:
        return []
    lines = []
    for stream, text in (("stdout", peek["stdout"]), ("stderr", peek["stderr"])):
        if text:
            sent[stream] += len(text)
            lines.append({"type": stream, "text": text, "timestamp": time.time_ns()})
    return lines


def _results(outcome: EvalResult) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for shown in outcome.display:
        result = _result(shown.mime, shown.data)
        if result is not None:
            lines.append(result)
    if outcome.traceback:
        name, _, value = (outcome.error or "").partition(": ")
        lines.append(
            {"type": "error", "name": name, "value": value, "traceback": outcome.traceback}
        )
    elif outcome.result is not None:
        lines.append({"type": "result", "text": outcome.result, "is_main_result": True})
    return lines


MAX_JSON_DEPTH = 100  # of a rich JSON output: deeper is left out, never parsed
_JSON_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKETS = re.compile(r"[\[\]{}]")


def _too_deep(data: str) -> bool:
    """Whether ``data`` nests past MAX_JSON_DEPTH (read without parsing it: a deep one
    would make the parser recurse to the interpreter's limit)."""
    depth = 0
    for bracket in _JSON_BRACKETS.finditer(_JSON_STRINGS.sub('""', data)):
        depth += 1 if bracket.group() in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            return True
    return False


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _result(mime: str, data: str) -> dict[str, Any] | None:
    """One rich output as E2B's result line (None for a type E2B has no field for)."""
    key = RESULT_FIELDS.get(mime)
    if key is None:
        return None
    value: Any = data
    if key == "json":
        if _too_deep(data):
            return None
        try:  # NaN and Infinity are no JSON its SDKs read back
            value = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
    return {"type": "result", key: value, "is_main_result": False}
