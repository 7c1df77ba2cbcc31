"""Recipe files: what is accepted, and clear errors for what is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.errors import ImageError
from forkd.guest import recipe, rootfs


def _write(d: Path, text: str) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "recipe.toml").write_text(text)
    return d


def test_full_recipe_is_read(tmp_path: Path) -> None:
    d = _write(
        tmp_path / "r",
        """
name = "demo"
description = "a test"
[image]
packages = ["ripgrep"]
pip = ["requests==2.32.3"]
run = ["echo hi > /etc/motd"]
[image.files]
"files/app.py" = "/opt/app/app.py"
[template]
memory_mib = 256
setup = ["true"]
warmup = "import json"
""",
    )
    (d / "files").mkdir()
    (d / "files" / "app.py").write_text("print('app')\n")
    r = recipe.load(d)
    assert r.name == "demo" and r.pip == ("requests==2.32.3",)
    assert r.apt_packages() == ["python3", "python3-pip", "ripgrep"]
    assert r.files == (((d / "files" / "app.py").resolve(), "/opt/app/app.py"),)
    assert r.template["memory_mib"] == 256
    key = r.base_key("minbase")
    (d / "files" / "app.py").write_text("print('changed')\n")
    assert recipe.load(d).base_key("minbase") != key  # file contents are part of the key
    script = rootfs._build_script(r, host_ca=True)
    assert "pip install" in script and " requests==2.32.3" in script
    assert "echo hi > /etc/motd" in script


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('name = "../x"', "'name' must match"),
        ('name = "ok"\nbogus = 1', "unknown keys"),
        ('name = "ok"\n[image]\npackages = ["Bad Name"]', "not a Debian package"),
        ('name = "ok"\n[image]\npip = ["x; rm -rf /"]', "not a pip requirement"),
        ('name = "ok"\n[image.files]\n"../../etc/passwd" = "/x"', "not a file inside"),
        ('name = "ok"\n[template]\nmemory_mib = "big"', "must be an integer"),
        ('name = "ok"\n[template]\nreboot = true', "[template] takes only"),
        ("not toml [", "unreadable"),
    ],
)
def test_bad_recipes_are_refused_with_the_reason(tmp_path: Path, text: str, error: str) -> None:
    d = _write(tmp_path / "r", text)
    with pytest.raises(ImageError, match=error.replace("[", r"\[")):
        recipe.load(d)


def test_builtins() -> None:
    assert {"python", "python-data", "postgres"} <= set(recipe.builtin_names())
    assert "numpy" in recipe.builtin("python-data").pip
    assert "postgresql" in recipe.builtin("postgres").packages
    with pytest.raises(ImageError, match="unknown image 'nope'"):
        recipe.builtin("nope")


def test_image_rm_refuses_while_a_snapshot_uses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    from forkd.guest import image

    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    build = tmp_path / "cache" / "images" / "demo-abc"
    build.mkdir(parents=True)
    (build / "image.json").write_text(json.dumps({"name": "demo", "key": "abc"}))
    snaps = tmp_path / "snaps"
    (snaps / "s1").mkdir(parents=True)
    (snaps / "s1" / "snapshot.json").write_text(json.dumps({"image": {"dir": str(build)}}))
    with pytest.raises(ImageError, match=r"image in use, nothing removed.*snapshot s1"):
        image.remove("demo", [snaps])
    assert build.is_dir()
    (snaps / "s1" / "snapshot.json").unlink()
    assert image.remove("demo", [snaps]) == [build]
    assert not build.exists()
