"""Image recipes: a directory with ``recipe.toml`` (and files it copies in).

::

    name = "postgres"
    description = "PostgreSQL 15, running in every child"

    [image]
    packages = ["postgresql"]          # Debian packages (python3 is always there)
    pip = []                           # PyPI packages pip-installed at build time
    run = ["echo built > /etc/motd"]   # shell commands run in the image at build time
    [image.files]                      # file in the recipe dir -> absolute path in the image
    "files/app.py" = "/opt/app/app.py"

    [template]                         # defaults for templates made from this image
    memory_mib = 512
    vcpus = 1
    setup = ["pg_ctlcluster 15 main start"]   # run in the booted template, before the snapshot
    warmup = "import json"                    # run in the agent's warm interpreter

A recipe is trusted build input, like a Dockerfile: its ``run`` commands run
as root in a chroot of the image being built. They reach that chroot's shell
through a script file, never a host shell command line.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from forkd import limits
from forkd.errors import ImageError

RECIPE_FILE = "recipe.toml"
NAME_RE = limits.NAME_RE
DEBIAN_PACKAGE_RE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
PIP_SPEC_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-\[\],<>=!~]*$")
TEMPLATE_KEYS = {"memory_mib", "vcpus", "setup", "warmup"}


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str = ""
    suite: str = "bookworm"
    packages: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    run: tuple[str, ...] = ()
    files: tuple[tuple[Path, str], ...] = ()  # (file in the recipe dir, path in the image)
    template: dict[str, Any] = field(default_factory=dict)
    dir: Path | None = None

    @property
    def customized(self) -> bool:
        return bool(self.pip or self.run or self.files)

    def apt_packages(self) -> list[str]:
        extra = ["python3-pip"] if self.pip else []
        return sorted({"python3", *self.packages, *extra})

    def base_key(self, variant: str) -> str:
        """Hash of everything that goes into the Debian tree (before forkd's files)."""
        h = hashlib.sha256()
        h.update(repr((self.suite, variant, self.apt_packages(), self.pip, self.run)).encode())
        for src, dest in self.files:
            h.update(dest.encode() + b"\0" + hashlib.sha256(src.read_bytes()).digest())
        return h.hexdigest()[:16]


def _fail(where: str, message: str) -> ImageError:
    return ImageError(f"{where}: {message}")


def _strings(where: str, value: Any, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise _fail(where, f"'{key}' must be a list of non-empty strings")
    return tuple(value)


def load(recipe_dir: Path) -> Recipe:
    """Read and check ``recipe_dir/recipe.toml``; errors name the file and the key."""
    path = recipe_dir / RECIPE_FILE
    where = str(path)
    data = _read(path)
    unknown = set(data) - {"name", "description", "image", "template"}
    if unknown:
        raise _fail(where, f"unknown keys {sorted(unknown)}")
    name = data.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise _fail(where, f"'name' must match {NAME_RE.pattern}, got {name!r}")
    image = _image_table(where, data)
    packages = _each_matching(where, image, "packages", DEBIAN_PACKAGE_RE, "a Debian package name")
    pip = _each_matching(
        where, image, "pip", PIP_SPEC_RE, "a pip requirement (no spaces or options)"
    )
    files = _files(where, recipe_dir, image)
    template = _template_table(where, data)
    suite = image.get("suite", "bookworm")
    if not isinstance(suite, str) or not DEBIAN_PACKAGE_RE.fullmatch(suite):
        raise _fail(where, f"image.suite {suite!r} is not a Debian suite name")
    return Recipe(
        name=name,
        description=str(data.get("description", "")),
        suite=suite,
        packages=packages,
        pip=pip,
        run=_strings(where, image.get("run"), "image.run"),
        files=files,
        template=dict(template),
        dir=recipe_dir,
    )


def _read(path: Path) -> dict[str, Any]:
    """The TOML file at ``path``; missing or unreadable, an ImageError naming it."""
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise _fail(str(path), "missing: a recipe is a directory holding recipe.toml") from exc
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise _fail(str(path), f"unreadable: {exc}") from exc


def _image_table(where: str, data: dict[str, Any]) -> dict[str, Any]:
    """The recipe's [image] table (empty when it has none)."""
    image = data.get("image", {})
    if not isinstance(image, dict):
        raise _fail(where, "[image] must be a table")
    unknown = set(image) - {"suite", "packages", "pip", "run", "files"}
    if unknown:
        raise _fail(where, f"unknown keys in [image]: {sorted(unknown)}")
    return image


def _each_matching(
    where: str, image: dict[str, Any], key: str, pattern: re.Pattern[str], what: str
) -> tuple[str, ...]:
    """``image.<key>``: strings each of which ``pattern`` matches (``what`` they are)."""
    values = _strings(where, image.get(key), f"image.{key}")
    for v in values:
        if not pattern.fullmatch(v):
            raise _fail(where, f"{v!r} is not {what}")
    return values


def _files(where: str, recipe_dir: Path, image: dict[str, Any]) -> tuple[tuple[Path, str], ...]:
    """``image.files``: (a file inside the recipe's directory, its absolute path in the
    image) pairs."""
    files = []
    root = recipe_dir.resolve()
    for src, dest in (image.get("files") or {}).items():
        full = (recipe_dir / src).resolve()
        if not full.is_relative_to(root) or not full.is_file():
            raise _fail(where, f"image.files: {src!r} is not a file inside {recipe_dir}")
        if not isinstance(dest, str) or not dest.startswith("/") or "\0" in dest or ".." in dest:
            raise _fail(where, f"image.files: destination {dest!r} must be an absolute path")
        files.append((full, dest))
    return tuple(files)


def _template_table(where: str, data: dict[str, Any]) -> dict[str, Any]:
    """The recipe's [template] table (empty when it has none), its values checked."""
    template = data.get("template", {})
    if not isinstance(template, dict) or set(template) - TEMPLATE_KEYS:
        raise _fail(where, f"[template] takes only {sorted(TEMPLATE_KEYS)}")
    for key in ("memory_mib", "vcpus"):
        if key in template and not isinstance(template[key], int):
            raise _fail(where, f"template.{key} must be an integer")
    _strings(where, template.get("setup"), "template.setup")
    if "warmup" in template and not isinstance(template["warmup"], str):
        raise _fail(where, "template.warmup must be a string")
    return template


def builtin_dir(name: str) -> Path:
    """The directory of a recipe shipped with forkd."""
    base = resources.files("forkd.guest").joinpath("recipes")
    return Path(str(base)) / name


def builtin_names() -> list[str]:
    base = Path(str(resources.files("forkd.guest").joinpath("recipes")))
    return sorted(p.name for p in base.iterdir() if (p / RECIPE_FILE).is_file())


def builtin(name: str) -> Recipe:
    if name not in builtin_names():
        raise ImageError(
            f"unknown image {name!r}: built-in images are {', '.join(builtin_names())}; "
            "pass --recipe DIR for your own"
        )
    return load(builtin_dir(name))
