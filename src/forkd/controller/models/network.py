"""The typed objects of secrets (``/v1/secrets``): what a client sends and what it
gets back. A value goes in and never comes out: requests hold it as a
``SecretStr`` (shown as ``**********`` by any repr or log), answers have no field
for it, and no validation error repeats it.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, SecretStr, StringConstraints, field_validator

from forkd import limits
from forkd.controller.models.common import StrictBody

SecretName = Annotated[
    str,
    StringConstraints(pattern=limits.SECRET_NAME_PATTERN),
    Field(description=f"the name ${{secrets.NAME}} places it by: {limits.SECRET_NAME_RULE}"),
]
_VALUE_CHARS = re.compile(limits.SECRET_VALUE_PATTERN)
SecretValue = Annotated[
    SecretStr,
    Field(
        min_length=1,
        max_length=limits.MAX_SECRET_VALUE_CHARS,
        json_schema_extra={"writeOnly": True},
        description="the credential: visible ASCII, spaces and tabs (it goes into HTTP "
        "headers). Write-only: no answer, log, event or error holds it",
    ),
]
HOSTS = Field(
    min_length=1,
    max_length=limits.MAX_SECRET_HOSTS,
    description="where the value may be sent: host names and '*.domain' wildcards (no "
    "addresses); a request to any other host gets the placeholder, never the value",
)


def _checked_value(value: SecretStr | None) -> SecretStr | None:
    if value is not None and not _VALUE_CHARS.fullmatch(value.get_secret_value()):
        # Never the value in the message: it goes back to the client and into logs.
        raise ValueError(
            "a secret's value is visible ASCII, spaces and tabs only (no CR, LF), "
            "with no space or tab at either end"
        )
    return value


class SecretCreate(StrictBody):
    name: SecretName
    value: SecretValue
    hosts: list[str] = HOSTS

    _value = field_validator("value")(_checked_value)


class SecretUpdate(StrictBody):
    """A new value (rotation), new hosts, or both; the next request uses them."""

    value: SecretValue | None = None
    hosts: list[str] | None = Field(None, min_length=1, max_length=limits.MAX_SECRET_HOSTS)

    _value = field_validator("value")(_checked_value)


HostEntry = Annotated[str, StringConstraints(min_length=1, max_length=300)]


class HeaderTransform(StrictBody):
    headers: dict[
        Annotated[str, StringConstraints(min_length=1, max_length=128)],
        Annotated[str, StringConstraints(max_length=8192)],
    ] = Field(
        min_length=1,
        max_length=16,
        description="headers set on each request to the rule's host; ${secrets.NAME} in a "
        "value becomes the secret's value (on its own hosts only)",
    )


class NetworkRule(StrictBody):
    transform: HeaderTransform


class NetworkPolicy(StrictBody):
    """What a sandbox may reach (E2B's ``network`` option): entries are host names,
    ``*.domain`` wildcards, IP addresses and CIDRs; ``*`` is everything."""

    allow_out: list[HostEntry] | None = Field(
        None,
        max_length=64,
        description="only these destinations (no list: every public one). TLS and HTTP are "
        "judged by name (SNI, Host), other TCP by its address against IPs and CIDRs",
    )
    deny_out: list[HostEntry] | None = Field(
        None, max_length=64, description="never these, whatever allow_out says; ['*']: nothing"
    )
    rules: (
        dict[Annotated[str, StringConstraints(min_length=1, max_length=300)], list[NetworkRule]]
        | None
    ) = Field(
        None,
        max_length=64,
        description="per host (a name or '*.domain'): transforms of its requests, which the "
        "proxy then intercepts with the daemon's CA",
    )


class SecretInfo(BaseModel):
    name: str
    hosts: list[str] = Field(description="canonical: lower case, IDNA, no trailing dot")
    created_at_unix: float
    updated_at_unix: float = Field(description="the value or the hosts last changed")
    last_used_unix: float | None = Field(
        description="the last request the egress proxy put the value in; null: never"
    )


class NetworkInfo(BaseModel):
    """A sandbox's network policy now (the network object), and whether the egress proxy
    enforces it by name (false: ``--egress-proxy off`` or no namespaces)."""

    allow_out: list[str]
    deny_out: list[str]
    rules: dict[str, list[dict[str, Any]]]
    proxied: bool
    closed: int | None = Field(
        None, description="(after a change) open connections the new policy closed"
    )


class EgressRecordInfo(BaseModel):
    id: int
    time: float = Field(description="when the connection (or HTTP request) began, unix s")
    ended_at: float | None = Field(description="null: still open")
    verdict: Literal["allowed", "refused"]
    kind: Literal["tls", "https", "http", "tcp"] = Field(
        description="tls: passed through by SNI; https: intercepted, one record per request; "
        "http: one per request; tcp: judged by address"
    )
    host: str | None = Field(description="the name it asked for (SNI, Host), canonical")
    port: int
    address: str | None = Field(description="where the proxy connected")
    reason: str | None = Field(description="why it was refused, or what ended it early")
    method: str | None
    path: str | None = Field(description="without its query")
    secrets: list[str] = Field(description="secrets put in, by name")
    bytes_out: int
    bytes_in: int


class EgressPage(BaseModel):
    records: list[EgressRecordInfo]
    next_after: int = Field(description="give as ?after= for the records after these")
