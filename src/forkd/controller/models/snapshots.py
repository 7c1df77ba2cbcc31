"""Snapshots: a template's build, a branch, compaction, pushes and pulls, and what each answers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from forkd import limits
from forkd.controller.models.common import (
    INSECURE,
    ON_STOP,
    ON_STOP_TIMEOUT,
    REGISTRY_REF,
    REGISTRY_TOKEN,
    TAG,
    Metadata,
    StrictBody,
    original_field,
)
from forkd.controller.models.network import NetworkPolicy
from forkd.controller.models.sandboxes import Egress, VolumeAttach


class SnapshotCreate(StrictBody):
    tag: str = TAG
    image: str | None = Field(
        None,
        max_length=4096,
        description="a built image's name (see GET /v1/images; default python), or a "
        "container image reference, imported first (see POST /v1/images)",
    )
    kernel: str | None = None
    rootfs: str | None = None
    rw: bool = original_field(False, "the guest's root is always writable (an overlay per VM)")
    tap: str | None = original_field(None, "the daemon makes each VM's network")
    # Unset fields take the image recipe's [template] defaults, then forkd's.
    memory_mib: int | None = Field(None, ge=limits.MIN_MEMORY_MIB, le=limits.MAX_MEMORY_MIB)
    vcpus: int | None = Field(None, ge=1, le=limits.MAX_VCPUS)
    setup: list[str] = Field(default_factory=list, max_length=limits.MAX_SETUP_COMMANDS)
    warmup: str | None = None
    boot_wait_secs: float = Field(limits.BOOT_TIMEOUT_SECS, gt=0, le=limits.MAX_BOOT_TIMEOUT_SECS)
    volumes: list[VolumeAttach] = Field(default_factory=list, max_length=limits.MAX_VOLUMES_PER_VM)
    egress: Egress | None = Field(None, description="the template's and its forks' default")
    network: NetworkPolicy | None = Field(
        None, description="the same as egress, by name and with rules (give one of the two)"
    )
    env: (
        dict[
            Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")],
            Annotated[str, StringConstraints(max_length=8192)],
        ]
        | None
    ) = Field(
        None,
        max_length=128,
        description="the environment of every command and eval in the template and its "
        "forks (over an image's own); '${secrets.NAME}' stays a placeholder in the guest",
    )
    metadata: Metadata = Field(default_factory=dict)
    # A container image's service, started and ready before the snapshot: every fork
    # of it starts with the service running and warm.
    start: bool = Field(
        False, description="run the image's Entrypoint+Cmd as a background process first"
    )
    ready_port: int | None = Field(
        None, ge=1, le=65535, description="with start: wait until a guest TCP port listens"
    )
    ready_cmd: list[str] | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="with start: wait until this command exits 0 (run again every 0.5 s)",
    )
    ready_timeout_secs: float = Field(
        limits.READY_TIMEOUT_SECS,
        gt=0,
        le=limits.MAX_BOOT_TIMEOUT_SECS,
        description="how long start may take to be ready (with no ready_port nor ready_cmd: "
        "the image's one exposed TCP port is waited for, if it has exactly one)",
    )
    on_stop: str | None = ON_STOP
    on_stop_timeout_s: float = ON_STOP_TIMEOUT


class SnapshotPush(StrictBody):
    ref: str = REGISTRY_REF
    token: str | None = REGISTRY_TOKEN
    insecure: bool = INSECURE
    flatten: bool = Field(
        False, description="send the whole memory, never a delta over a pushed parent"
    )


class SnapshotPull(StrictBody):
    ref: str = REGISTRY_REF
    tag: str | None = Field(
        None,
        pattern=limits.NAME_PATTERN,
        description="the local name; default: the name it was pushed under, else the ref's tag",
    )
    token: str | None = REGISTRY_TOKEN
    insecure: bool = INSECURE
    metadata: Metadata = Field(default_factory=dict)


class PushResult(BaseModel):
    ref: str
    digest: str = Field(description="the manifest's digest: pull ref@digest for exactly this")
    bytes_uploaded: int = Field(description="bytes the registry did not have yet")
    bytes_total: int = Field(description="bytes of every blob and the manifest")
    layers: int
    layers_uploaded: int
    encoding: Literal["chunks", "delta"] = Field(
        description="chunks: the whole memory; delta: the pages that differ from base_digest"
    )
    base_digest: str | None = None
    seconds: float


class BranchRequest(StrictBody):
    tag: str | None = Field(None, pattern=limits.NAME_PATTERN)
    mode: str | None = Field(
        None,
        description="full (default), diff (only the pages that differ from the source's "
        "snapshot) or live (taken as full: recorded as mode full)",
    )
    wait: bool = Field(True, description="false: answer 202 at once, status writing")
    metadata: Metadata | None = Field(None, description="merged over the source's labels")
    # The original forkd's forms (its SDKs, MCP server and CLI send them).
    diff: bool | None = Field(None, description="the original's form of mode diff")
    live: bool | None = Field(None, description="the original's form of mode live")
    measure_diff: bool = Field(
        False,
        description="a full branch that also reports what a diff would have stored "
        "(diff_ms, diff_physical_bytes, diff_logical_bytes)",
    )
    parent_tag: str | None = Field(
        None,
        pattern=limits.NAME_PATTERN,
        description="the original's diff-chain edge: must be the source's snapshot, with diff",
    )


class CompactRequest(StrictBody):
    to: str | None = Field(
        None,
        pattern=limits.NAME_PATTERN,
        description="make a new full snapshot with this tag, leaving the source as it is "
        "(the original forkd's form); without it the diff is flattened in place",
    )


class SnapshotInfo(BaseModel):
    """A snapshot; fields marked *branches only* or *detail* are absent otherwise."""

    tag: str
    dir: str
    vmstate: str
    memory: str
    created_at_unix: int
    branched_from: str | None = Field(None, description="branches only: the source sandbox")
    pause_ms: int | None = Field(
        None, description="branches only: vCPUs frozen, whole ms (the original contract's type)"
    )
    status: Literal["ready", "broken", "writing", "failed"] = Field(
        description="'ready'; 'broken' when a file is missing or corrupt; 'writing' while a "
        "branch with wait false is written; 'failed' when that branch failed (see error)"
    )
    bootable: bool
    memory_mib: int
    image: str | None
    parent_tag: str | None
    metadata: dict[str, str] = Field(default_factory=dict, description="the user's labels")
    mode: Literal["full", "diff"] = Field(
        "full", description="full, or diff: the pages that differ from base_tag's"
    )
    base_tag: str | None = Field(None, description="a diff's base snapshot (a dependency)")
    error: str | None = Field(None, description="why a branch with wait false failed")
    warning: str | None = Field(
        None, description="why it cannot be forked (failed or broken), as the original forkd said"
    )
    # A branch's answer, for mode diff (or diff: true) and measure_diff, as the original forkd.
    diff_ms: int | None = Field(
        None, description="diff branches: ms to capture the pages (measure_diff: to count them)"
    )
    diff_physical_bytes: int | None = Field(
        None, description="diff branches: bytes the pages take (measure_diff: would take)"
    )
    diff_logical_bytes: int | None = Field(None, description="diff branches: guest RAM bytes")
    # Detail: GET /v1/snapshots/{tag}/info only.
    memory_logical_bytes: int | None = None
    memory_physical_bytes: int | None = None
    vmstate_bytes: int | None = None
    chain_depth: int | None = None
    ancestors: list[str] | None = Field(
        None, description="detail: the lineage (parent_tag, its parent_tag, ...), the root first"
    )
    dependents: list[str] | None = None
    sandboxes: list[str] | None = None
    problem: str | None = Field(None, description="detail, broken snapshots only: why")
    diff_chain: list[str] | None = Field(None, description="detail: bases, nearest first")
    start: str | None = Field(
        None,
        description="POST /v1/snapshots with start only: what was waited for before the "
        "snapshot (ready_port, ready_cmd, the image's one exposed port), or that nothing was",
    )
    diff_dependents: list[str] | None = Field(
        None, description="detail: diff snapshots whose base is this one"
    )
