"""Issue 36, item 11: the registries a daemon may use change without a restart. A
--registry-policy file adds to the command line's, is read again when it changes (and on
SIGHUP), and a bad edit is logged and ignored: the policy in force stays. Through the
daemon's API too: a docker-archive: path outside every allowed directory is refused
naming ``forkd image load``, then allowed once the file lists its directory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from forkd.controller.registry_policy_file import PolicyFile, RegistryChoices
from forkd.controller.settings import Settings
from tests import oci_images as oi
from tests.unit.fake_images import stand_in_boot_parts

FLAGS = RegistryChoices(("127.0.0.1:5000",), None, ())


def _write(path: Path, text: str) -> None:
    staged = path.with_suffix(".new")
    staged.write_text(text)
    staged.replace(path)  # a new inode: a change however fast it comes


def test_the_file_adds_to_the_flags_and_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "registries.toml"
    policy = PolicyFile(path, FLAGS)
    assert policy.current() == FLAGS  # no file yet: the flags alone
    _write(
        path,
        'insecure_registries = ["127.0.0.1:6000"]\ndefault_registry = "reg.test"\n'
        f'image_archive_dirs = ["{tmp_path}"]\n',
    )
    now = policy.current()
    assert now.insecure_registries == ("127.0.0.1:5000", "127.0.0.1:6000")
    assert now.default_registry == "reg.test" and now.image_archive_dirs == (tmp_path,)
    _write(path, "insecure_registries = []\n")
    assert policy.current() == FLAGS  # closed again


@pytest.mark.parametrize(
    "bad",
    [
        'insecure_registries = "one"\n',
        'insecure_registries = ["not a host"]\n',
        "surprise = 1\n",
        'image_archive_dirs = ["relative/dir"]\n',
        "not toml [",
    ],
)
def test_a_bad_edit_keeps_the_policy_in_force(
    tmp_path: Path, bad: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "registries.toml"
    _write(path, 'insecure_registries = ["127.0.0.1:6000"]\n')
    policy = PolicyFile(path, FLAGS)
    before = policy.current()
    _write(path, bad)
    with caplog.at_level(logging.ERROR):
        assert policy.current() == before
    assert "not applied" in caplog.text
    with pytest.raises(ValueError, match="--registry-policy"):
        PolicyFile(path, FLAGS).check()  # at the start, the same file stops the daemon


def test_sighup_reads_the_file_even_when_it_looks_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "registries.toml"
    _write(path, 'insecure_registries = ["127.0.0.1:6000"]\n')
    policy = PolicyFile(path, FLAGS)
    policy.current()
    st = path.stat()
    path.write_text('insecure_registries = ["127.0.0.1:7000"]\n')  # same size, maybe same mtime
    import os

    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    policy.reload_now()
    assert "127.0.0.1:7000" in policy.current().insecure_registries


def test_an_archive_directory_opened_at_runtime(
    client: TestClient, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_boot_parts(monkeypatch, tmp_path)
    images = client.app.state.services.images  # type: ignore[attr-defined]
    images._importer = images._import_sync  # the daemon's own importer: it checks the policy
    archive = oi.write_docker_archive(
        tmp_path / "app.tar", {"app:1": oi.image([oi.layer({"a": b"1"})], {})}
    )
    r = client.post("/v1/images", json={"ref": f"docker-archive:{archive}"})
    assert r.status_code == 400 and "forkd image load" in r.json()["error"]
    path = tmp_path / "registries.toml"
    settings.registry_policy = PolicyFile(path, settings.registries())
    _write(path, f'image_archive_dirs = ["{tmp_path}"]\n')
    r = client.post("/v1/images", json={"ref": f"docker-archive:{archive}"})
    assert r.status_code == 201, r.text


def test_a_file_others_could_change_is_not_applied(tmp_path: Path) -> None:
    path = tmp_path / "registries.toml"
    tmp_path.chmod(0o755)
    _write(path, 'insecure_registries = ["127.0.0.1:6000"]\n')
    path.chmod(0o666)  # anyone could open a registry, or a host directory, to clients
    with pytest.raises(ValueError, match="written by other users"):
        PolicyFile(path, FLAGS).check()
    assert PolicyFile(path, FLAGS).current() == FLAGS
    path.chmod(0o644)
    tmp_path.chmod(0o777)
    with pytest.raises(ValueError, match="its directory may be written"):
        PolicyFile(path, FLAGS).check()
    tmp_path.chmod(0o755)
    assert "127.0.0.1:6000" in PolicyFile(path, FLAGS).current().insecure_registries
