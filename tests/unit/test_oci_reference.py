"""OCI references and registry credentials: parsed and checked before any request."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from pathlib import Path

import httpx
import pytest

from forkd.errors import Invalid, UpstreamError
from forkd.oci import artifact, auth, reference
from forkd.oci import registry as registry_mod
from forkd.oci.registry import Registry


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("127.0.0.1:5000/forkd/py:v1", "127.0.0.1:5000", "forkd/py", "v1", None),
        ("ghcr.io/acme/snaps/py", "ghcr.io", "acme/snaps/py", None, None),
        ("localhost/py:latest", "localhost", "py", "latest", None),
        ("[::1]:5000/a/b:c", "[::1]:5000", "a/b", "c", None),
        ("acme/py:v2", reference.DOCKER_HUB, "acme/py", "v2", None),
        ("py", reference.DOCKER_HUB, "library/py", None, None),
        ("r.io/a_b/c-d.e:t@sha256:" + "a" * 64, "r.io", "a_b/c-d.e", "t", "sha256:" + "a" * 64),
    ],
)
def test_valid_references(text: str, registry: str, repository: str, tag, digest) -> None:
    ref = reference.parse(text, default_registry=reference.DOCKER_HUB)
    want = (registry, repository, tag, digest)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == want
    assert ref.reference == (digest or tag or "latest")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Bad Ref",
        "http://r.io/a:b",
        "r.io/UPPER:tag",
        "r.io/a:bad tag",
        "r.io/a:" + "t" * 129,
        "r.io/a@sha256:short",
        "r.io/a@md5:" + "a" * 32,
        "r.io:99999/a:b",
        "r.io/a//b",
        "r.io/-a",
        "r.io/a:b:c",
        "x" * 600,
    ],
)
def test_invalid_references_are_400(text: str) -> None:
    with pytest.raises(Invalid):
        reference.parse(text)


def test_a_reference_without_a_registry_host_needs_a_default() -> None:
    for text in ("0", "py", "acme/py:v2", "py@sha256:" + "a" * 64):
        with pytest.raises(reference.NoRegistry, match="names no registry host"):
            reference.parse(text)
    assert reference.parse("acme/py", "127.0.0.1:5000") == reference.Reference(
        "127.0.0.1:5000", "acme/py"
    )
    assert reference.parse("py", "127.0.0.1:5000").repository == "py"  # library/: Hub only


def test_docker_config_credentials(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "auths": {
                    "https://r.io": {"auth": base64.b64encode(b"ann:s3cret").decode()},
                    "127.0.0.1:5000": {"username": "bob", "password": "pw"},
                    "tok.io": {"identitytoken": "refresh-me"},
                    "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw").decode()},
                    "broken.io": {"auth": "!!!"},
                }
            }
        )
    )
    assert auth.from_docker_config("r.io", config) == auth.Credentials("ann", "s3cret")
    assert auth.from_docker_config("127.0.0.1:5000", config) == auth.Credentials("bob", "pw")
    assert auth.from_docker_config("tok.io", config) == auth.Credentials(None, None, "refresh-me")
    assert auth.from_docker_config(reference.DOCKER_HUB, config) == auth.Credentials("hub", "pw")
    assert auth.from_docker_config("broken.io", config) is None
    assert auth.from_docker_config("other.io", config) is None
    assert auth.from_docker_config("r.io", tmp_path / "missing.json") is None


def test_challenge_parsing() -> None:
    scheme, params = auth.parse_challenge(
        'Bearer realm="https://auth.r.io/token",service="r.io",scope="repository:a:pull,push"'
    )
    assert scheme == "bearer"
    assert params == {
        "realm": "https://auth.r.io/token",
        "service": "r.io",
        "scope": "repository:a:pull,push",
    }


def _token_registry(seen: list[httpx.Request]) -> httpx.MockTransport:
    """A registry that wants a bearer token from its realm, which wants Basic credentials."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "auth.r.io":
            if (
                request.headers.get("Authorization")
                != "Basic " + base64.b64encode(b"ann:pw").decode()
            ):
                return httpx.Response(401)
            return httpx.Response(200, json={"token": "T0K"})
        if request.headers.get("Authorization") == "Bearer T0K":
            return httpx.Response(200, json={})
        challenge = (
            'Bearer realm="https://auth.r.io/token",service="r.io",scope="repository:a:pull"'
        )
        return httpx.Response(401, headers={"WWW-Authenticate": challenge})

    return httpx.MockTransport(handle)


