"""What the API's models share: names, labels, the strict request base, the daemon's own answers."""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, Literal, TypeAlias

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from forkd import limits, states

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


class StrictBody(BaseModel):
    # Strict: true is not 1 and "2" is not 2, as the contract (docs/openapi.json) says.
    # A field the daemon does not know is a 400 naming it, never silently dropped: a
    # client that asked for something gets it or is told. Fields the original forkd's
    # clients send that have no effect here are declared where they arrive (ORIGINAL).
    model_config = ConfigDict(extra="forbid", strict=True)


def original_field(default: Any, what: str) -> Any:
    """A field the original forkd's clients send, accepted and without effect here."""
    return Field(default, description=f"the original forkd's; no effect here: {what}")


def words_of(enum: type[StrEnum]) -> Any:
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
    OnTimeoutWord = words_of(states.OnTimeout)
    # Where a sandbox is in its life.
    SandboxStateWord = words_of(states.SandboxState)


SANDBOX_STATES: tuple[str, ...] = tuple(states.SandboxState)


IMAGE_REF = Field(
    min_length=1,
    max_length=4096,
    description="a container image: registry[:port]/repository[:tag][@digest] (a short name "
    "needs the daemon's --default-registry), docker-daemon:IMAGE, docker-archive:PATH, "
    "oci-archive:PATH[:tag] or oci:DIR[:tag] (paths on the daemon's host)",
)


REGISTRY_REF = Field(
    min_length=1,
    max_length=512,
    description="an OCI reference: registry[:port]/repository[:tag][@digest]",
)


REGISTRY_TOKEN = Field(
    None,
    max_length=8192,
    pattern=r"^[A-Za-z0-9._~+/-]+=*$",  # RFC 6750's b64token
    description="a bearer token for the registry; default: the daemon's docker config.json",
)


INSECURE = Field(
    False,
    description="ask for plain HTTP: allowed only to a registry the daemon lists with "
    "--insecure-registry (which is plain HTTP anyway); else 400",
)


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


class ErrorBody(BaseModel):
    error: str


class StreamError(BaseModel):
    """The last event, ``error``, of a stream that failed after it began."""

    error: str
    status: int = Field(description="the HTTP status the failure would have had")


# A stop hook (forkd.controller.services.stop_hooks): templates and forks take one.
ON_STOP = Field(
    None,
    min_length=1,
    max_length=4096,
    description="a command (/bin/sh -c) the sandbox runs before the daemon stops it: a DELETE "
    "without force, a timeout or idle timeout, a hibernation, the daemon's stop under "
    "--kill-on-exit; forks and branches take it",
)
ON_STOP_TIMEOUT = Field(
    10.0, gt=0, le=300, description="how long the stop hook may run; then the stop goes on"
)
