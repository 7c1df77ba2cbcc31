"""What the sandbox and snapshot objects read from their last answer, for the sync
(:class:`~forkd.client.Sandbox`, :class:`~forkd.client.Snapshot`) and the async ones."""

from __future__ import annotations

from forkd.client.connection import JSONDict

# A branch taken with wait false, still being written: "writing" (the original forkd's
# name, and this daemon's), "pending" from daemons before it took that name.
WRITING = ("writing", "pending")


class SandboxView:
    """A sandbox object's fields, from its last SandboxInfo (``_info``)."""

    _info: JSONDict

    @property
    def id(self) -> str:
        return str(self._info["id"])

    @property
    def info(self) -> JSONDict:
        """The last SandboxInfo seen (see ``refresh``)."""
        return self._info

    @property
    def snapshot_tag(self) -> str | None:
        return self._info.get("snapshot_tag")

    @property
    def metadata(self) -> dict[str, str]:
        """The sandbox's labels (its snapshot's, with those given at the fork over them)."""
        return dict(self._info.get("metadata") or {})


class SnapshotView:
    """A snapshot object's fields, from its SnapshotInfo (``info``)."""

    @property
    def info(self) -> JSONDict:
        raise NotImplementedError

    @property
    def branched_from(self) -> str | None:
        """The sandbox this was branched from; None for templates."""
        return self.info.get("branched_from")

    @property
    def pause_ms(self) -> int | None:
        """How long the source sandbox was paused for the branch; None for templates."""
        return self.info.get("pause_ms")

    @property
    def status(self) -> str:
        """``ready``, ``pending`` (a branch still being written), ``failed`` or ``broken``."""
        return str(self.info.get("status"))

    @property
    def mode(self) -> str:
        """``full``, or ``diff`` (the pages that differ from ``info["base_tag"]``)."""
        return str(self.info.get("mode") or "full")
