"""The typed objects that cross the seam between HTTP and the services.

Request bodies (``SnapshotCreate``, ``SandboxCreate``, ...) are what a route
receives and a service takes; responses (``SnapshotInfo``, ``SandboxInfo``,
``ExecResult``, ...) are what a service returns and a route sends, so
``/openapi.json`` documents every answer. Defaults and bounds come from
:mod:`forkd.limits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StringConstraints,
    model_serializer,
    model_validator,
)

from forkd import limits, states
from forkd.controller.egress_models import NetworkPolicy

TAG = Field(pattern=limits.NAME_PATTERN, description=f"a name: {limits.NAME_RULE}")

MetadataKey = Annotated[str, StringConstraints(pattern=limits.METADATA_KEY_PATTERN)]
MetadataValue = Annotated[str, StringConstraints(max_length=limits.MAX_METADATA_VALUE_CHARS)]
Metadata = Annotated[
    dict[MetadataKey, MetadataValue],
    Field(
        max_length=limits.MAX_METADATA_PAIRS,
        description="labels: up to 64 pairs; keys letters, digits and _.- (63 at most), "
        "values up to 256 characters. The list routes filter on them (metadata.KEY=VALUE)",
    ),
]


class _Body(BaseModel):
    # Strict: true is not 1 and "2" is not 2, as the contract (docs/openapi.json) says.
    # A field the daemon does not know is a 400 naming it, never silently dropped: a
    # client that asked for something gets it or is told. Fields the original forkd's
    # clients send that have no effect here are declared where they arrive (ORIGINAL).
    model_config = ConfigDict(extra="forbid", strict=True)


def _original(default: Any, what: str) -> Any:
    """A field the original forkd's clients send, accepted and without effect here."""
    return Field(default, description=f"the original forkd's; no effect here: {what}")


# ------------------------------------------------------------------ requests


class VolumeAttach(_Body):
    name: str = TAG
    path: str = Field(min_length=2, max_length=256, pattern=r"^/[A-Za-z0-9_./-]+$")
    readonly: bool = False


class EgressAllow(_Body):
    allow: list[str] = Field(max_length=64, description="CIDRs or hostnames (resolved at start)")


# What a sandbox may reach beyond the always-dropped addresses (docs/API.md, Networking).
Egress = Literal["none", "internet"] | EgressAllow


def _words_of(enum: type[StrEnum]) -> Any:
    """A field of ``enum``'s type as pydantic sees it: the enum's values inline in the
    schema (a string with an ``enum`` list, as the API has always shown them, not a
    component of its own), and each word read made the enum's member."""
    return Annotated[Literal[tuple(member.value for member in enum)], AfterValidator(enum)]


if TYPE_CHECKING:  # the checker sees the enums of forkd.states themselves
    OnTimeoutWord: TypeAlias = states.OnTimeout
    SandboxStateWord: TypeAlias = states.SandboxState
else:
    # What a sandbox's timeout does: kill it; pause it; hibernate it (to disk, its QEMU
    # ended); branch it (a snapshot), then kill it.
    OnTimeoutWord = _words_of(states.OnTimeout)
    # Where a sandbox is in its life.
    SandboxStateWord = _words_of(states.SandboxState)
SANDBOX_STATES: tuple[str, ...] = tuple(states.SandboxState)


IMAGE_REF = Field(
    min_length=1, max_length=4096,
    description="a container image: registry[:port]/repository[:tag][@digest] (a short name "
    "needs the daemon's --default-registry), docker-daemon:IMAGE, docker-archive:PATH, "
    "oci-archive:PATH[:tag] or oci:DIR[:tag] (paths on the daemon's host)",
)  # fmt: skip


