"""Dockerfile builds by the host's own builder (Docker, Podman or Buildah): which one
answers, the argv each runs, and the reference forkd imports the built image from.

forkd does not interpret Dockerfiles. Docker leaves the image in its engine
(``docker-daemon:TAG``); Podman and Buildah export it to an OCI archive in a
directory of its own (``oci-archive:PATH``), which the caller removes with
:func:`remove_export` once imported. Every program runs from an argv list, never a
shell, and every path it is given is absolute, so none can be read as an option.
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from forkd.errors import HostToolMissing, Invalid, NotFound, Unavailable
from forkd.image_import.docker_engine import check_image_name, socket_path

BUILDERS = ("docker", "podman", "buildah")  # the order find_builder tries them in
PACKAGES = {"docker": "docker.io", "podman": "podman", "buildah": "buildah"}
DOCKERFILES = ("Dockerfile", "Containerfile")  # looked for in the context when none is named
PROBE_SECS = 15.0
BUILD_SECS = 3600.0
MAX_BUILD_ARGS = 256
MAX_BUILD_ARG_BYTES = 1 << 20  # all of them: they travel in argv, whose limit is ~2 MiB
MAX_LINE_BYTES = 64 << 10  # of the builder's output, per line handed to progress
TAIL_LINES = 30  # of the builder's output, quoted when it fails
EXPORT_PREFIX = "forkd-build-"

_BUILD_ARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,255}")
_NETWORK = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

ProgressFn = Callable[[str], None]


class NoImageBuilder(HostToolMissing):
    """None of Docker, Podman and Buildah is installed."""

    def __init__(self) -> None:
        Unavailable.__init__(
            self,
            "no container image builder on this host: install one of Docker "
            "(apt install docker.io), Podman (apt install podman) or Buildah (apt install buildah)",
        )
        self.tool = "docker, podman or buildah"
        self.package = "docker.io"


@dataclass(frozen=True)
class BuildSpec:
    """A build, checked: absolute paths, a tag in Docker's grammar, bounded arguments."""

    context: Path
    dockerfile: Path
    tag: str
    build_args: tuple[tuple[str, str], ...]
    network: str | None

    def options(self) -> list[str]:
        """The options Docker, Podman and Buildah share for ``build``."""
        argv = ["--tag", self.tag, "--file", str(self.dockerfile)]
        if self.network is not None:
            argv += ["--network", self.network]
        for name, value in self.build_args:
            argv += ["--build-arg", f"{name}={value}"]
        return argv


def check_build(
    context: Path,
    *,
    tag: str,
    dockerfile: Path | None,
    build_args: dict[str, str] | None,
    network: str | None,
) -> BuildSpec:
    """The build these arguments describe; :class:`Invalid` or :class:`NotFound` saying
    what is wrong with them."""
    check_image_name(tag, allow_digest=False)
    context = Path(context).absolute()
    if not context.exists():
        raise NotFound(f"build context {context} does not exist")
    if not context.is_dir():
        raise Invalid(f"build context {context} is not a directory")
    if dockerfile is None:
        found = [context / name for name in DOCKERFILES if (context / name).is_file()]
        if not found:
            raise NotFound(f"no Dockerfile or Containerfile in {context}: name one with -f")
        dockerfile = found[0]
    dockerfile = Path(dockerfile).absolute()
    if not dockerfile.exists():
        raise NotFound(f"Dockerfile {dockerfile} does not exist")
    if not dockerfile.is_file():
        raise Invalid(f"Dockerfile {dockerfile} is not a regular file")
    args = tuple(sorted((build_args or {}).items()))
    if len(args) > MAX_BUILD_ARGS:
        raise Invalid(f"at most {MAX_BUILD_ARGS} build arguments, not {len(args)}")
    for name, value in args:
        if not isinstance(name, str) or not _BUILD_ARG_NAME.fullmatch(name):
            raise Invalid(
                f"build argument name {name!r}: letters, digits and '_', not first a digit"
            )
        if not isinstance(value, str) or "\0" in value:
            raise Invalid(f"build argument {name}: the value must be text without NUL")
    if sum(len(n.encode()) + len(v.encode()) + 1 for n, v in args) > MAX_BUILD_ARG_BYTES:
        raise Invalid(f"build arguments are over {MAX_BUILD_ARG_BYTES} bytes together")
    if network is not None and not _NETWORK.fullmatch(network):
        raise Invalid(f"network {network!r}: none, host, default or a network's name")
    return BuildSpec(context, dockerfile, tag, args, network)


