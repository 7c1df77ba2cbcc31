"""The bodies of E2B's template build API, as its SDKs send them (``TemplateBuildRequestV3``,
``TemplateBuildStartV2``, ``TemplateStep``), bounded."""

from __future__ import annotations

from pydantic import Field, field_validator

from forkd.controller.e2b.models import Body

MAX_ARG_CHARS = 64 << 10  # one step argument (a RUN's shell line)
MAX_ARGS = 512  # of one step (ENV's names and values)


class BuildRequest(Body):
    name: str | None = Field(None, max_length=256)
    alias: str | None = Field(None, max_length=256)  # the SDK's older name for it
    tags: list[str] | None = Field(None, max_length=16)
    team_id: str | None = Field(None, alias="teamID", max_length=256)
    cpu_count: int | None = Field(None, alias="cpuCount", ge=1, le=64)
    memory_mb: int | None = Field(None, alias="memoryMB", ge=128, le=65536)
    min_free_disk_mb: int | None = Field(None, alias="minFreeDiskMB", ge=0)


class BuildStep(Body):
    type: str = Field(max_length=32)
    args: list[str] = Field(default_factory=list, max_length=MAX_ARGS)
    files_hash: str | None = Field(None, alias="filesHash", max_length=128)
    force: bool = False
    force_upload: bool | None = Field(None, alias="forceUpload")

    def arg(self, index: int) -> str:
        """The step's ``index``-th argument ('' when it has fewer)."""
        return self.args[index] if index < len(self.args) else ""

    @field_validator("args")
    @classmethod
    def _bounded(cls, args: list[str]) -> list[str]:
        if any(len(a) > MAX_ARG_CHARS or "\0" in a for a in args):
            raise ValueError(f"a step argument is at most {MAX_ARG_CHARS} characters, no NUL")
        return args


class RegistryLogin(Body):
    type: str = Field("registry", max_length=32)
    username: str | None = Field(None, max_length=1024)
    password: str | None = Field(None, max_length=8192)


class BuildStart(Body):
    from_image: str | None = Field(None, alias="fromImage", max_length=4096)
    from_template: str | None = Field(None, alias="fromTemplate", max_length=256)
    from_image_registry: RegistryLogin | None = Field(None, alias="fromImageRegistry")
    force: bool = False
    steps: list[BuildStep] = Field(default_factory=list, max_length=500)
    start_cmd: str | None = Field(None, alias="startCmd", max_length=MAX_ARG_CHARS)
    ready_cmd: str | None = Field(None, alias="readyCmd", max_length=MAX_ARG_CHARS)