class SnapshotCreate(_Body):
    tag: str = TAG
    image: str | None = Field(
        None, max_length=4096,
        description="a built image's name (see GET /v1/images; default python), or a "
        "container image reference, imported first (see POST /v1/images)",
    )  # fmt: skip
    kernel: str | None = None
    rootfs: str | None = None
    rw: bool = _original(False, "the guest's root is always writable (an overlay per VM)")
    tap: str | None = _original(None, "the daemon makes each VM's network")
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
    env: dict[
        Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")],
        Annotated[str, StringConstraints(max_length=8192)],
    ] | None = Field(
        None, max_length=128,
        description="the environment of every command and eval in the template and its "
        "forks (over an image's own); '${secrets.NAME}' stays a placeholder in the guest",
    )  # fmt: skip
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
        None, min_length=1, max_length=256,
        description="with start: wait until this command exits 0 (run again every 0.5 s)",
    )  # fmt: skip
    ready_timeout_secs: float = Field(
        limits.READY_TIMEOUT_SECS, gt=0, le=limits.MAX_BOOT_TIMEOUT_SECS,
        description="how long start may take to be ready (with no ready_port nor ready_cmd: "
        "the image's one exposed TCP port is waited for, if it has exactly one)",
    )  # fmt: skip


class ImageImport(_Body):
    ref: str = IMAGE_REF
    token: str | None = Field(
        None, max_length=8192, pattern=r"^[A-Za-z0-9._~+/-]+=*$",
        description="a bearer token for the registry; default: the daemon's docker config.json",
    )  # fmt: skip


REGISTRY_REF = Field(
    min_length=1, max_length=512,
    description="an OCI reference: registry[:port]/repository[:tag][@digest]",
)  # fmt: skip
REGISTRY_TOKEN = Field(
    None, max_length=8192, pattern=r"^[A-Za-z0-9._~+/-]+=*$",  # RFC 6750's b64token
    description="a bearer token for the registry; default: the daemon's docker config.json",
)  # fmt: skip
INSECURE = Field(
    False,
    description="ask for plain HTTP: allowed only to a registry the daemon lists with "
    "--insecure-registry (which is plain HTTP anyway); else 400",
)


class SnapshotPush(_Body):
    ref: str = REGISTRY_REF
    token: str | None = REGISTRY_TOKEN
    insecure: bool = INSECURE
    flatten: bool = Field(
        False, description="send the whole memory, never a delta over a pushed parent"
    )


class SnapshotPull(_Body):
    ref: str = REGISTRY_REF
    tag: str | None = Field(
        None, pattern=limits.NAME_PATTERN,
        description="the local name; default: the name it was pushed under, else the ref's tag",
    )  # fmt: skip
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
    prewarm: bool = _original(False, "a fork restores its template's warm memory")
    live_fork: bool = _original(False, "every child can be branched with any mode")
    hugepages: bool = _original(False, "guest memory is the snapshot's file, mapped")


class TimeoutRequest(_Body):
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


class SandboxUpdate(_Body):
    """``PATCH /v1/sandboxes/:id``: what may change of a sandbox after its fork; a field
    left out is kept."""

    evictable: bool | None = Field(
        None, description="whether memory pressure may hibernate it when idle; null: keep"
    )
    auto_resume: bool | None = Field(
        None, description="whether a request wakes it when paused or hibernated; null: keep"
    )


class PauseRequest(_Body):
    hibernate: bool = Field(
        False,
        description="write the sandbox to disk and end its QEMU (its memory is given "
        "back); resume restores it with the same id, address, volumes and processes",
    )


class ResumeRequest(_Body):
    timeout_s: float | None = Field(
        None,
        gt=0,
        le=limits.MAX_SANDBOX_TIMEOUT_SECS,
        description="a new timeout, seconds from now; null: keep it (a woken sandbox has none)",
    )


class ExecRequest(_Body):
    args: list[str] = Field(min_length=1)
    timeout_secs: float = Field(limits.EXEC_TIMEOUT_SECS, gt=0, le=limits.MAX_EXEC_TIMEOUT_SECS)
    cwd: str | None = None
    env: dict[str, str] | None = None
    stdin: str | None = None
    user: str | None = Field(
        None, min_length=1, max_length=256,
        description="run as this user: name, uid, name:group or uid:gid (Docker's USER forms); "
        "default the image's USER, else root",
    )  # fmt: skip


class EvalRequest(_Body):
    code: str
    timeout_s: float = Field(
        limits.EVAL_TIMEOUT_SECS,
        gt=0,
        le=limits.MAX_EVAL_TIMEOUT_SECS,
        description="then the eval is interrupted and answers with timed_out",
    )
    timeout: float | None = Field(
        None,
        gt=0,
        le=limits.MAX_EVAL_TIMEOUT_SECS,
        description="the original forkd agent's name of timeout_s (give one of them)",
    )

    @model_validator(mode="after")
    def _one_timeout(self) -> EvalRequest:
        if self.timeout is not None:
            if "timeout_s" in self.model_fields_set and self.timeout_s != self.timeout:
                raise ValueError("timeout and timeout_s differ: give one of them")
            self.timeout_s = self.timeout
        return self