class Builder(ABC):
    """One builder program on this host."""

    name: ClassVar[str]

    def __init__(self, executable: str, *, export_dir: Path | None = None) -> None:
        self.executable = executable
        self.export_dir = export_dir  # where OCI exports go; the system's temp dir when None

    @abstractmethod
    def probe_argv(self, docker_host: str | None) -> list[str]:
        """A cheap command that succeeds when the builder can build now."""

    @abstractmethod
    def build_argv(self, spec: BuildSpec, docker_host: str | None) -> list[str]:
        """The command that builds ``spec``."""

    def probe(self, docker_host: str | None = None) -> str | None:
        """None when the builder answers, else why not (its output's end)."""
        try:
            proc = subprocess.run(
                self.probe_argv(docker_host),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=PROBE_SECS,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"no answer in {PROBE_SECS:.0f} s"
        except OSError as exc:
            return str(exc)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).decode(errors="replace").strip()[-500:]
            return f"exited {proc.returncode}: {tail}"
        return None

    def build(
        self,
        context: Path,
        *,
        tag: str,
        dockerfile: Path | None = None,
        build_args: dict[str, str] | None = None,
        network: str | None = None,
        docker_host: str | None = None,
        progress: ProgressFn | None = None,
    ) -> str:
        """Build the Dockerfile in ``context`` as ``tag``, handing each line the builder
        prints to ``progress``; return the reference to import the image from."""
        spec = check_build(
            context, tag=tag, dockerfile=dockerfile, build_args=build_args, network=network
        )
        argv = self.build_argv(spec, docker_host)
        run(argv, what=f"{self.name} build", progress=progress)
        return self.result(spec, progress)

    @abstractmethod
    def result(self, spec: BuildSpec, progress: ProgressFn | None) -> str:
        """Where the built image is to be imported from."""


class DockerBuilder(Builder):
    name = "docker"

    def _host(self, docker_host: str | None) -> list[str]:
        # The same socket docker-daemon: imports from: unix only (socket_path says why).
        return [] if docker_host is None else ["-H", f"unix://{socket_path(docker_host)}"]

    def probe_argv(self, docker_host: str | None) -> list[str]:
        fmt = "{{.Server.Version}}"  # fails when the engine does not answer
        return [self.executable, *self._host(docker_host), "version", "--format", fmt]

    def build_argv(self, spec: BuildSpec, docker_host: str | None) -> list[str]:
        return [
            self.executable,
            *self._host(docker_host),
            "build",
            *spec.options(),
            str(spec.context),
        ]

    def result(self, spec: BuildSpec, progress: ProgressFn | None) -> str:
        return f"docker-daemon:{spec.tag}"


class _ExportingBuilder(Builder):
    """A daemonless builder: its image is exported to an OCI archive after the build."""

    def probe_argv(self, docker_host: str | None) -> list[str]:
        return [self.executable, "version"]

    def build_argv(self, spec: BuildSpec, docker_host: str | None) -> list[str]:
        if docker_host is not None:
            raise Invalid(f"docker_host applies to docker builds, not to {self.name}")
        return [self.executable, "build", *spec.options(), str(spec.context)]

    @abstractmethod
    def export_argv(self, tag: str, archive: Path) -> list[str]:
        """The command that writes image ``tag`` to ``archive`` as an OCI archive."""

    def result(self, spec: BuildSpec, progress: ProgressFn | None) -> str:
        workdir = Path(tempfile.mkdtemp(prefix=EXPORT_PREFIX, dir=self.export_dir))
        archive = workdir / "image.tar"
        try:
            run(self.export_argv(spec.tag, archive), what=f"{self.name} export", progress=progress)
            if not archive.is_file():
                raise Invalid(f"{self.name} exported nothing to {archive}")
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return f"oci-archive:{archive}"


