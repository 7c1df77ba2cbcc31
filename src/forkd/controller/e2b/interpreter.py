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

Contexts: the warm Python interpreter is the sandbox's one Python context (``default``);
a second one is refused (forkd's answer to "another namespace" is a fork). Bash
contexts may be made, each with its working directory.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from forkd import limits
from forkd.controller.e2b.interpreter_bash import bash_lines
from forkd.controller.e2b.interpreter_python import python_lines
from forkd.controller.e2b.per_sandbox import PerSandbox, still_there
from forkd.controller.e2b.rest import Svc, services
from forkd.controller.e2b.target import INTERPRETER_PORT, sandbox_dependency
from forkd.controller.http_errors import hide_host_paths
from forkd.controller.store_rows import SandboxRow
from forkd.errors import ForkdError, Invalid, NotFound

DEFAULT = "default"  # the warm Python interpreter's context
MAX_CONTEXTS = 16  # bash contexts a sandbox may hold

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
async def execute(sandbox: Sandbox, known: Known, svc: Svc, body: ExecuteBody) -> Response:
    """Run ``body.code``; E2B's lines, streamed as they come."""
    context = _execution_context(known, sandbox.id, body)
    if body.env_vars:
        raise Invalid("env_vars per execution are not supported by forkd's interpreter yet")
    context.executions += 1
    if context.language == "python":
        lines = python_lines(svc, sandbox.id, body.code)
    else:
        lines = bash_lines(svc, sandbox.id, body.code, context.cwd)
    return StreamingResponse(_ndjson(context.executions, lines), media_type="application/x-ndjson")


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


def _execution_context(known: Contexts, sandbox_id: str, body: ExecuteBody) -> Context:
    if body.context_id is not None and body.language is not None:
        raise Invalid("give a context_id or a language, not both")
    if body.context_id is not None:
        return _context(known, sandbox_id, body.context_id)
    if _language(body.language) == "python":
        return known.of(sandbox_id)[DEFAULT]
    return Context("bash", "bash", "/")  # a language without a context: a fresh shell