class BranchRequest(_Body):
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


class ExploreStep(_Body):
    """One command run in a child of an explore: ``exec`` (a program and its arguments,
    never through a shell unless it is one) or ``eval`` (Python in the warm interpreter)."""

    exec: list[str] | None = Field(None, min_length=1, description="argv, as exec's args")
    eval: str | None = Field(None, description="Python, as eval's code")
    env: dict[str, str] | None = Field(None, description="exec only")
    stdin: str | None = Field(None, description="exec only")
    cwd: str | None = Field(None, description="exec only")
    user: str | None = Field(None, min_length=1, max_length=256, description="exec only")
    network: NetworkPolicy | None = Field(
        None,
        description="(a variant) what its child may reach, set before it runs; "
        "default: the source's policy at the branch",
    )

    @model_validator(mode="after")
    def _one_kind(self) -> ExploreStep:
        if (self.exec is None) == (self.eval is None):
            raise ValueError("a step is exactly one of exec (argv) or eval (code)")
        given = [k for k in ("env", "stdin", "cwd", "user") if getattr(self, k) is not None]
        if self.eval is not None and given:
            raise ValueError(f"{', '.join(given)} go with exec, not eval")
        return self


class ExploreRequest(_Body):
    variants: list[ExploreStep] = Field(
        min_length=1,
        max_length=limits.MAX_EXPLORE_VARIANTS,
        description="one child per variant, each running its step",
    )
    score: ExploreStep | None = Field(
        None,
        description="run in each child after its variant: an exec whose stdout's last line, "
        "or an eval whose result, is a number. None: no scores, results in variant order",
    )
    keep: int = Field(1, ge=0, le=limits.MAX_EXPLORE_VARIANTS,
                      description="children kept, best first; the rest are killed")  # fmt: skip
    keep_as: Literal["sandboxes", "snapshots"] = Field(
        "sandboxes", description="snapshots: each kept child is branched, then killed"
    )
    minimize: bool = Field(False, description="lower scores are better")
    timeout_secs: float = Field(
        limits.EXPLORE_TIMEOUT_SECS,
        gt=0,
        le=limits.MAX_EXEC_TIMEOUT_SECS,
        description="from the request on: a variant's step or score still running then is "
        "its error; the branch, the fork and the keeping are never cut short",
    )
    seed: int | None = Field(
        None, ge=0, le=limits.MAX_SEED, description="variant i's child gets seed+i"
    )
    tag: str | None = Field(
        None,
        pattern=limits.NAME_PATTERN,
        description="the branch's tag, which names the explore; default explore-<sandbox id>-<n>",
    )
    metadata: Metadata | None = Field(
        None, description="labels of every child, merged; forkd.* keys are the explore's"
    )

    @model_validator(mode="after")
    def _keep_fits(self) -> ExploreRequest:
        reserved = sorted(k for k in self.metadata or {} if k.startswith("forkd."))
        if reserved:
            raise ValueError(f"metadata keys {', '.join(reserved)}: forkd.* labels are forkd's")
        if self.keep > len(self.variants):
            raise ValueError(f"keep {self.keep} is more than the {len(self.variants)} variants")
        if self.seed is not None and self.seed + len(self.variants) - 1 > limits.MAX_SEED:
            raise ValueError(f"seed + variants - 1 is over {limits.MAX_SEED}")
        if self.score is not None and self.score.network is not None:
            raise ValueError("network goes with a variant: the score runs in its variant's child")
        return self


class CompactRequest(_Body):
    to: str | None = Field(
        None,
        pattern=limits.NAME_PATTERN,
        description="make a new full snapshot with this tag, leaving the source as it is "
        "(the original forkd's form); without it the diff is flattened in place",
    )


class WorkspaceCreate(_Body):
    name: str = Field(pattern=limits.NAME_PATTERN, description="the workspace's name, as a tag")
    snapshot_tag: str = TAG
    per_child_netns: bool = False
    memory_limit_mib: int | None = Field(None, ge=limits.MIN_MEMORY_LIMIT_MIB,
                                         le=limits.MAX_MEMORY_MIB)  # fmt: skip


