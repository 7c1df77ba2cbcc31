"""The original forkd's published clients, installed from PyPI into a venv of their own
(their package is named ``forkd`` too): its SDK (``forkd==0.5.3``: ``Controller`` over
REST, ``Sandbox`` over the agent protocol) and its MCP server (``forkd-mcp``).

The venv is made once per host under the build cache and reused; a test that cannot
install them (no route to PyPI) is skipped saying so. Their code runs only in that
venv's interpreter, as a user's script would: never imported here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from forkd import file_lock, paths

PACKAGES = ("forkd==0.5.3", "forkd-mcp==0.2.1")
INSTALL_TIMEOUT_SECS = 600


def venv() -> Path:
    """The venv holding :data:`PACKAGES` (made now if missing); its directory."""
    root = paths.cache_dir() / "test-venvs" / "original-forkd"
    marker = root / ".installed"
    wanted = json.dumps(PACKAGES)
    with file_lock.locked(root.parent / ".lock"):  # xdist workers, or two suites
        if marker.is_file() and marker.read_text() == wanted:
            return root
        shutil.rmtree(root, ignore_errors=True)
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", str(root)],
                check=True,
                capture_output=True,
                timeout=120,
            )
            subprocess.run(
                [
                    str(root / "bin" / "python"),
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    *PACKAGES,
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_SECS,
            )
        except subprocess.CalledProcessError as exc:
            shutil.rmtree(root, ignore_errors=True)
            said = (exc.stderr or "").strip()[-400:] if isinstance(exc.stderr, str) else ""
            pytest.skip(f"cannot install {', '.join(PACKAGES)} from PyPI: {said}")
        marker.write_text(wanted)
    return root


def run_script(script: str, url: str, token: str, timeout: float = 300) -> dict:
    """Run ``script`` with the original SDK's interpreter, pointed at the daemon by its
    own variables (FORKD_URL, FORKD_TOKEN) before anything runs; the JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORKD_")}
    env |= {"FORKD_URL": url, "FORKD_TOKEN": token, "PYTHONNOUSERSITE": "1"}
    done = subprocess.run(
        [str(venv() / "bin" / "python"), "-I", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))
