"""E2B's code interpreter (``e2b_code_interpreter``'s ``run_code`` and contexts), served
at the E2B port's root for requests naming port 49999: Python runs in the sandbox's
warm interpreter (forkd's eval, the one its template was snapshotted with, so every
fork's default context starts warm), bash through the guest's own shell.

An execution answers as E2B's server does, one JSON object a line, streamed: the
execution's number, its stdout and stderr as they come, each rich output (text, html,
markdown, png, jpeg, svg, pdf, latex, json, javascript; a matplotlib figure is a real
PNG), the last value as the main result, or the error with its name, value and
traceback (:mod:`.interpreter_python`, :mod:`.interpreter_bash`). A client that goes
away stops its execution.

Contexts: the warm Python interpreter is the sandbox's ``default`` context. Another
Python context, or a JavaScript one (where the image has Node.js), is a worker process
of its own in the guest (the agent's eval contexts), with its own namespace and working
directory; its output comes when an execution ends. Bash contexts are the guest's
shell, each with its working directory.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from forkd import limits
from forkd.controller.e2b.interpreter_bash import bash_lines
from forkd.controller.e2b.interpreter_python import python_lines
from forkd.controller.e2b.models import bad_env_name
from forkd.controller.e2b.per_sandbox import PerSandbox, still_there
from forkd.controller.e2b.rest import Svc, services
from forkd.controller.e2b.target import INTERPRETER_PORT, sandbox_dependency
from forkd.controller.http_errors import hide_host_paths
from forkd.controller.services import Services
from forkd.controller.store_rows import SandboxRow
from forkd.errors import ForkdError, Invalid, NotFound

DEFAULT = "default"  # the warm Python interpreter's context
JS_DEFAULT = "js-default"  # JavaScript run without a context: one made at its first use
MAX_CONTEXTS = 16  # contexts a sandbox may hold besides the default
MAX_ENV_VARS = 256  # of one execution
LANGUAGES = {
    "python": "python",
    "py": "python",
    "javascript": "javascript",
    "js": "javascript",
    "bash": "bash",
    "sh": "bash",
}
WORKERS = ("python", "javascript")  # a context of these is an eval context in the guest

interpreter = APIRouter()


Sandbox = Annotated[SandboxRow, Depends(sandbox_dependency(INTERPRETER_PORT))]


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
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # its executions, in turn

    def answer(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


# The daemon's record of each sandbox's contexts (the bash ones, and counts).
Contexts = PerSandbox[dict[str, Context]]


def contexts(request: Request) -> Contexts:
    found: Contexts | None = getattr(request.app.state, "interpreter_contexts", None)
    if found is None:
        svc = services(request)
        found = PerSandbox(
            lambda: {DEFAULT: Context(DEFAULT, "python", "/")},
            lambda sid: still_there(svc, sid),
        )
        request.app.state.interpreter_contexts = found
    return found


Known = Annotated[Contexts, Depends(contexts)]


def _language(given: str | None) -> str:
    language = LANGUAGES.get((given or "python").lower())
    if language is None:
        raise Invalid(
            f"no {given} here: forkd's interpreter runs python, javascript (where the "
            "image has Node.js) and bash"
        )
    return language


@interpreter.post("/contexts")
async def create_context(sandbox: Sandbox, known: Known, svc: Svc, body: ContextBody) -> Response:
    held = known.of(sandbox.id)
    if len(held) > MAX_CONTEXTS:
        raise Invalid(f"at most {MAX_CONTEXTS} contexts per sandbox besides the default")
    language = _language(body.language)
    made = Context(str(uuid.uuid4()), language, body.cwd or "/")
    if language in WORKERS:
        await svc.guest.open_context(sandbox.id, made.id, language, body.cwd)
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
async def delete_context(sandbox: Sandbox, known: Known, svc: Svc, context_id: str) -> Response:
    context = _context(known, sandbox.id, context_id)
    if context.id == DEFAULT:
        raise Invalid("the default context is the sandbox's warm interpreter: it stays")
    del known.of(sandbox.id)[context_id]
    if context.language in WORKERS:
        await svc.guest.close_context(sandbox.id, context.id)
    return Response(status_code=204)


@interpreter.post("/contexts/{context_id}/restart", status_code=204)
async def restart_context(sandbox: Sandbox, known: Known, svc: Svc, context_id: str) -> Response:
    """A fresh namespace: the context's worker ended and a new one opened in its place."""
    context = _context(known, sandbox.id, context_id)
    if context.id == DEFAULT:
        raise Invalid("the warm interpreter is not restarted (it is what forks start from)")
    if context.language in WORKERS:
        await svc.guest.close_context(sandbox.id, context.id)
        cwd = context.cwd if context.cwd != "/" else None
        await svc.guest.open_context(sandbox.id, context.id, context.language, cwd)
        context.executions = 0
    return Response(status_code=204)  # a bash context keeps nothing to restart


