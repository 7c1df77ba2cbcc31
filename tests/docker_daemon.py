"""A real Docker Engine for tests: one ``dockerd`` per data root, on a private socket,
data root and exec root, touching no host networking, shared by the test processes
that use it at once, with base images made once and kept (there is no Docker Hub here).

A test module takes it as a session fixture (``yield from daemon_or_skip()``), then
``dockerd.base_image("forkd-test/debian:12")``, ``dockerd.build(context, "app:1")``.
Where dockerd cannot run (docker.io missing, not root, no cgroups, or it fails to
start) the test is skipped saying why. The data root is ``$FORKD_TEST_DOCKER_ROOT``
or ``~/.cache/forkd/test-docker``; ``dockerd.log`` there names the storage driver used.

Sharing: starting happens under ``start.lock``; each user holds ``users.lock`` shared
while it uses the daemon, and the last to leave (the one that then gets it exclusive)
stops the daemon, kills the containerd shims it left and unmounts what it mounted.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx
import pytest

ROOT_ENV = "FORKD_TEST_DOCKER_ROOT"
START_SECS = 60.0
STOP_SECS = 20.0
LOCK_SECS = 1800.0  # another process may be making a base image meanwhile
BUILD_SECS = 900.0
LOG_ROTATE_BYTES = 4 << 20
STORAGE_DRIVERS = ("overlay2", "vfs")  # overlay2 where the data root's filesystem allows it
NAMESPACE = "forkd-test"  # containerd's, in case dockerd joins a system containerd
PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
RECIPE_LABEL = "forkd.test.recipe"


@dataclass(frozen=True)
class BaseImage:
    include: str | None  # the packages mmdebstrap adds to minbase; None: busybox alone
    changes: tuple[str, ...]  # the config `docker import --change` sets
    options: tuple[str, ...] = ()  # more of mmdebstrap's (fixed text, ours)


BASE_IMAGES: dict[str, BaseImage] = {
    "forkd-test/debian:12": BaseImage("python3", (f"ENV {PATH_ENV}", 'CMD ["bash"]')),
    "forkd-test/postgres:15": BaseImage(
        "postgresql",
        (
            f"ENV PATH=/usr/lib/postgresql/15/bin:{PATH_ENV[5:]}",
            "ENV PGDATA=/var/lib/postgresql/15/main",
            "EXPOSE 5432",
            "USER postgres",
            'CMD ["postgres", "-D", "/var/lib/postgresql/15/main", "-c", '
            '"config_file=/etc/postgresql/15/main/postgresql.conf", "-c", "listen_addresses=*"]',
        ),
        # Its socket directory, which a booted Debian makes at boot (tmpfiles.d); mmdebstrap
        # would empty /run.
        (
            '--customize-hook=chroot "$1" install -d -o postgres -g postgres -m 2775 '
            "/run/postgresql",
            "--skip=cleanup/run",
        ),
    ),
    "forkd-test/busybox:1": BaseImage(None, (f"ENV {PATH_ENV}", 'CMD ["sh"]')),
}

_children: dict[int, subprocess.Popen[bytes]] = {}  # dockerds this process started
_failures: dict[Path, str] = {}  # a start that failed here is not tried again


class DockerUnavailable(Exception):
    """dockerd cannot run on this host; the message says why."""


def default_root() -> Path:
    env = os.environ.get(ROOT_ENV)
    return Path(env) if env else Path.home() / ".cache" / "forkd" / "test-docker"


def host_problem() -> str | None:
    """Why dockerd cannot run here, from what can be seen without starting it; else None."""
    missing = [tool for tool in ("dockerd", "containerd", "runc") if shutil.which(tool) is None]
    if _docker_cli() is None:
        missing.append("docker")
    if missing:
        return f"{', '.join(missing)} not found: apt-get install docker.io"
    if os.geteuid() != 0:
        return f"dockerd needs root (rootless is not set up); this runs as uid {os.geteuid()}"
    if _cgroup_version() is None:
        return "no cgroup filesystem is mounted (dockerd needs cgroups v1 or v2)"
    return None


def _docker_cli() -> str | None:
    # Debian's CLI first: it matches Debian's dockerd, whatever else is on PATH.
    return shutil.which("docker", path=os.pathsep.join(["/usr/bin", os.environ.get("PATH", "")]))


def _cgroup_version() -> int | None:
    types = {line.split(" - ")[1].split()[0] for line in _mountinfo() if " - " in line}
    if "cgroup2" in types and Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return 2
    return 1 if "cgroup" in types else (2 if "cgroup2" in types else None)


def _mountinfo() -> list[str]:
    return Path("/proc/self/mountinfo").read_text().splitlines()


@dataclass(frozen=True)
class DockerDaemon:
    root: Path  # the cache: data root, log, locks
    run_dir: Path  # socket, pid file, exec root (tmpfs: gone with a reboot, as they should)
    docker: str  # the CLI
    storage_driver: str

    @property
    def socket(self) -> Path:
        return self.run_dir / "docker.sock"

    @property
    def host(self) -> str:
        """``unix://...``: what ``docker -H`` and ``DOCKER_HOST`` take."""
        return f"unix://{self.socket}"

    def run(
        self, *args: str, stdin: IO[bytes] | None = None, timeout: float = BUILD_SECS
    ) -> subprocess.CompletedProcess[str]:
        """``docker -H <this daemon> ARGS`` (never a shell, never the host's default socket)."""
        return subprocess.run(
            [self.docker, "-H", self.host, *args],
            stdin=stdin if stdin is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_cli_env(self.root),
            check=False,
        )

    def popen(self, *args: str) -> subprocess.Popen[bytes]:
        """``docker -H <this daemon> ARGS`` started, its output a pipe to read as it comes
        (``docker export`` of a large root), its errors to the caller's stderr."""
        return subprocess.Popen(
            [self.docker, "-H", self.host, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            env=_cli_env(self.root),
        )

    def check(self, *args: str, stdin: IO[bytes] | None = None) -> str:
        proc = self.run(*args, stdin=stdin)
        if proc.returncode != 0:
            tail = (proc.stderr + proc.stdout).strip()[-3000:]
            raise RuntimeError(f"docker {' '.join(args)} exited {proc.returncode}: {tail}")
        return proc.stdout

    def image_label(self, name: str, label: str) -> str | None:
        """A label of image ``name``; None when the daemon has no such image."""
        fmt = "{{ index .Config.Labels " + json.dumps(label) + " }}"
        proc = self.run("image", "inspect", "--format", fmt, name, timeout=60)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def base_image(self, name: str) -> str:
        """``name`` (one of BASE_IMAGES), made now unless the data root holds it already."""
        base = BASE_IMAGES[name]
        recipe = hashlib.sha256(repr((base, _BUSYBOX_SIZE)).encode()).hexdigest()[:16]
        if self.image_label(name, RECIPE_LABEL) == recipe:
            return name
        lock = self.root / f"image-{re.sub(r'[^a-z0-9]+', '-', name)}.lock"
        with _flock(lock, fcntl.LOCK_EX):
            if self.image_label(name, RECIPE_LABEL) != recipe:  # another process may have made it
                self._import(name, base, f"LABEL {RECIPE_LABEL}={recipe}")
        return name

    def _import(self, name: str, base: BaseImage, label: str) -> None:
        argv = ["import"]
        for change in (*base.changes, label):
            argv += ["--change", change]
        with tempfile.TemporaryFile() as rootfs:
            if base.include is None:
                rootfs.write(busybox_rootfs())
            else:
                _mmdebstrap(base, rootfs)
            rootfs.seek(0)
            self.check(*argv, "-", name, stdin=rootfs)
        # A base made by an older recipe, now untagged, goes (unless an image still uses it).
        self.run("image", "prune", "--force", "--filter", f"label={RECIPE_LABEL}")

    def build(
        self,
        context_dir: Path,
        tag: str,
        dockerfile: Path | None = None,
        build_args: dict[str, str] | None = None,
    ) -> str:
        """``docker build --network none -t TAG CONTEXT``; the base images its FROM lines
        name are made first. Returns ``tag``."""
        dockerfile = dockerfile or Path(context_dir) / "Dockerfile"
        for base in re.findall(r"(?im)^\s*FROM\s+(?:--\S+\s+)*(\S+)", dockerfile.read_text()):
            if base in BASE_IMAGES:
                self.base_image(base)
        argv = ["build", "--network", "none", "--force-rm", "--tag", tag, "--file", str(dockerfile)]
        for key, value in (build_args or {}).items():
            argv += ["--build-arg", f"{key}={value}"]
        self.check(*argv, str(context_dir))
        return tag


def _cli_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    env["DOCKER_CONFIG"] = str(root / "cli-config")  # not the user's ~/.docker (credential helpers)
    return env


def _mmdebstrap(base: BaseImage, out: IO[bytes]) -> None:
    """Debian 12 minbase with ``base.include``, as a tar, into ``out`` (the Debian mirror)."""
    tool = shutil.which("mmdebstrap")
    if tool is None:
        raise DockerUnavailable("mmdebstrap not found: apt-get install mmdebstrap")
    argv = [tool, "--quiet", "--variant=minbase", f"--include={base.include}", "--format=tar"]
    argv += [*base.options, "bookworm", "-"]
    proc = subprocess.run(argv, stdout=out, stderr=subprocess.PIPE, timeout=BUILD_SECS)
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-3000:]
        raise RuntimeError(f"mmdebstrap exited {proc.returncode}: {tail}")


