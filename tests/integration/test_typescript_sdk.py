"""The TypeScript SDK (sdk/typescript) against the suite's daemon: built with tsc from a
clean install (npm ci), then its own tests run under node's test runner, a busybox-only
container image (an OCI archive) among what they import and start."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests import oci_images
from tests.integration.test_container_images import CONFIG, busybox_image

pytestmark = pytest.mark.integration

SDK = Path(__file__).resolve().parents[2] / "sdk" / "typescript"


def _node_major() -> int:
    node = shutil.which("node")
    if node is None:
        return 0
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().lstrip("v").split(".")[0])


@pytest.mark.skipif(_node_major() < 20, reason="needs node 20 or later (./dev.sh installs it)")
def test_typescript_sdk_against_a_real_daemon(
    daemon: Any, api_template: str, tmp_path: Path
) -> None:
    npm = shutil.which("npm")
    assert npm is not None, "npm is missing beside node"
    done = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund"], cwd=SDK, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(SDK / "dist", ignore_errors=True)  # as a clean checkout: npm test builds
    archive = oci_images.write_oci_archive(tmp_path / "busybox.tar", {"1": busybox_image()})
    env = {
        **os.environ,
        "FORKD_URL": daemon.url,
        "FORKD_TOKEN": daemon.token,
        "FORKD_TEMPLATE": api_template,
        "FORKD_IMAGE_REF": f"oci-archive:{archive}:1",
        "FORKD_IMAGE_USER": str(CONFIG["User"]),
        "FORKD_IMAGE_PORT": "8080",
        "FORKD_IMAGE_MISSING": f"oci-archive:{archive}:nosuch",
        "FORKD_IMAGE_ARCHIVE": str(archive),  # sent by the SDK: POST /v1/images/load
    }
    run = subprocess.run(
        [npm, "test"], cwd=SDK, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "# fail 0" in run.stdout and "# skipped 0" in run.stdout
