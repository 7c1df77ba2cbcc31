"""What an image reference names, checked before anything is read: a registry's image, a
Docker Engine's, a ``docker save`` archive, an OCI archive or an OCI layout directory.

The forms (as skopeo spells them)::

    registry.example.com[:port]/repo[:tag][@sha256:...]   a registry (short names
                                                          only under --default-registry)
    docker-daemon:IMAGE[:tag]                            the local Docker Engine
    docker-archive:PATH[:IMAGE:tag]                      `docker save` output
    oci-archive:PATH[:tag]                               a tar of an OCI layout
    oci:DIR[:tag]                                        an OCI layout directory

A PATH is on the daemon's host. It may itself hold ``:``: the longest prefix
of what follows the transport that exists is the path, and the rest the tag;
when none exists, the whole is the path (and the import says it is not there).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from forkd.errors import Invalid
from forkd.oci.policy import RegistryPolicy
from forkd.oci.reference import Reference

MAX_TEXT = 4096 + 256  # PATH_MAX and a tag
_LAYOUT_TAG = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._:@+/-]{0,254})")
FORMS = (
    "registry.example.com[:port]/repository[:tag][@sha256:...], "
    "docker-daemon:IMAGE[:tag], docker-archive:PATH[:IMAGE:tag], "
    "oci-archive:PATH[:tag] or oci:DIR[:tag]"
)


@dataclass(frozen=True)
class RegistryImage:
    ref: Reference

    def __str__(self) -> str:
        return str(self.ref)


@dataclass(frozen=True)
class DaemonImage:
    image: str  # as the Docker Engine names it: "myapp:1", "sha256:<id>"

    def __str__(self) -> str:
        return f"docker-daemon:{self.image}"


@dataclass(frozen=True)
class DockerArchive:
    path: Path
    tag: str | None = None  # one of the archive's RepoTags, when it holds several images

    def __str__(self) -> str:
        return f"docker-archive:{self.path}" + (f":{self.tag}" if self.tag else "")


@dataclass(frozen=True)
class OciArchive:
    path: Path
    tag: str | None = None  # an org.opencontainers.image.ref.name of its index.json

    def __str__(self) -> str:
        return f"oci-archive:{self.path}" + (f":{self.tag}" if self.tag else "")


@dataclass(frozen=True)
class OciLayout:
    path: Path
    tag: str | None = None

    def __str__(self) -> str:
        return f"oci:{self.path}" + (f":{self.tag}" if self.tag else "")


ImageSource = RegistryImage | DaemonImage | DockerArchive | OciArchive | OciLayout


def parse(text: str, policy: RegistryPolicy) -> ImageSource:
    """The source ``text`` names; :class:`Invalid` listing the accepted forms otherwise."""
    if not isinstance(text, str) or not text or len(text) > MAX_TEXT:
        raise Invalid(f"an image reference is 1 to {MAX_TEXT} characters: {FORMS}")
    if any(not c.isprintable() for c in text):
        raise Invalid(f"an image reference holds no control characters: {FORMS}")
    transport, sep, rest = text.partition(":")
    if sep and transport == "docker-daemon":
        from forkd.image_import import docker_engine  # names checked as the engine does

        return DaemonImage(docker_engine.check_image_name(_nonempty(rest, text)))
    if sep and transport in ("docker-archive", "oci-archive", "oci"):
        path, tag = _path_and_tag(_nonempty(rest, text))
        if transport == "docker-archive":
            return DockerArchive(path, _docker_tag(tag, text))
        if tag is not None and not _LAYOUT_TAG.fullmatch(tag):
            raise Invalid(f"invalid tag {tag!r} in {text!r}")
        return (OciArchive if transport == "oci-archive" else OciLayout)(path, tag)
    if "://" in text:
        raise Invalid(f"unknown kind of image reference {_shown(text)}: {FORMS}")
    try:
        return RegistryImage(policy.parse(text))
    except Invalid as exc:
        raise type(exc)(f"{exc} (an image reference is one of: {FORMS})") from None


def _nonempty(rest: str, text: str) -> str:
    if not rest:
        raise Invalid(f"{_shown(text)} names nothing after its transport: {FORMS}")
    return rest


def _path_and_tag(rest: str) -> tuple[Path, str | None]:
    """The longest existing prefix of ``rest`` before a ``:`` is the path, the rest
    its tag; with none existing, all of ``rest`` is the path."""
    if "\0" in rest:
        raise Invalid("a path holds no NUL byte")
    cut = len(rest)
    while cut > 0:
        if os.path.lexists(rest[:cut]):
            tag = rest[cut + 1 :] if cut < len(rest) else None
            return _absolute(rest[:cut]), tag or None
        cut = rest.rfind(":", 0, cut)
    return _absolute(rest), None


def _absolute(path: str) -> Path:
    return Path(os.path.abspath(path))


def _docker_tag(tag: str | None, text: str) -> str | None:
    if tag is None:
        return None
    from forkd.image_import import docker_engine

    try:
        docker_engine.check_image_name(tag, allow_digest=False)
    except Invalid as exc:
        raise Invalid(f"invalid image tag in {_shown(text)}: {exc}") from None
    return tag


def _shown(text: str) -> str:
    return repr(text if len(text) <= 200 else text[:200] + "...")
