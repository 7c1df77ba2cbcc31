"""Eval contexts beyond the agent's one warm interpreter (E2B's code interpreter
contexts): each a worker process of its own (forkd_eval_proc.py), Python or
JavaScript (Node.js, where the image has it), with its own namespace and working
directory, started at its first eval as the image's user with the image's environment.

Ops (docs/guest-agent.md): ``eval_context_open`` names one, ``eval`` and
``eval_interrupt`` with ``context`` run in it, ``eval_context_close`` ends it and its
state. A fork inherits each context's worker as it was, like every process.
Standard library only (runs in the guest).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import forkd_eval_proc

MAX_CONTEXTS = 16
CONTEXT_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PROGRAMS = {"python": forkd_eval_proc.PYTHON, "javascript": forkd_eval_proc.NODE}
DEFAULT = "default"  # the agent's own interpreter (or its image worker): not one of these

# A launch for a context: the image's environment and user, in the given directory.
LaunchIn = Callable[[str | None], forkd_eval_proc.Launch]


class NoContext(Exception):
    """No eval context of that id (its class name is what the host reads)."""


def context_param(req: dict[str, Any]) -> str | None:
    """A request's ``context``: None (or "default") for the agent's own interpreter."""
    context = req.get("context")
    if context is None or context == DEFAULT:
        return None
    if not isinstance(context, str) or not CONTEXT_ID.fullmatch(context):
        raise ValueError("'context' must be 1-64 characters of A-Z, a-z, 0-9, '_' and '-'")
    return context


class Contexts:
    def __init__(self, launch_in: LaunchIn) -> None:
        self._launch_in = launch_in
        self._held: dict[str, forkd_eval_proc.ImagePython] = {}
        self._lock = threading.Lock()

    def open(self, req: dict[str, Any]) -> dict[str, Any]:
        context = context_param(req)
        if context is None:
            raise ValueError("'context' must name a context other than 'default'")
        language = req.get("language", "python")
        program = PROGRAMS.get(language) if isinstance(language, str) else None
        if program is None:
            raise ValueError(f"'language' must be one of {sorted(PROGRAMS)}")
        cwd = req.get("cwd")
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/") or "\0" in cwd):
            raise ValueError("'cwd' must be an absolute path or null")
        with self._lock:
            if context in self._held:
                return {"created": False}
            if len(self._held) >= MAX_CONTEXTS:
                raise ValueError(f"at most {MAX_CONTEXTS} eval contexts")
            self._held[context] = forkd_eval_proc.ImagePython(lambda: self._launch_in(cwd), program)
        return {"created": True}

    def get(self, context: str) -> forkd_eval_proc.ImagePython:
        with self._lock:
            found = self._held.get(context)
        if found is None:
            raise NoContext(f"no eval context {context!r}")
        return found

    def close(self, req: dict[str, Any]) -> dict[str, Any]:
        context = context_param(req)
        if context is None:
            raise ValueError("the default context is not closed")
        with self._lock:
            found = self._held.pop(context, None)
        if found is not None:
            found.stop()
        return {"closed": found is not None}

    def reseed(self, seed: int) -> None:
        """A restored VM made unique: each context's worker reseeded (a JavaScript one
        its Math.random). Every context is seen to, then the first failure raised."""
        with self._lock:
            held = list(self._held.values())
        failures: list[Exception] = []
        for runner in held:
            try:
                runner.reseed(seed)
            except Exception as exc:  # the rest are still reseeded
                failures.append(exc)
        if failures:
            raise failures[0]
