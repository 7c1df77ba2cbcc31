"""The API contract as a file: ``docs/openapi.json``, generated from the app.

``python -m forkd.controller.openapi docs/openapi.json`` rewrites it; a unit
test fails when the app and the committed file differ.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from forkd.controller.app import create_app
from forkd.controller.settings import Settings


def spec() -> dict[str, Any]:
    """The app's OpenAPI document (building it starts nothing and touches no disk)."""
    scratch = Path(tempfile.gettempdir()) / "forkd-openapi-unused"
    settings = Settings(state_dir=scratch, snapshot_root=scratch, run_dir=scratch)
    return create_app(settings).openapi()


def render() -> str:
    return json.dumps(spec(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m forkd.controller.openapi PATH", file=sys.stderr)
        return 2
    Path(argv[0]).write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