class WorkspaceSuspend(_Body):
    diff: bool = _original(False, "a suspend writes the sandbox's whole state (hibernation)")


class WorkspaceResume(_Body):
    pass


# A workspace: its sandbox runs (or is paused), is hibernated, or is gone.
WorkspaceStatus = Literal["running", "suspended", "stale"]


class WorkspaceInfo(BaseModel):
    """A workspace (the original forkd's): a named sandbox that is suspended to disk and
    resumed, its state kept in between. Fields that do not apply are left out."""

    id: str
    name: str
    source_snapshot_tag: str
    status: WorkspaceStatus = Field(
        description="running (also while paused); suspended: hibernated to disk; stale: "
        "its sandbox is gone (resume forks a new one from source_snapshot_tag)"
    )
    live_sandbox_id: str | None = Field(None, description="running only: its sandbox")
    sandbox_id: str | None = Field(
        None, description="the sandbox holding its state, running or hibernated (ours)"
    )
    current_state_tag: str | None = Field(
        None, description="the original's state snapshot: none here, the state is the "
        "hibernated sandbox itself",
    )  # fmt: skip
    created_at_unix: int
    last_active_unix: int


class PtySize(_Body):
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


Argv = Annotated[list[str], Field(min_length=1, max_length=4096)]
ShellLine = Annotated[str, Field(min_length=1, description="runs as /bin/sh -c")]


class ProcessStart(_Body):
    cmd: Argv | ShellLine
    env: dict[str, str] | None = None
    cwd: str | None = None
    stdin: bool = Field(False, description="keep stdin open for POST .../stdin; else /dev/null")
    pty: PtySize | None = Field(None, description="run in a terminal of this size")
    timeout_s: float | None = Field(
        None, gt=0, le=limits.MAX_EXEC_TIMEOUT_SECS, description="then SIGKILL, exit code 124"
    )
    user: str | None = Field(
        None, min_length=1, max_length=256,
        description="run as this user: name, uid, name:group or uid:gid (Docker's USER forms); "
        "default the image's USER, else root",
    )  # fmt: skip


class ProcessStdin(_Body):
    data: str = Field("", max_length=limits.JSON_BODY_LIMIT)
    encoding: Literal["utf-8", "base64"] = "utf-8"
    eof: bool = Field(False, description="close stdin after data (a terminal gets ^D)")


SignalNumber = Annotated[int, Field(ge=1, le=64)]
SignalName = Annotated[str, Field(pattern=r"^[A-Za-z][A-Za-z0-9+]{0,15}$")]


class ProcessSignal(_Body):
    signal: SignalNumber | SignalName = Field(
        "SIGTERM", description="a number (1-64) or a name: 'SIGKILL' or 'KILL'"
    )


class ProcessResize(_Body):
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


# ----------------------------------------------------------------- responses


class Health(BaseModel):
    ok: bool


class VersionInfo(BaseModel):
    version: str
    api: str


class CapacityInfo(BaseModel):
    """What this daemon can still take: a gateway places children by it."""

    node_id: str = Field(description="the prefix of every sandbox id this daemon gives")
    version: str
    accel: Literal["kvm", "tcg"]
    qemu: str = Field(description="QEMU release (major.minor): snapshots move between equals")
    sandboxes: int = Field(description="running or being started")
    max_sandboxes: int | None
    guest_memory_mib: int = Field(description="guest RAM of those, and of template builds")
    max_guest_memory_mib: int | None
    memory_overcommit: float | None = Field(
        default=None, description="max_guest_memory_mib over the host's RAM, when sized so"
    )
    host_memory_mib: int | None = Field(default=None, description="the host's RAM")
    host_memory_available_mib: int | None = Field(
        default=None, description="what the host has available now (MemAvailable)"
    )
    memory_reserve_mib: int | None = Field(
        default=None, description="of that, what admission keeps free (None: not checked)"
    )
    sandboxes_own_memory_mib: int | None = Field(
        default=None,
        description="what running sandboxes hold of their own (QEMU's anonymous"
        " memory: what forks do not share), at the last sample",
    )
    snapshots: list[str] = Field(description="tags of the ready snapshots")


