"""A cgroup filesystem in a temporary directory, with the kernel's part played."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any


class FakeCgroupFS:
    """A cgroup filesystem in a temporary directory, with the kernel's part played.

    ``v2``: one tree whose root lists its controllers in ``cgroup.controllers``;
    else v1, one tree per controller. ``swap``: the kernel accounts swap, so
    the swap files exist. Install it with ``monkeypatch`` over
    :func:`forkd.vmm.jail.cgroups.make_dir` and ``remove_dir``: a new group is
    filled with the files the kernel would create, removing one refuses
    (``EBUSY``) while a live process is in it, as the kernel does.
    """

    def __init__(
        self,
        root: Path,
        v2: bool,
        swap: bool = True,
        controllers: tuple[str, ...] = ("memory", "cpu", "pids"),
    ) -> None:
        self.root, self.v2, self.swap, self.controllers = root, v2, swap, controllers
        if v2:
            root.mkdir(parents=True)
            (root / "cgroup.controllers").write_text(" ".join(("cpuset", *controllers)) + "\n")
            (root / "cgroup.subtree_control").write_text("")
            (root / "cgroup.procs").write_text("")
        else:
            for c in controllers:
                self._fill_v1(root / c, c, top=True)

    def install(self, monkeypatch: Any) -> FakeCgroupFS:
        from forkd.vmm.jail import cgroups

        monkeypatch.setattr(cgroups, "make_dir", self.mkdir)
        monkeypatch.setattr(cgroups, "remove_dir", self.rmdir)
        return self

    def _fill_v1(self, d: Path, controller: str, top: bool = False) -> None:
        d.mkdir(parents=top, exist_ok=top)
        files = {"cgroup.procs": "", "tasks": ""}
        if controller == "memory":
            files.update(
                {"memory.limit_in_bytes": "9223372036854771712\n", "memory.usage_in_bytes": "0\n"}
            )
            if self.swap:
                files["memory.memsw.limit_in_bytes"] = "9223372036854771712\n"
        elif controller == "cpu":
            files.update({"cpu.cfs_period_us": "100000\n", "cpu.cfs_quota_us": "-1\n"})
        elif controller == "pids" and not top:
            files["pids.max"] = "max\n"
        for name, text in files.items():
            (d / name).write_text(text)

    def mkdir(self, path: Path) -> None:
        if self.v2:
            parent_enabled = (path.parent / "cgroup.subtree_control").read_text()
            enabled = [e.lstrip("+") for e in parent_enabled.split()]
            path.mkdir()
            files = {
                "cgroup.procs": "",
                "cgroup.controllers": " ".join(enabled) + "\n",
                "cgroup.subtree_control": "",
            }
            if "memory" in enabled:
                files.update({"memory.max": "max\n", "memory.current": "0\n"})
                if self.swap:
                    files["memory.swap.max"] = "max\n"
            if "cpu" in enabled:
                files["cpu.max"] = "max 100000\n"
            if "pids" in enabled:
                files["pids.max"] = "max\n"
            for name, text in files.items():
                (path / name).write_text(text)
            return
        controller = path.relative_to(self.root).parts[0]
        if path.exists():
            raise FileExistsError(path)
        self._fill_v1(path, controller)

    def rmdir(self, path: Path) -> None:
        if not path.is_dir():
            raise FileNotFoundError(path)
        pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
        if any(d.is_dir() for d in path.iterdir()) or any(_alive(p) for p in pids):
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        shutil.rmtree(path)

    def groups(self) -> list[Path]:
        """Every VM group left: directories two levels below a hierarchy's root."""
        tops = [self.root] if self.v2 else [self.root / c for c in self.controllers]
        return sorted(g for t in tops for g in t.glob("*/*") if g.is_dir())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"  # a zombie has left its groups
    except OSError:
        return False