class PodmanBuilder(_ExportingBuilder):
    name = "podman"

    def export_argv(self, tag: str, archive: Path) -> list[str]:
        return [self.executable, "save", "--format", "oci-archive", "--output", str(archive), tag]


class BuildahBuilder(_ExportingBuilder):
    name = "buildah"

    def export_argv(self, tag: str, archive: Path) -> list[str]:
        if ":" in str(archive):  # the transport would split the path there
            raise Invalid(f"cannot export to {archive}: a ':' in the path")
        return [self.executable, "push", tag, f"oci-archive:{archive}"]


_CLASSES: dict[str, type[Builder]] = {
    "docker": DockerBuilder,
    "podman": PodmanBuilder,
    "buildah": BuildahBuilder,
}


def find_builder(preferred: str | None = None, *, docker_host: str | None = None) -> Builder:
    """The first of docker, podman and buildah that is on PATH and answers (``preferred``
    alone when given). :class:`HostToolMissing` saying what to install when none is
    installed; :class:`Unavailable` with each one's answer when none answers."""
    if preferred is not None and preferred not in BUILDERS:
        raise Invalid(f"unknown builder {preferred!r}: one of {', '.join(BUILDERS)}")
    silent = []
    for name in BUILDERS if preferred is None else (preferred,):
        executable = shutil.which(name)
        if executable is None:
            continue
        builder = _CLASSES[name](executable)
        problem = builder.probe(docker_host if name == "docker" else None)
        if problem is None:
            return builder
        silent.append(f"{name}: {problem}")
    if silent:
        raise Unavailable("no image builder answered (" + "; ".join(silent) + ")")
    if preferred is not None:
        raise HostToolMissing(preferred, PACKAGES[preferred])
    raise NoImageBuilder()


def remove_export(reference: str) -> None:
    """Remove the archive an exporting builder's :meth:`Builder.build` returned (and its
    directory); any other reference is left alone."""
    if not reference.startswith("oci-archive:"):
        return
    archive = Path(reference[len("oci-archive:") :])
    if archive.name == "image.tar" and archive.parent.name.startswith(EXPORT_PREFIX):
        shutil.rmtree(archive.parent, ignore_errors=True)


def run(
    argv: list[str], *, what: str, progress: ProgressFn | None, timeout: float = BUILD_SECS
) -> None:
    """Run ``argv``, its output (stdout and stderr) line by line to ``progress``;
    :class:`Invalid` with the output's last lines when it fails or runs over ``timeout``."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    except OSError as exc:
        raise Unavailable(f"{what}: cannot run {argv[0]}: {exc.strerror}") from exc
    expired = threading.Event()

    def give_up() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout, give_up)
    timer.start()
    try:
        assert proc.stdout is not None
        while raw := proc.stdout.readline(MAX_LINE_BYTES):
            line = raw.decode(errors="replace").rstrip("\r\n")
            tail.append(line)
            if progress is not None:
                progress(line)
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:  # progress raised: the build is abandoned
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    if code != 0:
        why = f"ran over {timeout:.0f} s" if expired.is_set() else f"exited {code}"
        if progress is not None:  # each line was shown as it came: not again
            last = next((line for line in reversed(tail) if line.strip()), "")
            raise Invalid(f"{what} failed ({argv[0]} {why}; its output is above): {last}")
        output = os.linesep.join(tail)[-4000:]
        raise Invalid(f"{what} failed ({argv[0]} {why}):\n{output}")