class ImageConfigInfo(BaseModel):
    """What a container image sets, as Docker honours it."""

    env: list[str]
    working_dir: str
    user: str
    entrypoint: list[str]
    cmd: list[str]
    exposed_ports: list[str]
    labels: dict[str, str] = Field(default_factory=dict)


class ImageInfo(BaseModel):
    """A guest image: built from a recipe, or imported from a container image."""

    name: str
    key: str
    kind: Literal["recipe", "container"]
    names: list[str] = Field(
        default_factory=list,
        description="container: the local names (NAME:TAG) that find it, as an image of a "
        "snapshot, a DELETE or a GET: the tag it was built or loaded with, or the reference "
        "it was imported as",
    )
    references: list[str] = Field(
        default_factory=list, description="container: the references it was imported as"
    )
    id: str | None = Field(None, description="container: the config's digest (the image id)")
    digest: str | None = Field(None, description="container: the manifest's digest")
    layers: int | None = None
    size_bytes: int = Field(
        description="its own files on disk (shared ones, hard-linked: the runtime disk, the "
        "kernel and initramfs, not counted)"
    )
    layer_bytes: int | None = Field(None, description="container: its layers in the blob cache")
    shared_layer_bytes: int | None = Field(
        None, description="container: of layer_bytes, what another image uses too"
    )
    created_at_unix: int
    config: ImageConfigInfo | None = None
    used_by: list[str] = Field(default_factory=list, description="snapshots and VMs using it")
    bytes_fetched: int | None = Field(None, description="an import's answer: bytes it fetched")
    bytes_reused: int | None = Field(None, description="an import's answer: bytes it had")
    import_secs: float | None = Field(None, description="an import's answer: how long it took")


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
        None, description="the memory file of its latest branch still registered (the "
        "original forkd's field); null before any",
    )  # fmt: skip


class CpuUsage(BaseModel):
    seconds: float | None = Field(
        None, description="CPU time its QEMU used on the host, vCPUs and emulation included"
    )
    percent: float | None = Field(
        None, description="of one host core, since the previous reading of it (at least 1 s "
        "ago) or since it started",
    )  # fmt: skip
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


class ExploreVariant(BaseModel):
    """What one variant of an explore did."""

    index: int = Field(description="its place in the request's variants")
    sandbox_id: str | None = Field(description="its child (killed unless kept)")
    score: float | None = Field(description="null when its step or score failed (see error)")
    exit_code: int | None = Field(description="its step's exit code (eval: 0, or 1 raised)")
    stdout_tail: str = Field(description="the end of its step's stdout (2048 characters)")
    score_tail: str = Field("", description="the end of its score's stdout (eval: its result)")
    error: str | None = Field(description="why it has no score; null when it has one")
    kept: bool = Field(
        description="its child runs on, or was branched into snapshot_tag (keep_as snapshots)"
    )
    snapshot_tag: str | None = Field(None, description="keep_as snapshots: its snapshot")
    duration_ms: float = Field(description="its step and score, in the guest and back")


class ExploreResult(BaseModel):
    branch: str = Field(description="the snapshot the children were forked from; its tag "
                        "names the explore (label forkd.explore)")  # fmt: skip
    pause_ms: int | None = Field(description="the source's pause for the branch")
    fork_ms: float = Field(description="forking every child")
    duration_ms: float = Field(description="the whole explore")
    branch_kept: bool = Field(description="false: the branch was deleted (no child maps it)")
    results: list[ExploreVariant] = Field(description="best first; failed variants last")


class DiffChange(BaseModel):
    path: str
    change: Literal["added", "modified", "removed"]
    kind: Literal["file", "dir", "symlink", "other"]
    size: int = Field(description="bytes (a symlink: its target's length; a directory: 0); "
                      "removed: what it was")  # fmt: skip
    mode: int = Field(description="permission bits, e.g. 420 (0o644)")


class DiffResult(BaseModel):
    sandbox_id: str
    against: str = Field(description="the snapshot tag or sandbox id compared with")
    against_kind: Literal["snapshot", "sandbox"]
    path: str = Field(description="the directory (or file) compared")
    changes: list[DiffChange] = Field(description="sorted by path")
    truncated: bool = Field(description="more changes than the daemon lists: diff a smaller path")
    duration_ms: float


