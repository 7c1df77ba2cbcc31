"""docs/openapi.json is the API contract: it must match the app, route for route."""

from __future__ import annotations

import json
from pathlib import Path

from forkd.controller import openapi

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
REGENERATE = "python -m forkd.controller.openapi docs/openapi.json"


def test_committed_spec_matches_the_app() -> None:
    assert COMMITTED.is_file(), f"docs/openapi.json is missing: run {REGENERATE}"
    assert json.loads(COMMITTED.read_text()) == openapi.spec(), (
        f"the app's API changed: run {REGENERATE} and commit the result"
    )


def test_every_route_documents_its_answer() -> None:
    spec = json.loads(COMMITTED.read_text())
    missing = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            ok = [s for s in op["responses"] if s.startswith("2")]
            if not ok:
                missing.append(f"{method.upper()} {path}: no success answer")
            for status in ok:
                answer = op["responses"][status]
                if status == "204":
                    continue  # no content by definition
                schemas = [c.get("schema") for c in answer.get("content", {}).values()]
                if not schemas or not all(schemas):
                    missing.append(f"{method.upper()} {path} {status}: no schema")
    assert not missing, missing


def test_every_v1_route_documents_its_errors() -> None:
    spec = json.loads(COMMITTED.read_text())
    for path, ops in spec["paths"].items():
        if path.startswith("/v1/"):
            for method, op in ops.items():
                assert {"400", "401", "404"} <= set(op["responses"]), (method, path)