_BUSYBOX = Path("/bin/busybox")
_BUSYBOX_SIZE = _BUSYBOX.stat().st_size if _BUSYBOX.exists() else 0
_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
_GROUP = "root:x:0:\nnogroup:x:65534:\n"


def busybox_rootfs() -> bytes:
    """A tar of Debian's static busybox, its applets as symlinks to it, /etc/passwd and
    /etc/group (and an empty /tmp and /root): no libc, no Python."""
    if not _BUSYBOX.exists():
        raise DockerUnavailable("/bin/busybox not found: apt-get install busybox-static")
    applets = subprocess.run(
        [str(_BUSYBOX), "--list-full"], capture_output=True, text=True, check=True
    ).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:

        def add(path: str, kind: bytes, mode: int, data: bytes = b"", target: str = "") -> None:
            info = tarfile.TarInfo(path)
            info.type, info.mode, info.mtime, info.linkname = kind, mode, 0, target
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)

        dirs = {"bin", "etc", "tmp", "root"} | {str(Path(a).parent) for a in applets}
        for d in sorted(dirs):
            mode = 0o1777 if d == "tmp" else 0o700 if d == "root" else 0o755
            add(d, tarfile.DIRTYPE, mode)
        add("bin/busybox", tarfile.REGTYPE, 0o755, _BUSYBOX.read_bytes())
        for applet in applets:
            if applet != "bin/busybox":
                add(applet, tarfile.SYMTYPE, 0o777, target="/bin/busybox")
        add("etc/passwd", tarfile.REGTYPE, 0o644, _PASSWD.encode())
        add("etc/group", tarfile.REGTYPE, 0o644, _GROUP.encode())
    return buf.getvalue()


