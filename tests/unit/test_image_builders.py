"""forkd.image_import.builders: which builder forkd picks, what it runs, and what it hands
on to import. Docker builds for real (tests/docker_daemon.py); Podman and Buildah are
fake programs on PATH that record their argv (neither is installed here)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.archive.tar_format import Limits, TarReader
from forkd.errors import HostToolMissing, Invalid, NotFound, Unavailable
from forkd.image_import import builders, docker_engine
from tests import docker_daemon
from tests.docker_daemon import DockerDaemon

FAKE_BUILDER = """#!{python}
import json, os, sys
from pathlib import Path
name = Path(sys.argv[0]).name
args = sys.argv[1:]
with open(os.environ["FAKE_BUILDER_LOG"], "a") as log:
    log.write(json.dumps([name, *args]) + "\\n")
verb = next(a for a in args if a in ("version", "build", "save", "push"))
if f"{{name}}:{{verb}}" in os.environ.get("FAKE_BUILDER_FAILS", "").split(","):
    print(f"{{name}} {{verb}}: something went wrong")
    sys.exit(3)
if verb == "build":
    print("STEP 1/2: FROM forkd-test/debian:12")
    print("STEP 2/2: COPY app.py /app.py")
made = Path(os.environ.get("FAKE_BUILDER_ARCHIVE", "/nonexistent"))
archive = made.read_bytes() if made.is_file() else b"oci archive"
if verb == "save":
    Path(args[args.index("--output") + 1]).write_bytes(archive)
if verb == "push":
    Path(args[-1].removeprefix("oci-archive:")).write_bytes(archive)
