"""E2B's code interpreter (``e2b_code_interpreter``'s ``run_code`` and contexts), served
at the E2B port's root for requests naming port 49999: Python runs in the sandbox's
warm interpreter (forkd's eval, the one its template was snapshotted with, so every
fork's default context starts warm), bash through the guest's own shell.

An execution answers as E2B's server does, one JSON object a line: the execution's
number, its stdout and stderr, each rich output (text, html, markdown, png, jpeg, svg,
pdf, latex, json, javascript; a matplotlib figure is a real PNG), the last value as the
main result, or the error with its name, value and traceback. A client that goes away
interrupts its execution.

Contexts: the warm Python interpreter is the sandbox's one Python context (``default``);
a second one is refused (forkd's answer to "another namespace" is a fork). Bash
contexts may be made, each with its working directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from forkd import limits
from forkd.controller.e2b.interpreter_bash import BashRun
from forkd.controller.e2b.per_sandbox import PerSandbox
from forkd.controller.e2b.process_rpc import alive
from forkd.controller.e2b.rest import Svc, services
from forkd.controller.e2b.target import INTERPRETER_PORT, port_of, sandbox_for
from forkd.controller.models import EvalRequest, EvalResult
from forkd.controller.store_rows import SandboxRow
from forkd.errors import ForkdError, Invalid, NotFound

DEFAULT = "default"  # the warm Python interpreter's context
MAX_CONTEXTS = 16  # bash contexts a sandbox may hold
DISCONNECT_POLL_SECS = 0.5
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

interpreter = APIRouter()


def target(
    request: Request,
    sandbox_id: Annotated[str | None, Header(alias="E2b-Sandbox-Id")] = None,
    port: Annotated[str | None, Header(alias="E2b-Sandbox-Port")] = None,
    token: Annotated[str | None, Header(alias="X-Access-Token")] = None,
    traffic: Annotated[str | None, Header(alias="E2B-Traffic-Access-Token")] = None,
) -> SandboxRow:
    """The sandbox the request is for (its access token, or the traffic token E2B's
    SDKs send on the calls without one)."""
    served = port_of(port) if port else INTERPRETER_PORT
    return sandbox_for(
        services(request), sandbox_id, served, token or traffic, served=INTERPRETER_PORT
    )


Sandbox = Annotated[SandboxRow, Depends(target)]


class ExecuteBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    code: str = Field(max_length=limits.JSON_BODY_LIMIT)
    context_id: str | None = None
    language: str | None = None
    env_vars: dict[str, str] | None = None


class ContextBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    language: str | None = Field(None, max_length=32)
    cwd: str | None = Field(None, max_length=4096)


@dataclass
class Context:
    id: str
    language: str
    cwd: str
    executions: int = 0

    def answer(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


class Contexts:
    """The daemon's record of each sandbox's contexts (the bash ones, and counts)."""

    def __init__(self, exists: Callable[[str], bool]) -> None:
        self._exists = exists
        self._held: PerSandbox[dict[str, Context]] = PerSandbox(
            lambda: {DEFAULT: Context(DEFAULT, "python", "/")}
        )

    def of(self, sandbox_id: str) -> dict[str, Context]:
        return self._held.of(sandbox_id, self._exists)


def contexts(request: Request) -> Contexts:
    found: Contexts | None = getattr(request.app.state, "interpreter_contexts", None)
    if found is None:
        svc = services(request)
        found = Contexts(lambda sid: alive(svc, sid))
        request.app.state.interpreter_contexts = found
    return found


Known = Annotated[Contexts, Depends(contexts)]


def _language(given: str | None) -> str:
    language = (given or "python").lower()
    if language not in ("python", "bash"):
        raise Invalid(f"no {language} here: forkd's interpreter runs python and bash")
    return language


@interpreter.post("/contexts")
async def create_context(sandbox: Sandbox, known: Known, body: ContextBody) -> Response:
    if _language(body.language) == "python":
        raise Invalid(
            "a sandbox has one Python context, its warm interpreter ('default'); "
            "fork or branch the sandbox for another"
        )
    held = known.of(sandbox.id)
    if len(held) > MAX_CONTEXTS:
        raise Invalid(f"at most {MAX_CONTEXTS} bash contexts per sandbox")
    made = Context(str(uuid.uuid4()), "bash", body.cwd or "/")
    held[made.id] = made
    return JSONResponse(made.answer())


@interpreter.get("/contexts")
async def list_contexts(sandbox: Sandbox, known: Known) -> Response:
    return JSONResponse([c.answer() for c in known.of(sandbox.id).values()])


def _context(known: Contexts, sandbox_id: str, context_id: str) -> Context:
    found = known.of(sandbox_id).get(context_id)
    if found is None:
        raise NotFound(f"no context {context_id!r} in sandbox {sandbox_id!r}")
    return found


@interpreter.delete("/contexts/{context_id}", status_code=204)
async def delete_context(sandbox: Sandbox, known: Known, context_id: str) -> Response:
    if _context(known, sandbox.id, context_id).id == DEFAULT:
        raise Invalid("the default context is the sandbox's warm interpreter: it stays")
    del known.of(sandbox.id)[context_id]
    return Response(status_code=204)


@interpreter.post("/contexts/{context_id}/restart", status_code=204)
async def restart_context(sandbox: Sandbox, known: Known, context_id: str) -> Response:
    if _context(known, sandbox.id, context_id).language == "python":
        raise Invalid("the warm interpreter is not restarted (it is what forks start from)")
    return Response(status_code=204)  # a bash context keeps nothing to restart


@interpreter.post("/execute")
async def execute(
    sandbox: Sandbox, known: Known, svc: Svc, request: Request, body: ExecuteBody
) -> Response:
    """Run ``body.code``; the answer's lines are E2B's."""
    context = _execution_context(known, sandbox.id, body)
    if body.env_vars:
        raise Invalid("env_vars per execution are not supported by forkd's interpreter yet")
    if context.language == "python":
        run: Coroutine[Any, Any, EvalResult | BashRun] = svc.guest.eval(
            sandbox.id, EvalRequest(code=body.code, timeout_s=limits.MAX_EVAL_TIMEOUT_SECS)
        )
        interrupt: Callable[[], Awaitable[None]] = functools.partial(
            _interrupt_eval, svc, sandbox.id
        )
    else:
        bash = BashRun(svc, sandbox.id)
        run, interrupt = bash.run(body.code, context.cwd), bash.kill
    outcome = await _unless_gone(request, run, interrupt)
    context.executions += 1
    lines = [{"type": "number_of_executions", "execution_count": context.executions}]
    lines += _lines(outcome)
    lines.append({"type": "end_of_execution"})
    text = "".join(json.dumps(line, separators=(",", ":")) + "\n" for line in lines)
    return Response(text, media_type="application/x-ndjson")


def _execution_context(known: Contexts, sandbox_id: str, body: ExecuteBody) -> Context:
    if body.context_id is not None and body.language is not None:
        raise Invalid("give a context_id or a language, not both")
    if body.context_id is not None:
        return _context(known, sandbox_id, body.context_id)
    if _language(body.language) == "python":
        return known.of(sandbox_id)[DEFAULT]
    return Context("bash", "bash", "/")  # a language without a context: a fresh shell


async def _unless_gone(request: Request, run: Any, interrupt: Any) -> Any:
    """``run``'s outcome; if the client goes away first, ``interrupt()`` and stop."""
    task = asyncio.ensure_future(run)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECS)
            if done:
                return task.result()
            if await request.is_disconnected():
                await interrupt()
                raise Invalid("the client went away: the execution was interrupted")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ForkdError):
                await task


