"""The ``image.json`` of an image pulled with a snapshot: what another host's build said of
itself, as a registry handed it over, checked before this host reads it.

A pulled image's record is hostile input that the daemon reads later, long after the
pull: ``GET /v1/images`` lists it, a container image's config is given to templates,
its layer digests name files in the blob cache. So every field forkd reads is checked
here to be what a build or an import of this forkd writes (types, digests, bounded
counts and lengths), and a container image keeps only those fields. A record that
fails is refused with the pull, before anything is written.
"""

from __future__ import annotations

import re
from typing import Any

from forkd.guest import container_image
from forkd.image_import.model import ImageConfig

DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
MAX_STRINGS = 4096  # entries of a config's Env, Cmd, Entrypoint, ExposedPorts, Labels
MAX_STRING = 64 << 10
MAX_LAYERS = 256  # as an import takes at most
MAX_REFERENCES = 64
# What a container image's record keeps beside its config (image.json of an import).
_CONTAINER_TEXT = ("reference", "kernel_package", "kernel_release")
_CONTAINER_NUMBERS = ("builder_version", "built_at_unix", "build_secs")


class PulledImageInvalid(ValueError):
    """A pulled image's record is not one forkd writes (the message is forkd's own words,
    never the record's text)."""


def checked(meta: Any) -> dict[str, Any]:
    """A copy of ``meta`` fit to be a pulled image's ``image.json`` (without its name and
    key, which the caller sets); :class:`PulledImageInvalid` when it is not."""
    if not isinstance(meta, dict):
        raise PulledImageInvalid("its image record is not an object")
    if meta.get("kind") == container_image.KIND:
        return _container(meta)
    if "kind" in meta:
        raise PulledImageInvalid("its image is of a kind this forkd does not know")
    out = dict(meta)
    out["built_at_unix"] = _number(meta.get("built_at_unix", 0), "its build time")
    if not isinstance(out.get("template", {}), dict):
        raise PulledImageInvalid("its image's template settings are not an object")
    return out


def _container(meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": container_image.KIND, "template": {}}
    for key in ("manifest_digest", "config_digest"):
        out[key] = _digest(meta.get(key), f"its image's {key}")
    layers = meta.get("layers")
    if not isinstance(layers, list) or len(layers) > MAX_LAYERS:
        raise PulledImageInvalid(f"its image's layers are not a list of at most {MAX_LAYERS}")
    out["layers"] = [_digest(d, "a layer of its image") for d in layers]
    diff_ids = meta.get("diff_ids", [])
    if not isinstance(diff_ids, list) or len(diff_ids) > MAX_LAYERS:
        raise PulledImageInvalid(f"its image's diff_ids are not a list of at most {MAX_LAYERS}")
    if diff_ids:
        out["diff_ids"] = [_digest(d, "a layer's diff_id of its image") for d in diff_ids]
    references = meta.get("references") or []
    if not isinstance(references, list) or len(references) > MAX_REFERENCES:
        raise PulledImageInvalid("its image's references are not a short list")
    out["references"] = [_text(r, "a reference of its image") for r in references]
    for key in _CONTAINER_TEXT:
        if key in meta:
            out[key] = _text(meta[key], f"its image's {key}")
    for key in _CONTAINER_NUMBERS:
        if key in meta:
            out[key] = _number(meta[key], f"its image's {key}")
    out["config"] = _config(meta.get("config"))
    return out


def _config(raw: Any) -> dict[str, Any]:
    """A container image's config, as :meth:`ImageConfig.to_json` writes it."""
    if not isinstance(raw, dict):
        raise PulledImageInvalid("its image's config is not an object")
    labels = raw.get("labels") or {}
    if not isinstance(labels, dict) or len(labels) > MAX_STRINGS:
        raise PulledImageInvalid("its image's labels are not a small object")
    config = ImageConfig(
        env=_strings(raw.get("env"), "Env"),
        working_dir=_text(raw.get("working_dir") or "", "its image's WorkingDir"),
        user=_text(raw.get("user") or "", "its image's User"),
        entrypoint=_strings(raw.get("entrypoint"), "Entrypoint"),
        cmd=_strings(raw.get("cmd"), "Cmd"),
        exposed_ports=_strings(raw.get("exposed_ports"), "ExposedPorts"),
        labels={_text(k, "a label"): _text(v, "a label") for k, v in labels.items()},
        stop_signal=_text(raw.get("stop_signal") or "", "its image's StopSignal"),
    )
    return config.to_json()


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_STRINGS:
        raise PulledImageInvalid(f"its image's {what} is not a list of at most {MAX_STRINGS}")
    return tuple(_text(v, f"its image's {what}") for v in value)


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_STRING or "\0" in value:
        raise PulledImageInvalid(f"{what} is not a string of at most {MAX_STRING} characters")
    return value


def _digest(value: Any, what: str) -> str:
    if not isinstance(value, str) or not DIGEST.fullmatch(value):
        raise PulledImageInvalid(f"{what} is not a sha256 digest")
    return value


def _number(value: Any, what: str) -> int | float:
    if type(value) not in (int, float) or not 0 <= value < 1 << 53:
        raise PulledImageInvalid(f"{what} is not a number")
    number: int | float = value
    return number