"""


@pytest.fixture
def fake_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty PATH directory, the fake builders' log, nothing failing yet."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("FAKE_BUILDER_LOG", str(tmp_path / "argv.log"))
    monkeypatch.delenv("FAKE_BUILDER_FAILS", raising=False)
    return bin_dir


def install_fake(bin_dir: Path, name: str) -> str:
    path = bin_dir / name
    path.write_text(FAKE_BUILDER.format(python=sys.executable))
    path.chmod(0o755)
    return str(path)


def ran(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "argv.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def context(tmp_path: Path) -> Path:
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM forkd-test/debian:12\nCOPY app.py /app.py\n")
    (context / "app.py").write_text("print('hi')\n")
    return context


def test_with_no_builder_on_path_it_says_which_to_install(fake_path: Path) -> None:
    with pytest.raises(HostToolMissing) as caught:
        builders.find_builder()
    message = str(caught.value)
    for words in ("apt install docker.io", "podman", "buildah"):
        assert words in message


def test_a_preferred_builder_missing_names_its_package(fake_path: Path) -> None:
    install_fake(fake_path, "docker")
    with pytest.raises(HostToolMissing, match="apt-get install --no-install-recommends podman"):
        builders.find_builder("podman")


def test_an_unknown_builder_is_invalid(fake_path: Path) -> None:
    with pytest.raises(Invalid, match="one of docker, podman, buildah"):
        builders.find_builder("kaniko")


def test_docker_comes_first_when_it_answers(fake_path: Path) -> None:
    docker = install_fake(fake_path, "docker")
    install_fake(fake_path, "podman")
    builder = builders.find_builder()
    assert isinstance(builder, builders.DockerBuilder) and builder.executable == docker


def test_a_docker_whose_engine_does_not_answer_is_passed_over(
    fake_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake(fake_path, "docker")
    install_fake(fake_path, "buildah")
    monkeypatch.setenv("FAKE_BUILDER_FAILS", "docker:version")
    assert isinstance(builders.find_builder(), builders.BuildahBuilder)
    assert [argv[:2] for argv in ran(tmp_path)] == [["docker", "version"], ["buildah", "version"]]


def test_when_no_builder_answers_each_ones_answer_is_quoted(
    fake_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_fake(fake_path, "docker")
    monkeypatch.setenv("FAKE_BUILDER_FAILS", "docker:version")
    with pytest.raises(Unavailable, match="docker: exited 3: docker version: something went wrong"):
        builders.find_builder()


def test_docker_build_runs_its_argv_and_hands_on_the_engines_image(
    fake_path: Path, tmp_path: Path, context: Path
) -> None:
    docker = install_fake(fake_path, "docker")
    lines: list[str] = []
    ref = builders.DockerBuilder(docker).build(
        context,
        tag="team/app:1",
        build_args={"VERSION": "1.2", "A": "x y"},
        network="none",
        docker_host="/run/d.sock",
        progress=lines.append,
    )
    assert ref == "docker-daemon:team/app:1"
    assert ran(tmp_path) == [
        [
            "docker",
            "-H",
            "unix:///run/d.sock",
            "build",
            "--tag",
            "team/app:1",
            "--file",
            str(context / "Dockerfile"),
            "--network",
            "none",
            "--build-arg",
            "A=x y",
            "--build-arg",
            "VERSION=1.2",
            str(context),
        ],
    ]
    assert lines == ["STEP 1/2: FROM forkd-test/debian:12", "STEP 2/2: COPY app.py /app.py"]


@pytest.mark.parametrize("name", ["podman", "buildah"])
def test_a_daemonless_build_is_exported_to_an_oci_archive_the_caller_removes(
    name: str, fake_path: Path, tmp_path: Path, context: Path
) -> None:
    install_fake(fake_path, name)
    exports = tmp_path / "exports"
    exports.mkdir()
    builder = builders.find_builder(name)
    builder.export_dir = exports
    dockerfile = tmp_path / "Other.Dockerfile"
    dockerfile.write_text("FROM forkd-test/busybox:1\n")
    ref = builder.build(context, tag="app:1", dockerfile=dockerfile, network="none")

    assert ref.startswith("oci-archive:")
    archive = Path(ref.removeprefix("oci-archive:"))
    assert archive.read_bytes() == b"oci archive" and archive.parent.parent == exports
    build = [name, "build", "--tag", "app:1", "--file", str(dockerfile), "--network", "none"]
    export = {
        "podman": ["podman", "save", "--format", "oci-archive", "--output", str(archive), "app:1"],
        "buildah": ["buildah", "push", "app:1", f"oci-archive:{archive}"],
    }[name]
    assert ran(tmp_path) == [[name, "version"], [*build, str(context)], export]
    builders.remove_export(ref)
    assert list(exports.iterdir()) == []


def test_a_failed_export_leaves_no_archive(
    fake_path: Path, tmp_path: Path, context: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    podman = install_fake(fake_path, "podman")
    monkeypatch.setenv("FAKE_BUILDER_FAILS", "podman:save")
    builder = builders.PodmanBuilder(podman, export_dir=tmp_path / "exports")
    (tmp_path / "exports").mkdir()
    with pytest.raises(Invalid, match=r"podman export failed .* exited 3"):
        builder.build(context, tag="app:1")
    assert list((tmp_path / "exports").iterdir()) == []


def test_a_failed_build_is_invalid_with_the_builders_last_lines(
    fake_path: Path, context: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    podman = install_fake(fake_path, "podman")
    monkeypatch.setenv("FAKE_BUILDER_FAILS", "podman:build")
    with pytest.raises(Invalid, match=r"(?s)exited 3.*podman build: something went wrong"):
        builders.PodmanBuilder(podman).build(context, tag="app:1")


def test_a_containerfile_is_found_when_there_is_no_dockerfile(
    fake_path: Path, tmp_path: Path, context: Path
) -> None:
    (context / "Dockerfile").rename(context / "Containerfile")
    builders.DockerBuilder(install_fake(fake_path, "docker")).build(context, tag="app")
    assert ran(tmp_path)[0][4:6] == ["--file", str(context / "Containerfile")]


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"tag": "App:1"}, Invalid, "repository component"),
        ({"tag": "app@sha256:" + "a" * 64}, Invalid, "digest"),
        ({"tag": "app:1 --push"}, Invalid, "spaces"),
        ({"context": "missing"}, NotFound, "does not exist"),
        ({"context": "ctx/app.py"}, Invalid, "not a directory"),
        ({"dockerfile": "nope"}, NotFound, "does not exist"),
        ({"dockerfile": "ctx"}, Invalid, "not a regular file"),
        ({"build_args": {"1X": "v"}}, Invalid, "build argument name"),
        ({"build_args": {"X": "a\0b"}}, Invalid, "without NUL"),
        ({"build_args": {f"A{i}": "" for i in range(300)}}, Invalid, "at most 256"),
        ({"network": "--privileged"}, Invalid, "network"),
        ({"docker_host": "tcp://127.0.0.1:2375"}, Invalid, "unix socket"),
    ],
)
def test_a_bad_build_request_is_refused_before_the_builder_runs(
    change: dict[str, object],
    error: type[Exception],
    words: str,
    fake_path: Path,
    tmp_path: Path,
    context: Path,
) -> None:
    request: dict[str, object] = {"tag": "app:1", **change}
    where = str(request.pop("context", "ctx"))
    if isinstance(request.get("dockerfile"), str):
        request["dockerfile"] = tmp_path / str(request["dockerfile"])
    builder = builders.DockerBuilder(install_fake(fake_path, "docker"))
    with pytest.raises(error, match=words):
        builder.build(tmp_path / where, **request)  # type: ignore[arg-type]
    assert ran(tmp_path) == []


def test_podman_refuses_a_docker_host(fake_path: Path, tmp_path: Path, context: Path) -> None:
    builder = builders.PodmanBuilder(install_fake(fake_path, "podman"))
    with pytest.raises(Invalid, match="docker_host applies to docker"):
        builder.build(context, tag="app:1", docker_host="/run/docker.sock")
    assert ran(tmp_path) == []


# ---------------------------------------------------------------- a real Docker Engine


@pytest.fixture(scope="session")
def dockerd() -> Iterator[DockerDaemon]:
    yield from docker_daemon.daemon_or_skip()


APP_DOCKERFILE = """\
FROM forkd-test/debian:12
ARG APP_VERSION=0
ENV APP_VERSION=${APP_VERSION} PYTHONUNBUFFERED=1
WORKDIR /app
COPY app.py .
RUN ["python3", "-m", "py_compile", "/app/app.py"]
USER nobody
EXPOSE 8080
CMD ["python3", "app.py"]
"""


def test_docker_builds_a_real_dockerfile_that_docker_engine_then_exports(
    dockerd: DockerDaemon, tmp_path: Path
) -> None:
    dockerd.base_image("forkd-test/debian:12")
    (tmp_path / "Dockerfile").write_text(APP_DOCKERFILE)
    (tmp_path / "app.py").write_text("import os\nprint('version', os.environ['APP_VERSION'])\n")
    builder = builders.find_builder("docker", docker_host=dockerd.host)
    lines: list[str] = []
    ref = builder.build(
        tmp_path,
        tag="forkd-test/builder-app:1",
        build_args={"APP_VERSION": "7"},
        network="none",
        docker_host=dockerd.host,
        progress=lines.append,
    )
    assert ref == "docker-daemon:forkd-test/builder-app:1"
    assert len(lines) >= 8  # the builder's own account, a line or more a step

    out = tmp_path / "image.tar"
    docker_engine.save(ref.removeprefix("docker-daemon:"), out, docker_host=dockerd.host)
    contents: dict[str, bytes] = {}
    with out.open("rb") as stream:
        reader = TarReader(stream.read, Limits(max_bytes=4 << 30))
        for member in reader:
            if member.name.endswith(".json"):
                contents[member.name] = b"".join(piece for _, piece in reader.chunks())
            else:
                contents[member.name] = b""
    (manifest,) = json.loads(contents["manifest.json"])
    assert all(layer in contents for layer in manifest["Layers"])
    config = json.loads(contents[manifest["Config"]])["config"]
    assert "APP_VERSION=7" in config["Env"]
    assert (config["WorkingDir"], config["User"], config["Cmd"]) == (
        "/app",
        "nobody",
        ["python3", "app.py"],
    )
    run = dockerd.run("run", "--rm", "--network", "none", "forkd-test/builder-app:1")
    assert run.stdout == "version 7\n", run.stderr


def test_a_failing_dockerfile_is_invalid_with_the_builders_words(
    dockerd: DockerDaemon, tmp_path: Path
) -> None:
    dockerd.base_image("forkd-test/busybox:1")
    (tmp_path / "Dockerfile").write_text('FROM forkd-test/busybox:1\nRUN ["sh", "-c", "exit 42"]\n')
    builder = builders.find_builder("docker", docker_host=dockerd.host)
    with pytest.raises(Invalid, match=r"(?s)docker build failed.*42"):
        builder.build(tmp_path, tag="forkd-test/fails:1", docker_host=dockerd.host)


def test_a_failing_builds_output_is_shown_once() -> None:
    """Issue 36, item 7: each line went to progress as it came; the error names the
    last one, not the whole output again."""
    shown: list[str] = []
    with pytest.raises(Invalid) as failed:
        builders.run(
            ["sh", "-c", "echo step one; echo step two; echo 'no such package'; exit 3"],
            what="docker build",
            progress=shown.append,
        )
    assert shown == ["step one", "step two", "no such package"]
    said = str(failed.value)
    assert "exited 3; its output is above" in said and said.endswith("no such package")
    assert "step one" not in said
    with pytest.raises(Invalid, match=r"(?s)step one.*no such package"):  # no progress: all
        builders.run(
            ["sh", "-c", "echo step one; echo 'no such package'; exit 3"],
            what="docker build",
            progress=None,
        )
