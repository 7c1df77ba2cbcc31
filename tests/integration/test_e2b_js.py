"""E2B's own npm SDKs (``e2b`` and ``@e2b/code-interpreter``, pinned in tests/e2b_js's
lock file, installed with ``npm ci``) against the suite's real daemon and its E2B port:
commands, files, a streamed watch (Connect's server streams as connect-web reads them),
the code interpreter and a template build, from node's test runner."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .conftest import Daemon
from .test_typescript_sdk import _node_major

pytestmark = pytest.mark.integration

TESTS = Path(__file__).resolve().parents[1] / "e2b_js"


@pytest.mark.skipif(_node_major() < 20, reason="E2B's npm SDK needs node 20 (./dev.sh installs it)")
def test_e2bs_npm_sdks_against_a_real_daemon(daemon: Daemon, api_template: str) -> None:
    npm = shutil.which("npm")
    assert npm is not None, "npm is missing beside node"
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund"],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    env = {
        **os.environ,
        "E2B_API_URL": daemon.e2b_url,
        "E2B_SANDBOX_URL": daemon.e2b_url,
        "E2B_API_KEY": daemon.token,
        "E2B_VOLUME_API_URL": daemon.e2b_url,  # a volume's content API
        "E2B_TEMPLATE": api_template,
    }
    run = subprocess.run(
        [npm, "test"], cwd=TESTS, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "# fail 0" in run.stdout and "# pass 4" in run.stdout, run.stdout[-3000:]