async def _interrupt_eval(svc: Any, sandbox_id: str) -> None:
    with contextlib.suppress(ForkdError):
        await svc.guest.eval_interrupt(sandbox_id)


def _lines(outcome: Any) -> list[dict[str, Any]]:
    stamp = time.time_ns()
    lines: list[dict[str, Any]] = []
    if isinstance(outcome, BashRun):
        return _bash_lines(outcome, stamp)
    for stream in ("stdout", "stderr"):
        if getattr(outcome, stream, ""):
            lines.append({"type": stream, "text": getattr(outcome, stream), "timestamp": stamp})
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


def _bash_lines(run: BashRun, stamp: int) -> list[dict[str, Any]]:
    lines: list[dict[str, Any]] = []
    for stream, data in (("stdout", run.stdout), ("stderr", run.stderr)):
        if data:
            text = data.decode("utf-8", "replace")
            lines.append({"type": stream, "text": text, "timestamp": stamp})
    if run.exit_code not in (0, None):
        status = "timed out" if run.timed_out else f"exit status {run.exit_code}"
        error = run.stderr.decode("utf-8", "replace")
        lines.append({"type": "error", "name": "ShellError", "value": status, "traceback": error})
    return lines


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _result(mime: str, data: str) -> dict[str, Any] | None:
    """One rich output as E2B's result line (None for a type E2B has no field for)."""
    key = RESULT_FIELDS.get(mime)
    if key is None:
        return None
    value: Any = data
    if key == "json":
        try:  # NaN and Infinity are no JSON its SDKs read back
            value = json.loads(data, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return None
    return {"type": "result", key: value, "is_main_result": False}
