"""What a push writes to and a pull reads from: a registry's repository
(:class:`~forkd.oci.registry.Registry`), or a snapshot archive on disk
(:mod:`forkd.controller.services.snapshot_archive`)."""

from __future__ import annotations

from typing import Protocol

from forkd.oci.reference import Reference


class PushTarget(Protocol):
    """Where :func:`forkd.oci.push.push` puts blobs, then the manifest."""

    ref: Reference

    def has_blob(self, digest: str) -> bool: ...

    def put_blob(self, data: bytes, digest: str) -> None: ...

    def put_manifest(self, body: bytes, reference: str) -> str: ...

    def has_manifest(self, reference: str) -> bool: ...

    def close(self) -> None: ...


class PullSource(Protocol):
    """Where :mod:`forkd.oci.pull` reads a manifest and its blobs, each checked."""

    ref: Reference

    def get_manifest(self, reference: str) -> tuple[bytes, str]: ...

    def get_blob(self, digest: str, size: int) -> bytes: ...

    def has_manifest(self, reference: str) -> bool: ...

    def close(self) -> None: ...