def test_bearer_challenge_is_answered_once_and_remembered() -> None:
    seen: list[httpx.Request] = []
    flow = auth.RegistryAuth(auth.Credentials("ann", "pw"))
    with httpx.Client(transport=_token_registry(seen), auth=flow) as client:
        assert client.get("https://r.io/v2/a/manifests/x").status_code == 200
        assert [r.url.host for r in seen] == ["r.io", "auth.r.io", "r.io"]
        assert seen[1].url.params["scope"] == "repository:a:pull"
        seen.clear()
        assert client.get("https://r.io/v2/a/manifests/y").status_code == 200
        assert len(seen) == 1  # the token is kept


def test_wrong_credentials_leave_the_401() -> None:
    seen: list[httpx.Request] = []
    flow = auth.RegistryAuth(auth.Credentials("ann", "wrong"))
    with httpx.Client(transport=_token_registry(seen), auth=flow) as client:
        assert client.get("https://r.io/v2/a/manifests/x").status_code == 401


def test_a_plain_http_realm_gets_no_password_from_a_tls_registry() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(401, headers={"WWW-Authenticate": 'Bearer realm="http://evil/t"'})

    flow = auth.RegistryAuth(auth.Credentials("ann", "pw"))
    with httpx.Client(transport=httpx.MockTransport(handle), auth=flow) as client:
        assert client.get("https://r.io/v2/").status_code == 401
    assert [r.url.host for r in seen] == ["r.io"]


def _hostile(handle) -> Registry:
    ref = reference.parse("r.io/forkd/x:v1")
    return Registry(
        ref, credentials=auth.Credentials(bearer="T0K"), transport=httpx.MockTransport(handle)
    )


def test_a_compressed_answer_is_never_inflated() -> None:
    import gzip

    bomb = gzip.compress(bytes(200 << 20))  # 200 MiB of zeroes in ~200 KiB

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.headers["Accept-Encoding"] == "identity"
        raw = httpx.ByteStream(bomb)  # streamed, as from the network
        return httpx.Response(200, headers={"Content-Encoding": "gzip"}, stream=raw)

    with _hostile(handle) as reg, pytest.raises(UpstreamError, match="not a forkd snapshot"):
        body, _ = reg.get_manifest("v1")
        artifact.parse_manifest(body, "x")  # the raw gzip bytes: not JSON


def test_an_upload_sent_elsewhere_gets_no_credentials() -> None:
    seen: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.url.scheme}://{request.url.host}")
        return httpx.Response(202, headers={"Location": "http://collector.example/up"})

    with _hostile(handle) as reg, pytest.raises(UpstreamError, match="another origin"):
        reg.put_blob(b"x", "sha256:" + "0" * 64)
    assert seen == ["https://r.io"]


