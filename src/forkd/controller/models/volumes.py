"""Volumes: what the daemon says of one."""

from __future__ import annotations

from pydantic import BaseModel


class VolumeInfo(BaseModel):
    name: str
    size_bytes: int
    created_at_unix: int
    allocated_bytes: int
    layers: int
    used_by: list[str]