class DisplayOutput(BaseModel):
    mime: str = Field(description="image/png, image/jpeg: base64; text/plain, text/html, ...")
    data: str


class EvalResult(BaseModel):
    result: str | None
    error: str | None = Field(
        description="a failure's one-line summary (NameError: name 'x' is not defined), as the "
        "original forkd answered; the whole text is in traceback"
    )
    traceback: str | None = Field(
        None, description="a failure's whole traceback (absent when it succeeded)"
    )

    @model_serializer(mode="wrap")
    def _without_an_empty_traceback(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict) and data.get("traceback") is None:
            data.pop("traceback", None)  # a success answers as it always did
        return data

    exit_code: int
    stdout: str
    stderr: str
    display: list[DisplayOutput] = Field(
        default_factory=list, description="display(obj), a rich last value, matplotlib figures"
    )
    display_truncated: bool = Field(False, description="outputs past 8 MiB were dropped")
    timed_out: bool = Field(False, description="interrupted at its timeout_s")


class EvalInterrupt(BaseModel):
    interrupted: bool = Field(description="false when no eval was running")


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


class ProcessInfo(BaseModel):
    pid: int
    cmd: list[str]
    pty: bool
    stdin: bool
    running: bool
    exit_code: int | None = Field(description="128+N when killed by signal N; 124: timeout_s")
    started_at: float = Field(description="guest unix time")
    ended_at: float | None
    output_start: int = Field(description="oldest output offset still held (4 MiB ring)")
    output_end: int = Field(description="offset after the last byte of output")


class StdinWritten(BaseModel):
    written: int


class OutputData(BaseModel):
    """A ``stdout``, ``stderr`` or ``pty`` event of an output stream."""

    data: str
    encoding: Literal["utf-8", "base64"] = Field(description="base64 when not valid UTF-8")
    offset: int = Field(description="of the first byte")
    next_offset: int = Field(description="after the last byte: where to resume")


class OutputGap(BaseModel):
    """A ``gap`` event: output from ``from`` to ``to`` left the ring before it was read."""

    model_config = ConfigDict(populate_by_name=True)
    from_offset: int = Field(alias="from")
    to: int


class OutputExit(BaseModel):
    """The last event, ``exit``: the process ended and all its output was sent."""

    exit_code: int | None


class ErrorBody(BaseModel):
    error: str


class PreviewRequest(_Body):
    port: int = Field(ge=1, le=65535, description="the guest's TCP port (not 8888, the agent's)")
    ttl_s: int = Field(
        limits.DEFAULT_PREVIEW_TTL_SECS,
        ge=1,
        le=limits.MAX_PREVIEW_TTL_SECS,
        description="seconds until the URL stops working (it also stops when the sandbox dies)",
    )


class PortUrlRequest(_Body):
    ttl_s: int = Field(
        limits.DEFAULT_PREVIEW_TTL_SECS,
        ge=1,
        le=limits.MAX_PREVIEW_TTL_SECS,
        description="seconds until the URL stops working (it also stops when the sandbox dies)",
    )


class PreviewInfo(BaseModel):
    """A signed URL for a browser: the sandbox's port without the bearer token."""

    url: str = Field(
        description="absolute: this daemon as the request reached it, or the preview's own "
        "host under --preview-domain"
    )
    token: str = Field(description="p1.<sandbox id>.<port>.<expires at, unix s>.<HMAC-SHA256>")
    expires_at: str = Field(description="ISO 8601 UTC")
    expires_at_unix: int
    port: int


class StreamError(BaseModel):
    """The last event, ``error``, of a stream that failed after it began."""

    error: str
    status: int = Field(description="the HTTP status the failure would have had")


class ImportProgress(BaseModel):
    """A step of an image import (``progress`` events of POST /v1/images as SSE)."""

    message: str


@dataclass(frozen=True)
class OutputEvent:
    """One event of an output stream; no ``body`` is a keep-alive while nothing happens.
    An image import's stream has ``progress`` events, then ``image`` (or ``error``)."""

    event: Literal[
        "stdout", "stderr", "pty", "gap", "exit", "error", "keepalive", "progress", "image"
    ]
    body: OutputData | OutputGap | OutputExit | StreamError | ImportProgress | ImageInfo | None = (
        None
    )
    next_offset: int | None = None