@contextlib.contextmanager
def _flock(path: Path, kind: int, timeout: float = LOCK_SECS) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, kind | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DockerUnavailable(f"{path} stayed locked for {timeout:.0f} s") from None
                time.sleep(0.2)
        yield fd
    finally:
        os.close(fd)


def _run_dir(root: Path) -> Path:
    # Short (a unix socket path is at most 107 bytes) and derived from the root, so every
    # process sharing the root finds the same socket.
    tag = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
    base = Path("/run") if os.access("/run", os.W_OK) else Path(tempfile.gettempdir())
    return base / f"forkd-test-docker-{tag}"


@contextlib.contextmanager
def running(root: Path | None = None) -> Iterator[DockerDaemon]:
    """The daemon of ``root`` (the default cache), started unless another process has it
    running; stopped when the last process using it leaves. DockerUnavailable if it
    cannot run."""
    problem = host_problem()
    if problem:
        raise DockerUnavailable(problem)
    root = (root or default_root()).resolve()
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if root in _failures:
        raise DockerUnavailable(_failures[root])
    users = os.open(root / "users.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        with _flock(root / "start.lock", fcntl.LOCK_EX):
            fcntl.flock(users, fcntl.LOCK_SH)
            try:
                daemon = _ensure_started(root)
            except DockerUnavailable as exc:
                _failures[root] = str(exc)
                raise
        yield daemon
    finally:
        with _flock(root / "start.lock", fcntl.LOCK_EX):
            fcntl.flock(users, fcntl.LOCK_UN)
            with contextlib.suppress(BlockingIOError):  # another process still uses it
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _stop(root, _run_dir(root))
            os.close(users)


def daemon_or_skip(root: Path | None = None) -> Iterator[DockerDaemon]:
    """For a pytest fixture: the running daemon, or the test skipped saying why not."""
    stack = contextlib.ExitStack()
    try:
        daemon = stack.enter_context(running(root))
    except DockerUnavailable as exc:
        pytest.skip(f"no Docker Engine for this test: {exc}")
    with stack:
        yield daemon


def _ensure_started(root: Path) -> DockerDaemon:
    run_dir = _run_dir(root)
    docker = _docker_cli()
    assert docker is not None  # host_problem() said so
    driver_file = root / "storage-driver"
    saved = driver_file.read_text().strip() if driver_file.exists() else ""
    if saved and _answers(run_dir / "docker.sock") and _daemon_pid(root, run_dir):
        return DockerDaemon(root, run_dir, docker, saved)
    _stop(root, run_dir)  # what a crashed or killed run left
    errors = []
    for driver in [saved] if saved else STORAGE_DRIVERS:
        problem = _start(root, run_dir, driver)
        if problem is None:
            driver_file.write_text(driver + "\n")
            return DockerDaemon(root, run_dir, docker, driver)
        errors.append(f"with {driver}: {problem}")
        _stop(root, run_dir)
    hint = f" (delete {root} to start afresh)" if saved else ""
    raise DockerUnavailable(f"dockerd did not start{hint}: " + "; ".join(errors))


def _dockerd_argv(root: Path, run_dir: Path, driver: str) -> list[str]:
    return [
        str(shutil.which("dockerd")),
        "--config-file",
        str(run_dir / "daemon.json"),  # not the host's /etc/docker/daemon.json
        "--data-root",
        str(root / "data"),
        "--exec-root",
        str(run_dir / "exec"),
        "--pidfile",
        str(run_dir / "dockerd.pid"),
        "--host",
        f"unix://{run_dir / 'docker.sock'}",
        "--storage-driver",
        driver,
        # No bridge, no NAT, no forwarding: the host's network is left as it was.
        "--iptables=false",
        "--ip6tables=false",
        "--bridge=none",
        "--ip-forward=false",
        "--ip-masq=false",
        "--userland-proxy=false",
        # cgroupfs works on v1 and v2; a parent of its own keeps clear of a host dockerd's.
        "--exec-opt",
        "native.cgroupdriver=cgroupfs",
        "--cgroup-parent",
        "/forkd-test-docker",
        "--containerd-namespace",
        NAMESPACE,
        "--containerd-plugins-namespace",
        f"{NAMESPACE}-plugins",
    ]


def _start(root: Path, run_dir: Path, driver: str) -> str | None:
    """Start dockerd; None once it answers, else why not (its log's tail)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    (run_dir / "daemon.json").write_text("{}\n")
    log_path = root / "dockerd.log"
    if log_path.exists() and log_path.stat().st_size > LOG_ROTATE_BYTES:
        log_path.replace(root / "dockerd.log.1")
    offset = log_path.stat().st_size if log_path.exists() else 0
    with log_path.open("ab") as log:
        note = (
            f"\n=== forkd tests: starting dockerd, storage driver {driver}, "
            f"cgroups v{_cgroup_version()}, {time.strftime('%Y-%m-%dT%H:%M:%S')}\n"
        )
        log.write(note.encode())
        log.flush()
        proc = subprocess.Popen(
            _dockerd_argv(root, run_dir, driver),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # it outlives this process when another still uses it
        )
    _children[proc.pid] = proc
    deadline = time.monotonic() + START_SECS
    while time.monotonic() < deadline:
        if _answers(run_dir / "docker.sock"):
            return None
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    with log_path.open("rb") as log:
        log.seek(offset)
        tail = log.read().decode(errors="replace").strip()[-1500:]
    state = f"exited {proc.returncode}" if proc.poll() is not None else "did not answer"
    return f"{state}; log {log_path}: ...{tail}"


def _answers(sock: Path) -> bool:
    if not sock.exists():
        return False
    try:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=2.0) as client:
            return client.get("http://docker/_ping").text == "OK"
    except httpx.HTTPError:
        return False


def _daemon_pid(root: Path, run_dir: Path) -> int | None:
    """The pid in the pid file, when it is a dockerd of this data root."""
    try:
        pid = int((run_dir / "dockerd.pid").read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    is_ours = Path(argv[0].decode()).name == "dockerd" and str(root / "data").encode() in argv
    return pid if is_ours else None


def _stop(root: Path, run_dir: Path) -> None:
    """Stop this root's dockerd, then whatever it left: shims, containerd, mounts."""
    pid = _daemon_pid(root, run_dir)
    if pid is not None and not _signal_and_wait(pid, signal.SIGTERM, STOP_SECS):
        _signal_and_wait(pid, signal.SIGKILL, 10)
    # Shims outlive a dockerd that was killed; they name its containerd's socket.
    for stray in _processes_naming(str(run_dir / "exec")):
        _signal_and_wait(stray, signal.SIGKILL, 10)
    for target in _mounts_under(root / "data", run_dir):
        subprocess.run(["umount", "-l", target], capture_output=True, check=False)
    if not _mounts_under(run_dir):
        # Its pid files would name processes gone (or zombies nobody reaped yet), which a
        # new dockerd would wait on for ever; a stopped daemon needs none of its run state.
        shutil.rmtree(run_dir / "exec", ignore_errors=True)
    for name in ("docker.sock", "dockerd.pid", "daemon.json"):
        (run_dir / name).unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        run_dir.rmdir()


def _signal_and_wait(pid: int, sig: int, seconds: float) -> bool:
    """Send ``sig`` to ``pid``; True once it is gone (reaped, when it is our child)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    child = _children.get(pid)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if child is not None and child.poll() is not None:
            _children.pop(pid, None)
            return True
        if child is None and _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _gone(pid: int) -> bool:
    """No such process, or only a zombie its parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _processes_naming(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            if int(entry.name) != os.getpid() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def _mounts_under(*dirs: Path) -> list[str]:
    """Mount points below ``dirs``, deepest first (mountinfo's fifth field, octal-escaped)."""
    prefixes = [str(d) + "/" for d in dirs]
    points = []
    for line in _mountinfo():
        fields = line.split()
        if len(fields) > 4:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            if any(point.startswith(p) for p in prefixes):
                points.append(point)
    return sorted(points, key=len, reverse=True)
