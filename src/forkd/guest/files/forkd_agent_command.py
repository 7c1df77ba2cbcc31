"""What a command the guest agent starts runs with: its environment, working directory,
user and shell, from the request, else from the image's defaults.

The image's defaults (a container image's config: environment, working
directory, user) are set by the host's ``configure`` op once, at the template's
boot, and so held by every snapshot and fork of it. Imported by the agent's
handlers from their own directory. Standard library only.
"""

from __future__ import annotations

import os
from typing import Any

import forkd_agent_params as params
import forkd_identity

BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# A command's HOME, unless its environment (the image's or the request's) sets one,
# is its user's home directory from the image's /etc/passwd.
SHELL = "/bin/sh"
FALLBACK_SHELL = ("/opt/forkd/busybox", "sh")  # for an image without /bin/sh

# What the image sets for every command that does not say otherwise.
IMAGE_DEFAULTS = forkd_identity.ImageDefaults()

# A sandbox forked with a seed: FORKD_SEED, and the directory whose sitecustomize seeds
# Python's random from it first on PYTHONPATH (set by the restore op).
SEED_DIR = "/opt/forkd/seed"
SEED_ENV: dict[str, str] = {}


def set_seed(seed: int) -> None:
    """Every command started from now on gets ``seed`` (see :data:`SEED_ENV`)."""
    path = IMAGE_DEFAULTS.env.get("PYTHONPATH")
    SEED_ENV.clear()
    SEED_ENV.update(
        {"FORKD_SEED": str(seed), "PYTHONPATH": f"{SEED_DIR}:{path}" if path else SEED_DIR}
    )


def set_image_defaults(defaults: forkd_identity.ImageDefaults) -> None:
    """Take the image's defaults for every command started from now on."""
    global IMAGE_DEFAULTS
    IMAGE_DEFAULTS = defaults


def env(req: dict[str, Any], home: str = "/root") -> dict[str, str]:
    """The base environment, the image's over it, the seed's (a seeded sandbox), then
    the request's ``env``."""
    extra = params.env_vars(req)
    return {**BASE_ENV, "HOME": home, **IMAGE_DEFAULTS.env, **SEED_ENV, **extra}


def identity(req: dict[str, Any]) -> forkd_identity.Identity:
    """Who the request's command runs as: its ``user``, else the image's, else root."""
    user = params.user(req) or IMAGE_DEFAULTS.user
    if user is None:
        return forkd_identity.ROOT
    with params.request_errors():
        return forkd_identity.resolve(user)


def cwd(req: dict[str, Any]) -> str | None:
    """The request's ``cwd``, else the image's working directory (None: the agent's)."""
    value = params.cwd(req)
    return value if value is not None else IMAGE_DEFAULTS.cwd


def with_shell(argv: list[str]) -> list[str]:
    """``argv``, its /bin/sh swapped for forkd's own where the image has none."""
    if argv[0] == SHELL and not os.path.lexists(SHELL):
        return [*FALLBACK_SHELL, *argv[1:]]
    return argv
