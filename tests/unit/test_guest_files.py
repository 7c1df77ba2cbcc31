"""The one list of files forkd puts into a guest (forkd.guest.guest_files): everything the
agent imports is in it, an agent installed from it alone starts and answers, and the
image and runtime keys change with any file of it.

A module the agent needs but the list forgets would break only at a VM's boot."""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import forkd
from forkd import hosttools
from forkd.guest import guest_files, kernel, recipe, rootfs, runtime
from forkd.guest import image as images

PACKAGE = Path(forkd.__file__).parent
FILES = PACKAGE / "guest" / "files"
# What init starts; forkd_eval_proc.py starts the eval worker's script by its path.
ENTRY = FILES / "forkd-agent.py"


def _named_by(path: Path) -> set[Path]:
    """The files beside the agent and the forkd package's modules that ``path`` imports,
    or names in a string (a script started by its path, a module loaded by its name)."""
    found: set[Path] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import the list cannot follow"
            modules = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.removesuffix(".py")
            if re.fullmatch(r"[\w-]+", name) and (FILES / f"{name}.py").is_file():
                found.add(FILES / f"{name}.py")
            continue
        else:
            continue
        for module in modules:
            found |= _module_files(module)
    return found


def _module_files(module: str) -> set[Path]:
    """The files ``module`` is: a sibling of the agent, or a forkd module and its packages'
    ``__init__.py`` (not forkd's own: the guest gets an empty one)."""
    if (FILES / f"{module}.py").is_file():
        return {FILES / f"{module}.py"}
    parts = module.split(".")
    if parts[0] != "forkd" or len(parts) == 1:
        return set()  # the standard library
    found = set()
    for depth in range(2, len(parts) + 1):
        base = PACKAGE.joinpath(*parts[1:depth])
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                found.add(candidate)
    return found


def _imported_by_the_agent() -> set[Path]:
    seen: set[Path] = set()
    todo = [ENTRY]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += _named_by(path)
    return seen


def _listed() -> set[Path]:
    return {PACKAGE / f.source for f in guest_files.GUEST_FILES}


def test_every_module_the_agent_imports_is_installed() -> None:
    needed = _imported_by_the_agent()
    assert {FILES / "forkd_agent_transport.py", FILES / "forkd_procs.py"} <= needed  # it looks
    assert FILES / "forkd-eval-worker.py" in needed  # started by its path
    assert PACKAGE / "archive" / "unpack.py" in needed  # forkd_tar's extractor
    missing = sorted(str(p.relative_to(PACKAGE)) for p in needed - _listed())
    assert missing == [], "add them to forkd.guest.guest_files.GUEST_FILES"


def test_every_python_file_beside_the_agent_is_installed() -> None:
    """A module beside the agent is there for the guest: one left out of the list is
    either dead or forgotten."""
    assert set(FILES.glob("*.py")) <= _listed()


def test_the_list_names_real_files_at_distinct_places() -> None:
    dests = [f.dest for f in guest_files.GUEST_FILES]
    assert len(set(dests)) == len(dests)
    for file in guest_files.GUEST_FILES:
        assert file.read(), file.source
        assert file.dest.startswith("/") and file.mode in (0o644, 0o755)
    assert [f.dest for f in guest_files.INITRAMFS_FILES] == ["/init"]
    assert [f.dest for f in guest_files.ROOT_IMAGE_FILES] == ["/etc/inittab"]


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """/opt/forkd as the root image and the runtime disk have it (busybox faked)."""
    busybox = tmp_path / "busybox-static"
    busybox.write_bytes(b"busybox")
    monkeypatch.setattr(hosttools, "require_static_busybox", lambda: busybox)
    opt = tmp_path / "opt" / "forkd"
    rootfs.install_agent(opt)
    return opt


def test_installed_files_have_their_modes(installed: Path) -> None:
    assert (installed / "init").stat().st_mode & 0o777 == 0o755
    assert (installed / "forkd_agent_transport.py").stat().st_mode & 0o777 == 0o644
    assert (installed / "forkd" / "archive" / "unpack.py").is_file()


def test_an_agent_installed_from_the_list_alone_answers(installed: Path, tmp_path: Path) -> None:
    """Run as the runtime disk runs it (isolated, no site): only the installed tree
    is importable, so a module missing from the list fails here."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_text("x")
    requests = [
        {"id": 1, "op": "ping"},
        {"id": 2, "op": "exec", "argv": ["echo", "hi"]},
        {"id": 3, "op": "file_tar_open", "path": str(tmp_path / "d")},
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-I",
            "-S",
            str(installed / "forkd-agent.py"),
            "--stdio",
            "--defaults-file",
            str(tmp_path / "defaults.json"),
        ],
        input=b"".join(json.dumps(r).encode() + b"\n" for r in requests),
        capture_output=True,
        timeout=30,
        check=True,
    )
    answers = {m["id"]: m for m in map(json.loads, proc.stdout.splitlines())}
    assert answers[1]["result"]["pong"] is True, proc.stderr
    assert answers[2]["result"]["stdout"] == "hi\n"
    assert answers[3]["ok"] is True, answers[3]


def _keys(monkeypatch: pytest.MonkeyPatch, busybox: Path) -> tuple[str, str]:
    busybox.write_bytes(b"busybox")
    monkeypatch.setattr(hosttools, "require_static_busybox", lambda: busybox)
    kpkg = kernel.KernelPackage("linux-image-cloud-amd64", "1")
    spec = recipe.builtin(images.DEFAULT_IMAGE)
    return images._image_key(spec, kpkg), runtime.key("base")


@pytest.mark.parametrize("source", ["guest/files/forkd_agent_transport.py", "archive/unpack.py"])
def test_a_changed_guest_file_rebuilds_the_image_and_the_runtime(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, source: str
) -> None:
    before = _keys(monkeypatch, tmp_path / "busybox")
    real = guest_files.GuestFile.read

    def changed(file: guest_files.GuestFile) -> bytes:
        return real(file) + (b"\n# changed" if file.source == source else b"")

    monkeypatch.setattr(guest_files.GuestFile, "read", changed)
    image_key, runtime_key = _keys(monkeypatch, tmp_path / "busybox")
    assert image_key != before[0] and runtime_key != before[1]


def test_the_digest_covers_path_mode_and_content() -> None:
    file = guest_files.GUEST_FILES[1]
    variants = [
        file,
        guest_files.GuestFile(file.source, file.dest + "x", file.mode),
        guest_files.GuestFile(file.source, file.dest, 0o644),
    ]
    digests = set()
    for variant in variants:
        h = hashlib.sha256()
        guest_files.digest(h, (variant,))
        digests.add(base64.b64encode(h.digest()))
    assert len(digests) == 3


def test_every_module_beside_the_agent_is_type_checked_strictly() -> None:
    """mypy checks the guest's modules, by the names the guest imports them by, as
    strictly as the rest of src/: no override names one to relax it."""
    config = tomllib.loads((PACKAGE.parents[1] / "pyproject.toml").read_text())["tool"]["mypy"]
    assert "src/forkd/guest/files" in config["mypy_path"] and config["strict"] is True
    assert "src/forkd" in config["files"]
    guest = {p.stem for p in FILES.glob("*.py")}
    relaxed = [o["module"] for o in config["overrides"] if guest & set(o["module"])]
    assert relaxed == []
