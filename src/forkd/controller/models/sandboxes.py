"""Sandboxes: a fork, its timeout, pause and resume, its record and what it uses."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from forkd import limits, states
from forkd.controller.models.common import (
    ON_STOP,
    ON_STOP_TIMEOUT,
    TAG,
    Metadata,
    OnTimeoutWord,
    SandboxStateWord,
    StrictBody,
    original_field,
)
from forkd.controller.models.network import NetworkPolicy


class VolumeAttach(StrictBody):
    name: str = TAG
    path: str = Field(min_length=2, max_length=256, pattern=r"^/[A-Za-z0-9_./-]+$")
    readonly: bool = False


class EgressAllow(StrictBody):
    allow: list[str] = Field(max_length=64, description="CIDRs or hostnames (resolved at start)")


# What a sandbox may reach beyond the always-dropped addresses (docs/API.md, Networking).
Egress = Literal["none", "internet"] | EgressAllow


class SandboxCreate(StrictBody):
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
    timeout_s: float | None = Field(
        None, gt=0, le=limits.MAX_SANDBOX_TIMEOUT_SECS, description="the same as timeout_secs"
    )
    idle_timeout_s: float | None = Field(
        None,
        gt=0,
        le=limits.MAX_SANDBOX_TIMEOUT_SECS,
        description="seconds with no API call touching the sandbox and no process output, "
        "after which on_timeout happens (running sandboxes only); null: none",
    )
    on_timeout: OnTimeoutWord = Field(
        states.OnTimeout.KILL, description="what the timeout does to the sandbox"
    )
    auto_resume: bool = Field(
        True,
        description="a request to it while paused or hibernated (exec, files, its ports...) "
        "resumes it first; false: such a request is a 409",
    )
    evictable: bool = Field(
        True,
        description="when the host runs short of memory, the daemon may hibernate it once "
        "idle (it wakes on the next request); false: never",
    )
    on_stop: str | None = ON_STOP
    on_stop_timeout_s: float = ON_STOP_TIMEOUT
    internet: bool | None = Field(None, description="older form of egress: true = 'internet'")
    egress: Egress | None = Field(None, description="default: the snapshot's")
    network: NetworkPolicy | None = Field(
        None, description="default: the snapshot's; give one of network, egress, internet"
    )
    metadata: Metadata | None = Field(None, description="merged over the snapshot's labels")
    seed: int | None = Field(
        None,
        ge=0,
        le=limits.MAX_SEED,
        description="child i gets seed+i: Python's random in the warm interpreter and in "
        "new Python processes (FORKD_SEED) is seeded from it; os.urandom stays unique",
    )
    prewarm: bool = original_field(False, "a fork restores its template's warm memory")
    live_fork: bool = original_field(False, "every child can be branched with any mode")
    hugepages: bool = original_field(False, "guest memory is the snapshot's file, mapped")


class TimeoutRequest(StrictBody):
    timeout_s: float | None = Field(
        gt=0,
        le=limits.MAX_SANDBOX_TIMEOUT_SECS,
        description="seconds from now until the sandbox's timeout; null: none",
    )
    idle_timeout_s: float | None = Field(
        None,
        gt=0,
        le=limits.MAX_SANDBOX_TIMEOUT_SECS,
        description="the idle timeout; null removes it; left out: kept",
    )
    on_timeout: OnTimeoutWord | None = Field(None, description="change what it does; null: keep")


class SandboxUpdate(StrictBody):
    """``PATCH /v1/sandboxes/:id``: what may change of a sandbox after its fork; a field
    left out is kept."""

    evictable: bool | None = Field(
        None, description="whether memory pressure may hibernate it when idle; null: keep"
    )
    auto_resume: bool | None = Field(
        None, description="whether a request wakes it when paused or hibernated; null: keep"
    )


class PauseRequest(StrictBody):
    hibernate: bool = Field(
        False,
        description="write the sandbox to disk and end its QEMU (its memory is given "
        "back); resume restores it with the same id, address, volumes and processes",
    )


class ResumeRequest(StrictBody):
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=limits.MAX_SANDBOX_TIMEOUT_SECS,
        description="a new timeout, seconds from now; null: keep it (a woken sandbox has none)",
    )


class SandboxInfo(BaseModel):
    id: str
    snapshot_tag: str
    netns: str | None
    guest_addr: str | None
    created_at_unix: int
    pid: int | None
    memory_limit_mib: int | None
    state: SandboxStateWord = Field(
        description="paused: vCPUs stopped, memory kept; hibernated: on disk, no QEMU"
    )
    expires_at_unix: float | None
    expires_at: str | None = Field(None, description="the timeout, ISO 8601 UTC; null: none")
    idle_timeout_s: float | None = Field(
        None, description="seconds of no API call and no process output before on_timeout"
    )
    last_active_at: str | None = Field(
        None, description="its last API call or process output seen, ISO 8601 UTC"
    )
    on_timeout: OnTimeoutWord = Field(states.OnTimeout.KILL, description="what the timeout does")
    timeout_branch: str | None = Field(
        None, description="on_timeout branch: the tag of the branch the timeout made"
    )
    fork_ms: float | None
    seed: int | None = Field(None, description="its random seed, when forked with one")
    auto_resume: bool = Field(True, description="a request wakes it when paused or hibernated")
    evictable: bool = Field(True, description="memory pressure may hibernate it when idle")
    metadata: dict[str, str] = Field(default_factory=dict, description="the user's labels")
    has_branched: bool = Field(False, description="whether any branch of it was taken")
    branch_count: int = Field(0, description="branches taken of it (those that succeeded)")
    last_branch_memory_path: str | None = Field(
        None,
        description="the memory file of its latest branch still registered (the "
        "original forkd's field); null before any",
    )


class CpuUsage(BaseModel):
    seconds: float | None = Field(
        None, description="CPU time its QEMU used on the host, vCPUs and emulation included"
    )
    percent: float | None = Field(
        None,
        description="of one host core, since the previous reading of it (at least 1 s "
        "ago) or since it started",
    )
    count: int | None = Field(None, description="the guest's vCPUs")


class MemoryUsage(BaseModel):
    guest_total_bytes: int | None = Field(None, description="the guest's RAM, as it sees it")
    guest_used_bytes: int | None = Field(None, description="its RAM less what it has available")
    host_private_bytes: int | None = Field(
        None, description="what its QEMU holds on the host of its own (RssAnon)"
    )
    host_proportional_bytes: int | None = Field(
        None, description="its QEMU's PSS: its own pages and its share of the snapshot's"
    )


class SpaceUsage(BaseModel):
    used_bytes: int
    total_bytes: int


class VolumeUsage(SpaceUsage):
    name: str
    path: str = Field(description="where it is mounted in the guest")


class NetworkUsage(BaseModel):
    rx_bytes: int = Field(description="received by its interfaces (loopback left out)")
    tx_bytes: int = Field(description="sent by its interfaces")


class SandboxMetrics(BaseModel):
    """What one sandbox uses now. Host figures are the daemon's own reading; guest
    figures (memory used, disk, network, processes) are the guest's word, null when it
    does not answer or is not running."""

    sandbox_id: str
    state: SandboxStateWord
    timestamp: str = Field(description="when read, ISO 8601 UTC")
    cpu: CpuUsage
    memory: MemoryUsage
    disk: SpaceUsage | None = Field(None, description="the guest's root filesystem")
    volumes: list[VolumeUsage] = Field(default_factory=list)
    network: NetworkUsage | None = None
    processes: int | None = Field(None, description="processes running in the guest")
    last_active_at: str | None = Field(
        None, description="its last API call or process output seen, ISO 8601 UTC"
    )
    wakes: int = Field(0, description="times a request woke it since the daemon started")
    evictions: int = Field(0, description="times reclaim hibernated it since the daemon started")