class _UploadTarget(httpx.BaseTransport):
    """A registry that takes an upload's body piece by piece, ``pause`` s a piece
    (httpx's MockTransport reads a body whole before its handler sees it)."""

    def __init__(self, pause: float = 0.0) -> None:
        self.pause = pause
        self.bodies: list[tuple[bytes, httpx.Headers]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            return httpx.Response(202, headers={"Location": "/v2/forkd/x/blobs/uploads/u1"})
        body = bytearray()
        for piece in request.stream:  # type: ignore[union-attr]
            time.sleep(self.pause)
            body += piece
        self.bodies.append((bytes(body), request.headers))
        return httpx.Response(201)


def _uploading_to(target: _UploadTarget) -> Registry:
    ref = reference.parse("r.io/forkd/x:v1")
    return Registry(ref, credentials=auth.Credentials(bearer="T0K"), transport=target)


def test_an_upload_goes_whole_with_its_length() -> None:
    target = _UploadTarget()
    blob = bytes(range(256)) * 5000  # 1.2 MiB: several pieces
    with _uploading_to(target) as reg:
        reg.put_blob(blob, "sha256:" + hashlib.sha256(blob).hexdigest())
    [(body, headers)] = target.bodies
    assert body == blob
    assert headers["Content-Length"] == str(len(blob)) and "Transfer-Encoding" not in headers


def test_an_upload_the_registry_takes_too_slowly_is_given_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each piece is taken well within any per-write timeout, but the whole upload
    # passes its deadline: the transfer is given up, not held for as long as the
    # registry likes. (Deadline here: 0.1 s + 64 KiB at 1 s a MiB.)
    monkeypatch.setattr(registry_mod, "BLOB_DEADLINE_SECS", 0.1)
    monkeypatch.setattr(registry_mod, "UPLOAD_PIECE_BYTES", 4096)
    target = _UploadTarget(pause=0.03)
    started = time.monotonic()
    with (
        _uploading_to(target) as reg,
        pytest.raises(UpstreamError, match="too slow taking blob"),
    ):
        reg.put_blob(bytes(64 << 10), "sha256:" + "0" * 64)  # 16 pieces: 0.48 s
    assert target.bodies == []  # the PUT never completed
    assert time.monotonic() - started < 0.45


def test_a_redirect_drops_credentials_and_never_goes_down_to_http() -> None:
    seen: list[tuple[str, str | None]] = []
    blob = b"content"
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("Authorization")))
        if request.url.host == "r.io":
            return httpx.Response(307, headers={"Location": "https://storage.example/b"})
        if request.url.host == "storage.example":
            return httpx.Response(200, content=blob)
        return httpx.Response(404)

    with _hostile(handle) as reg:
        assert reg.get_blob(digest, len(blob)) == blob
    assert seen[0][1] == "Bearer T0K" and seen[1] == ("https://storage.example/b", None)

    def downgrade(request: httpx.Request) -> httpx.Response:
        return httpx.Response(307, headers={"Location": "http://storage.example/b"})

    with (
        _hostile(downgrade) as reg,
        pytest.raises(UpstreamError, match="from HTTPS to another scheme"),
    ):
        reg.get_blob(digest, len(blob))


def test_an_error_answer_is_told_by_its_status_and_the_specs_codes_only() -> None:
    marker = "SECRET-5c1e"
    errors = [
        {"code": "MANIFEST_INVALID", "message": marker},
        {"code": marker},
        {"code": "DENIED", "detail": marker},
    ]

    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"errors": errors}, headers={"X-Note": marker})

    with _hostile(handle) as reg, pytest.raises(UpstreamError) as exc:
        reg.put_manifest(b"{}", "v1")
    assert str(exc.value) == (
        "registry r.io answered 500 Internal Server Error (MANIFEST_INVALID, DENIED) "
        "to PUT manifest v1 in forkd/x"
    )

    def not_json(request: httpx.Request) -> httpx.Response:
        return httpx.Response(599, text=marker, headers={"Content-Type": marker})

    with _hostile(not_json) as reg, pytest.raises(UpstreamError) as exc:
        reg.get_manifest("v1")
    assert str(exc.value) == "registry r.io answered 599 to GET manifest v1 in forkd/x"


OTHER_INDEX = "application/vnd.oci.image.index.v1+json"


def test_a_manifest_of_another_kind_is_named_by_forkd_not_by_the_registry() -> None:
    marker = "SECRET-9d2b"

    def handle(request: httpx.Request) -> httpx.Response:
        kind = marker if "odd" in request.url.path else OTHER_INDEX
        return httpx.Response(200, content=b"{}", headers={"Content-Type": kind})

    with _hostile(handle) as reg:
        with pytest.raises(UpstreamError, match="is an OCI image index, not a forkd snapshot"):
            reg.get_manifest("v1")
        with pytest.raises(UpstreamError) as exc:
            reg.get_manifest("odd")
    assert marker not in str(exc.value) and "of another media type" in str(exc.value)
    bad = {"schemaVersion": 2, "config": {"mediaType": marker}, "layers": []}
    with pytest.raises(UpstreamError) as exc:
        artifact.parse_manifest(json.dumps(bad).encode(), "r.io/forkd/x:v1")
    assert marker not in str(exc.value)
    bad = {
        "schemaVersion": 2,
        "config": {
            "mediaType": artifact.CONFIG_TYPE,
            "digest": "sha256:" + "a" * 64,
            "size": marker,
        },
        "layers": [],
    }
    with pytest.raises(UpstreamError) as exc:
        artifact.parse_manifest(json.dumps(bad).encode(), "r.io/forkd/x:v1")
    assert marker not in str(exc.value) and "malformed manifest (ValueError)" in str(exc.value)
