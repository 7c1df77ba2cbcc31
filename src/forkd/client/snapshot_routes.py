"""Snapshots: build, list, inspect, compact, push and pull, delete."""

from __future__ import annotations

from typing import Any

from forkd.client.connection import JSONDict
from forkd.client.route_base import (
    Call,
    RouteBase,
    drop_none,
    label_filters,
    no_answer,
    quote_segment,
    route,
)


class SnapshotCalls(RouteBase):
    """The JSON routes of snapshots (:class:`~forkd.client.routes.Routes`)."""

    @route
    def list_snapshots(self, metadata: dict[str, str] | None = None) -> Call[list[JSONDict]]:
        """``GET /v1/snapshots`` → list of SnapshotInfo, those labelled with every pair
        of ``metadata`` only."""
        return self._json("GET", "/v1/snapshots", params=label_filters(metadata))

    @route
    def snapshot_info(self, tag: str) -> Call[JSONDict]:
        """``GET /v1/snapshots/{tag}/info``: SnapshotInfo plus sizes and lineage
        (``parent_tag``, ``chain_depth``, ``ancestors``, ``dependents``)."""
        return self._json("GET", f"/v1/snapshots/{quote_segment(tag)}/info")

    @route
    def create_snapshot(
        self,
        /,  # self only by position: **extra takes any keyword
        tag: str,
        image: str | None = None,
        memory_mib: int | None = None,
        vcpus: int | None = None,
        setup: list[str] | str | None = None,
        warmup: str | None = None,
        boot_wait_secs: float | None = None,
        *,
        start: bool | None = None,
        ready_port: int | None = None,
        ready_cmd: list[str] | str | None = None,
        ready_timeout_secs: float | None = None,
        **extra: Any,
    ) -> Call[JSONDict]:
        """``POST /v1/snapshots``: boot a template VM, warm it, snapshot it.

        ``image``: a built image's name (``python`` by default, see
        :meth:`list_images`), or a container image reference, imported first as
        :meth:`import_image` does (``registry/repo:tag``, ``docker-daemon:IMAGE``,
        ``docker-archive:PATH``, ``oci-archive:PATH[:tag]``, ``oci:DIR[:tag]``).
        A container image's Env, WorkingDir and User become the defaults of every
        command in the template and its forks. ``start``: run its Entrypoint+Cmd
        in the background before the snapshot, until ``ready_port`` (a guest TCP
        port) listens or ``ready_cmd`` (an argv, or a str run as ``/bin/sh -c``)
        exits 0, within ``ready_timeout_secs``; every fork then starts with the
        service running and warm.

        Fields left as None are not sent (the daemon's defaults apply); extra
        keyword arguments (e.g. ``kernel=``, ``volumes=``, ``metadata=``) are sent
        as given. Waits at least 30 minutes for the answer: setup commands, and a
        first import of a big image, may be slow.

        Example::

            ctl.create_snapshot("pg", image="registry.example.com/team/postgres:16",
                                start=True, ready_port=5432)
        """
        body = drop_none(
            {
                "tag": tag,
                "image": image,
                "memory_mib": memory_mib,
                "vcpus": vcpus,
                "setup": _commands(setup),
                "warmup": warmup,
                "boot_wait_secs": boot_wait_secs,
                "start": start,
                "ready_port": ready_port,
                "ready_cmd": _argv(ready_cmd),
                "ready_timeout_secs": ready_timeout_secs,
                **extra,
            }
        )
        return self._json("POST", "/v1/snapshots", json_body=body, timeout=max(self.timeout, 1800))

    @route
    def delete_snapshot(self, tag: str, cascade: bool = False, force: bool = False) -> Call[None]:
        """``DELETE /v1/snapshots/{tag}`` (running children keep running). A snapshot that
        diff snapshots are over is a 409 unless ``cascade`` (they are deleted too) or
        ``force`` (they are compacted into full snapshots and kept)."""
        params = {k: "true" for k, v in (("cascade", cascade), ("force", force)) if v}
        return self._request(
            "DELETE", f"/v1/snapshots/{quote_segment(tag)}", params=params or None
        ).then(no_answer)

    @route
    def compact_snapshot(self, tag: str, to: str | None = None) -> Call[JSONDict]:
        """``POST /v1/snapshots/{tag}/compact``: flatten a diff snapshot's chain into a full
        ``memory.bin`` in place → SnapshotInfo (``mode`` ``"full"``). With ``to``: a new
        full snapshot of that tag instead, ``tag`` left as it is → ``to``'s SnapshotInfo."""
        body = {"to": to} if to is not None else None
        return self._json(
            "POST",
            f"/v1/snapshots/{quote_segment(tag)}/compact",
            json_body=body,
            timeout=max(self.timeout, 600),
        )

    @route
    def snapshot(self, tag: str) -> Call[JSONDict]:
        """``GET /v1/snapshots/{tag}``: the SnapshotInfo without /info's detail."""
        return self._json("GET", f"/v1/snapshots/{quote_segment(tag)}")

    @route
    def push_snapshot(self, /, tag: str, ref: str, **options: Any) -> Call[JSONDict]:
        """``POST /v1/snapshots/{tag}/push`` to the OCI registry ``ref`` → ``{digest,
        bytes_uploaded, ...}``. Options: ``token``, ``insecure``, ``flatten`` (no delta)."""
        body = drop_none({"ref": ref, **options})
        path = f"/v1/snapshots/{quote_segment(tag)}/push"
        return self._json("POST", path, json_body=body, timeout=max(self.timeout, 1800))

    @route
    def pull_snapshot(self, /, ref: str, tag: str | None = None, **options: Any) -> Call[JSONDict]:
        """``POST /v1/snapshots/pull``: fetch ``ref`` as snapshot ``tag`` (default: the name
        it was pushed under) → SnapshotInfo. Options: ``token``, ``insecure``, ``metadata``."""
        body = drop_none({"ref": ref, "tag": tag, **options})
        return self._json(
            "POST", "/v1/snapshots/pull", json_body=body, timeout=max(self.timeout, 1800)
        )


def _commands(setup: list[str] | str | None) -> list[str] | None:
    """A template's setup commands: one given as a str is a list of one."""
    return [setup] if isinstance(setup, str) else setup


def _argv(command: list[str] | str | None) -> list[str] | None:
    """A command as an argv: one given as a str is run by ``/bin/sh -c``."""
    return ["/bin/sh", "-c", command] if isinstance(command, str) else command
