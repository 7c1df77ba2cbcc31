"""Where hibernated sandboxes keep their state: snapshot directories beside the others.

A hibernated sandbox is a snapshot of it (``memory.bin``, ``vmstate``,
``snapshot.json``, as any snapshot) at ``<snapshot root>/.hibernated.<id>.<n>``,
plus ``network.json``: the address it had, which it gets back on waking when
it is free. ``n`` grows with each hibernation of the sandbox; the highest
committed one is its state. The one before stays while the woken VM maps its
``memory.bin`` and is removed at the next hibernation or when the sandbox goes.

Being under the snapshot root, the directories are seen by everything that
asks which snapshots use a volume layer or an image
(:func:`forkd.vmm.snapshot.files.recorded_volumes`, ``forkd image rm``), so
neither is collected while a sandbox sleeps on it. Their names start with a
dot: they are never registered as snapshots.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from forkd.vmm.snapshot import files as snapshot_files

PREFIX = ".hibernated."
NETWORK_FILE = "network.json"


class HibernatedFiles:
    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def owner(dir_name: str) -> str | None:
        """The sandbox id of a hibernation directory's name, else None."""
        if not dir_name.startswith(PREFIX):
            return None
        sid, _, gen = dir_name[len(PREFIX) :].rpartition(".")
        return sid if sid and gen.isdigit() else None

    def _generations(self, sandbox_id: str) -> list[tuple[int, Path]]:
        found = []
        with contextlib.suppress(FileNotFoundError):
            for d in self.root.iterdir():
                name = d.name
                if self.owner(name) == sandbox_id:
                    found.append((int(name.rpartition(".")[2]), d))
        return sorted(found)

    def next_dir(self, sandbox_id: str) -> Path:
        """Where the sandbox's next hibernation is written (it does not exist yet)."""
        gens = self._generations(sandbox_id)
        return self.root / f"{PREFIX}{sandbox_id}.{gens[-1][0] + 1 if gens else 1}"

    def latest(self, sandbox_id: str) -> Path | None:
        """The sandbox's newest committed hibernation, if it has one."""
        for _, d in reversed(self._generations(sandbox_id)):
            if (d / snapshot_files.META).is_file():
                return d
        return None

    def discard(self, sandbox_id: str, keep: Path | None = None) -> None:
        """Remove the sandbox's hibernation directories, all but ``keep``."""
        for _, d in self._generations(sandbox_id):
            if d != keep:
                shutil.rmtree(d, ignore_errors=True)

    def sleepers(self) -> set[str]:
        """The ids of every sandbox with a hibernation directory."""
        if not self.root.is_dir():
            return set()
        return {sid for d in self.root.iterdir() if (sid := self.owner(d.name)) is not None}

    # ------------------------------------------------------------ address

    @staticmethod
    def save_network(state_dir: Path, net: dict[str, Any] | None) -> None:
        """Record the address the sandbox had (atomically; none: nothing)."""
        if net is None:
            return
        tmp = state_dir / f".{NETWORK_FILE}.tmp"
        tmp.write_text(json.dumps(net))
        os.replace(tmp, state_dir / NETWORK_FILE)

    @staticmethod
    def saved_network(state_dir: Path) -> dict[str, Any] | None:
        try:
            data = json.loads((state_dir / NETWORK_FILE).read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None