@interpreter.post("/execute")
async def execute(sandbox: Sandbox, known: Known, svc: Svc, body: ExecuteBody) -> Response:
    """Run ``body.code``; E2B's lines, streamed as they come."""
    context = await _execution_context(known, svc, sandbox.id, body)
    env = _checked_env(body.env_vars)
    context.executions += 1
    if context.language in WORKERS:  # one execution at a time, its envs its own
        worker = None if context.id == DEFAULT else context.id
        run = python_lines(svc, sandbox.id, body.code, worker, env or None, context.language)
        lines = _one_at_a_time(context.lock, run)
    else:
        lines = bash_lines(svc, sandbox.id, body.code, context.cwd, env or None)
    return StreamingResponse(_ndjson(context.executions, lines), media_type="application/x-ndjson")


def _checked_env(given: dict[str, str] | None) -> dict[str, str]:
    """An execution's ``env_vars``: names without '=' or NUL (nor ``__proto__``), values
    without NUL, both valid Unicode (no lone surrogate)."""
    env = given or {}
    if len(env) > MAX_ENV_VARS:
        raise Invalid(f"at most {MAX_ENV_VARS} env_vars in one execution")
    bad = [k for k, v in env.items() if not _fits_env(k, v)]
    if bad:
        raise Invalid(f"env_vars: {bad[0]!r} is not a variable name, or its value cannot be one")
    return env


def _fits_env(name: str, value: str) -> bool:
    try:
        (name + value).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return not bad_env_name(name) and "\0" not in value and name != "__proto__"


async def _one_at_a_time(
    lock: asyncio.Lock, lines: AsyncGenerator[dict[str, Any], None]
) -> AsyncIterator[dict[str, Any]]:
    """``lines`` once the context's earlier executions are done; closed (its client gone:
    interrupted, its envs put back) before the next one starts."""
    async with lock:
        try:
            async for line in lines:
                yield line
        finally:
            await lines.aclose()


async def _ndjson(count: int, lines: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """E2B's NDJSON: the execution's number, its lines, its end (a failure of the sandbox
    meanwhile is its error line: the answer's status went out with the first)."""
    yield _encoded({"type": "number_of_executions", "execution_count": count})
    try:
        async for line in lines:
            yield _encoded(line)
    except ForkdError as exc:
        failed = {"type": "error", "name": "SandboxError", "value": hide_host_paths(str(exc))}
        yield _encoded({**failed, "traceback": ""})
    yield _encoded({"type": "end_of_execution"})


def _encoded(line: dict[str, Any]) -> bytes:
    return (json.dumps(line, separators=(",", ":")) + "\n").encode()


async def _execution_context(
    known: Contexts, svc: Services, sandbox_id: str, body: ExecuteBody
) -> Context:
    if body.context_id is not None and body.language is not None:
        raise Invalid("give a context_id or a language, not both")
    if body.context_id is not None:
        return _context(known, sandbox_id, body.context_id)
    language = _language(body.language)
    held = known.of(sandbox_id)
    if language == "python":
        return held[DEFAULT]
    if language == "javascript":  # one made at the first use, as E2B's server has
        if JS_DEFAULT not in held:
            await svc.guest.open_context(sandbox_id, JS_DEFAULT, "javascript")
            held[JS_DEFAULT] = Context(JS_DEFAULT, "javascript", "/")
        return held[JS_DEFAULT]
    return Context("bash", "bash", "/")  # a language without a context: a fresh shell
