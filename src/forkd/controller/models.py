"""The typed objects that cross the seam between HTTP and the services.

Request bodies (``SnapshotCreate``, ``SandboxCreate``, ...) are what a route
receives and a service takes; responses (``SnapshotInfo``, ``SandboxInfo``,
``ExecResult``, ...) are what a service returns and a route sends, so
``/openapi.json`` documents every answer. Defaults and bounds come from
:mod:`forkd.limits`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from forkd import limits

TAG = Field(pattern=limits.NAME_PATTERN, description=f"a name: {limits.NAME_RULE}")


class _Body(BaseModel):
    # Strict: true is not 1 and "2" is not 2, as the contract (docs/openapi.json) says.
    model_config = ConfigDict(extra="ignore", strict=True)


# ------------------------------------------------------------------ requests


class VolumeAttach(_Body):
    name: str = TAG
    path: str = Field(min_length=2, max_length=256, pattern=r"^/[A-Za-z0-9_./-]+$")
    readonly: bool = False


class EgressAllow(_Body):
    allow: list[str] = Field(max_length=64, description="CIDRs or hostnames (resolved at start)")


# What a sandbox may reach beyond the always-dropped addresses (docs/API.md, Networking).
Egress = Literal["none", "internet"] | EgressAllow


class SnapshotCreate(_Body):
    tag: str = TAG
    image: str | None = None
    kernel: str | None = None
    rootfs: str | None = None
    # Unset fields take the image recipe's [template] defaults, then forkd's.
    memory_mib: int | None = Field(None, ge=limits.MIN_MEMORY_MIB, le=limits.MAX_MEMORY_MIB)
    vcpus: int | None = Field(None, ge=1, le=limits.MAX_VCPUS)
    setup: list[str] = Field(default_factory=list, max_length=limits.MAX_SETUP_COMMANDS)
    warmup: str | None = None
    boot_wait_secs: float = Field(limits.BOOT_TIMEOUT_SECS, gt=0, le=limits.MAX_BOOT_TIMEOUT_SECS)
    volumes: list[VolumeAttach] = Field(default_factory=list, max_length=limits.MAX_VOLUMES_PER_VM)
    egress: Egress | None = Field(None, description="the template's and its forks' default")


class SandboxCreate(_Body):
    snapshot_tag: str = TAG
    n: int = Field(1, ge=1, le=limits.MAX_FORK_N)
    memory_limit_mib: int | None = Field(
        None,
        ge=limits.MIN_MEMORY_LIMIT_MIB,
        le=limits.MAX_MEMORY_MIB,
        description="host memory cap of the sandbox's QEMU (its cgroup); default: guest RAM "
        "plus QEMU's overhead. Over it, the sandbox is killed",
    )
    per_child_netns: bool = False
    timeout_secs: float | None = Field(None, gt=0, le=limits.MAX_SANDBOX_TIMEOUT_SECS)
    internet: bool | None = Field(None, description="older form of egress: true = 'internet'")
    egress: Egress | None = Field(None, description="default: the snapshot's")


class ExecRequest(_Body):
    args: list[str] = Field(min_length=1)
    timeout_secs: float = Field(limits.EXEC_TIMEOUT_SECS, gt=0, le=limits.MAX_EXEC_TIMEOUT_SECS)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None


class EvalRequest(_Body):
    code: str


class BranchRequest(_Body):
    tag: str | None = Field(None, pattern=limits.NAME_PATTERN)
    mode: str | None = None


# ----------------------------------------------------------------- responses


class Health(BaseModel):
    ok: bool


class VersionInfo(BaseModel):
    version: str
    api: str


class SnapshotInfo(BaseModel):
    """A snapshot; fields marked *branches only* or *detail* are absent otherwise."""

    tag: str
    dir: str
    vmstate: str
    memory: str
    created_at_unix: int
    branched_from: str | None = Field(None, description="branches only: the source sandbox")
    pause_ms: float | None = Field(None, description="branches only: vCPUs frozen, ms")
    status: str = Field(description="'ready', or 'broken' when a file is missing or corrupt")
    bootable: bool
    memory_mib: int
    image: str | None
    parent_tag: str | None
    # Detail: GET /v1/snapshots/{tag}/info only.
    memory_logical_bytes: int | None = None
    memory_physical_bytes: int | None = None
    vmstate_bytes: int | None = None
    chain_depth: int | None = None
    ancestors: list[str] | None = None
    dependents: list[str] | None = None
    sandboxes: list[str] | None = None
    problem: str | None = Field(None, description="detail, broken snapshots only: why")


class SandboxInfo(BaseModel):
    id: str
    snapshot_tag: str
    netns: str | None
    guest_addr: str | None
    created_at_unix: int
    pid: int | None
    memory_limit_mib: int | None
    state: str = Field(description="'starting', 'running' or 'dead'")
    expires_at_unix: float | None
    fork_ms: float | None


class PingResult(BaseModel):
    """``pong`` and what the guest agent reports about itself."""

    model_config = ConfigDict(extra="allow")
    pong: bool


class ExecResult(BaseModel):
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    stdout_truncated: bool
    stderr_truncated: bool
    duration_ms: float | None


class EvalResult(BaseModel):
    result: str | None
    error: str | None
    exit_code: int
    stdout: str
    stderr: str


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    type: str
    size: int
    mode: int
    mtime: float


class FileWritten(BaseModel):
    path: str
    size: int


class VolumeInfo(BaseModel):
    name: str
    size_bytes: int
    created_at_unix: int
    allocated_bytes: int
    layers: int
    used_by: list[str]


class ErrorBody(BaseModel):
    error: str
