"""Install the vendored dependencies as pip would install their wheels, offline.

vendor/ holds each dependency as its unpacked wheel: the package and its .dist-info.
Each is copied into a site directory (default .deps/), its RECORD and INSTALLER written
as pip writes them, every module byte-compiled, and a .pth file in the interpreter's
site-packages puts the directory on sys.path: every python3 in the machine imports them.

Usage: python3 tools/install_vendored.py [--target DIR] [--site-packages DIR]
"""

from __future__ import annotations

import argparse
import base64
import compileall
import hashlib
import shutil
import site
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PTH = "storefinder-deps.pth"


def record_line(path: Path, target: Path) -> str:
    """RECORD's line for ``path``: its name, sha256 (urlsafe base64) and size."""
    digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=")
    return f"{path.relative_to(target).as_posix()},sha256={digest.decode()},{path.stat().st_size}"


def install(dist_info: Path, target: Path) -> str:
    """Copy one distribution into ``target``: its .dist-info and its top-level names."""
    names = [dist_info.name, *(dist_info / "top_level.txt").read_text().split()]
    for name in names:
        shutil.rmtree(target / name, ignore_errors=True)
        shutil.copytree(dist_info.parent / name, target / name,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    (target / dist_info.name / "INSTALLER").write_text("install_vendored\n")
    files = sorted(p for name in names for p in (target / name).rglob("*") if p.is_file())
    lines = [*(record_line(p, target) for p in files), f"{dist_info.name}/RECORD,,"]
    (target / dist_info.name / "RECORD").write_text("\n".join(lines) + "\n")
    meta = (dist_info / "METADATA").read_text().splitlines()
    fields = dict(line.split(": ", 1) for line in meta if ": " in line)
    return f"{fields['Name']} {fields['Version']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vendor", type=Path, default=ROOT / "vendor")
    parser.add_argument("--target", type=Path, default=ROOT / ".deps")
    parser.add_argument("--site-packages", type=Path, default=Path(site.getsitepackages()[0]))
    args = parser.parse_args()
    target = args.target.resolve()
    target.mkdir(parents=True, exist_ok=True)
    installed = [install(d, target) for d in sorted(args.vendor.glob("*.dist-info"))]
    if not compileall.compile_dir(target, quiet=1):
        print(f"byte-compiling {target} failed", file=sys.stderr)
        return 1
    args.site_packages.mkdir(parents=True, exist_ok=True)
    (args.site_packages / PTH).write_text(f"{target}\n")
    print(f"installed {', '.join(installed)} into {target} ({args.site_packages / PTH})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
