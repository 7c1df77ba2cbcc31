"""E2B's REST API shapes, as its SDKs send and read them (camelCase on the wire, as
E2B's OpenAPI spec names them). Requests keep what forkd does not use (an E2B field of
a newer SDK is not an error); answers carry every field the SDKs require."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from forkd import limits
from forkd.errors import Invalid
from forkd.vmm.volumes.shares import SHARE_SLOTS

# The version of E2B's in-guest daemon this front end answers as: the SDKs gate their
# features on it (0.6.4 turns all of them on; below 0.4.0 they send a user of their own).
ENVD_VERSION = "0.6.4"
DEFAULT_TIMEOUT_S = 300  # E2B's default lifetime of a sandbox, when a request gives none
CLIENT_ID = "forkd"  # E2B's field for the cluster node; one daemon is one node


ModelT = TypeVar("ModelT", bound=BaseModel)


def validated(model: type[ModelT], fields: Mapping[str, Any], where: str = "") -> ModelT:
    """``fields`` as forkd's ``model``; what E2B sent that does not fit is the request's
    fault (Invalid, naming each bad value, ``where`` before its path)."""
    try:
        return model.model_validate(fields)
    except ValidationError as exc:
        problems = (
            f"{where}{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise Invalid("; ".join(problems)) from None


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class AutoResume(Body):
    enabled: bool = False


class VolumeMount(Body):
    name: str = Field(max_length=200)
    path: str = Field(max_length=1024)


class NewSandbox(Body):
    template_id: str = Field(alias="templateID")
    timeout: int | None = Field(None, ge=1, le=int(limits.MAX_SANDBOX_TIMEOUT_SECS))
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    auto_pause: bool = Field(False, alias="autoPause")
    auto_resume: AutoResume | None = Field(None, alias="autoResume")
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None  # E2B's network object (.network_map)
    # Shared volumes, each by name at a path (forkd.controller.services.shared_volumes).
    volume_mounts: list[VolumeMount] | None = Field(
        None, alias="volumeMounts", max_length=SHARE_SLOTS
    )
    # Refused when given (rest.UNSERVED): forkd has no place for them yet.
    mcp: dict[str, Any] | None = None
    iam: dict[str, Any] | None = None


class NetworkUpdate(Body):
    """``PUT /sandboxes/{id}/network``: E2B's network object, and allow_internet_access."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    allow_internet_access: bool | None = None


class TimeoutBody(Body):
    timeout: int = Field(ge=0, le=int(limits.MAX_SANDBOX_TIMEOUT_SECS))


class RefreshBody(Body):
    duration: int | None = Field(None, ge=0, le=3600)


class ConnectBody(Body):
    timeout: int | None = Field(None, ge=1, le=int(limits.MAX_SANDBOX_TIMEOUT_SECS))


class Sandbox(BaseModel):
    """A sandbox created or connected to."""

    model_config = ConfigDict(populate_by_name=True)
    template_id: str = Field(serialization_alias="templateID")
    sandbox_id: str = Field(serialization_alias="sandboxID")
    client_id: str = Field(CLIENT_ID, serialization_alias="clientID")
    envd_version: str = Field(ENVD_VERSION, serialization_alias="envdVersion")
    envd_access_token: str = Field(serialization_alias="envdAccessToken")
    # The code interpreter's SDKs send this one on the calls that carry no access token
    # (/contexts); forkd's is the same per-sandbox token.
    traffic_access_token: str = Field(serialization_alias="trafficAccessToken")
    domain: str | None = None  # where sandbox.get_host(port) points (--e2b-domain)


class SandboxLifecycle(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    auto_resume: bool = Field(serialization_alias="autoResume")
    on_timeout: Literal["kill", "pause"] = Field(serialization_alias="onTimeout")


class ListedSandbox(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    template_id: str = Field(serialization_alias="templateID")
    sandbox_id: str = Field(serialization_alias="sandboxID")
    client_id: str = Field(CLIENT_ID, serialization_alias="clientID")
    started_at: str = Field(serialization_alias="startedAt")
    end_at: str = Field(serialization_alias="endAt")
    cpu_count: int = Field(serialization_alias="cpuCount")
    memory_mb: int = Field(serialization_alias="memoryMB")
    disk_size_mb: int = Field(0, serialization_alias="diskSizeMB")
    state: Literal["running", "paused"]
    envd_version: str = Field(ENVD_VERSION, serialization_alias="envdVersion")
    metadata: dict[str, str] = Field(default_factory=dict)


class SandboxDetail(ListedSandbox):
    envd_access_token: str = Field(serialization_alias="envdAccessToken")
    lifecycle: SandboxLifecycle


class Error(BaseModel):
    """Every error E2B's API answers: the SDKs read both fields."""

    code: int
    message: str


def bad_env_name(name: str) -> bool:
    """What the guest agent takes as no variable name: empty, or with '=' or NUL."""
    return not name or "=" in name or "\0" in name
