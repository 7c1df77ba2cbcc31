"""Fuzzing the HTTP API: every route of docs/openapi.json, against the real app, leaves nothing.

schemathesis generates requests from the contract, valid and invalid, and
sends them to the real app under a real uvicorn on loopback, over the fake VM
driver (tests/unit/fakes.py), with the daemon's bearer token. Path parameters,
bodies and queries are pointed at things that exist most of the time (a
snapshot, a running sandbox, a volume), so the fuzz reaches the services and
not only the 404s. Every answer must be documented (status, content type,
body schema); none may be a 5xx; every error body is ``{"error": str}``. After
the run, nothing is leaked: no VM alive that the daemon does not hold, none
left after it stops, no staging directory, no volume layer no one uses.

Bounded to run in well under a minute on two cores: ``EXAMPLES`` fuzzed
requests per route, plus schemathesis's coverage cases (boundary values of
each parameter). docs/RUNBOOK.md, "Fuzzing the API", says how to run more.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import tarfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.parameters import ParameterLocation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from forkd.controller.app import create_app
from forkd.controller.services.hibernated_files import HibernatedFiles
from forkd.controller.settings import Settings
from forkd.errors import ForkdError
from forkd.guest.recipe import NAME_RE
from forkd.launcher import free_port
from forkd.oci.reference import DIGEST
from forkd.vmm.jail import network
from forkd.vmm.snapshot import files as snapshot_files
from forkd.vmm.volumes.disks import parse_size
from tests.registry_server import RegistryServer
from tests.unit.conftest import TOKEN, serving
from tests.unit.fakes import FakeDriver, FakeVM, make_image

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
EXAMPLES = int(os.environ.get("FORKD_FUZZ_EXAMPLES", "50"))  # fuzzed requests per route
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# Checks of each answer: no 5xx; status, content type and body as the contract
# documents; a request the contract calls invalid is refused. Not
# positive_data_acceptance: the contract leaves name patterns off path
# parameters, so a valid-looking tag like "é" gets its documented 400.


def invalid_data_refused(ctx: Any, response: Any, case: Any) -> bool | None:
    """negative_data_rejection, with 413 counted as a refusal: a generated body over a
    route's size limit is refused for its size before its content is read."""
    if response.status_code == 413:
        return None
    return negative_data_rejection(ctx, response, case)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    invalid_data_refused,
]
MAX_SANDBOXES = 8  # the daemon's cap: forks past it answer 429
# The fuzzed daemon's directories (state, cache): no answer may name a path in them.
HOST_ROOTS: list[str] = []
STREAM_READ_SECS = 1.0  # how long an event stream is read before the fuzz moves on
WORK_SECS = 900.0  # a request that does real work: a template build, an import, a fork
SPARES_KEPT = 3  # fuzzed forks beyond this are deleted again, so forks keep being admitted

_SPEC = json.loads(CONTRACT.read_text())


def fuzz_schema(phase: str, mode: str = "all") -> Any:
    """The contract for schemathesis, with only ``phase`` of its phases on, generating
    requests that are valid (``mode`` "positive"), invalid ("negative") or both."""
    phases = {p: {"enabled": p == phase} for p in ("examples", "coverage", "fuzzing", "stateful")}
    config = schemathesis.Config.from_dict({"phases": phases, "generation": {"mode": mode}})
    loaded = schemathesis.openapi.from_dict(_SPEC, config=config)
    return loaded


# Random requests, valid and not, most pointed at things that exist (steer).
schema = fuzz_schema("fuzzing")
# Each parameter's boundary and just-past-boundary values, one request each, as generated.
boundaries = fuzz_schema("coverage")


# ------------------------------------------------------------------ volume archives

_NAMES = st.one_of(
    st.sampled_from(["a.txt", "d/", "d/b", "../up", "/abs", "./x", "a/../../up", ".", "x" * 200]),
    st.text(
        st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"),
        min_size=1,
        max_size=24,
    ),
)
# POST /v1/volumes answers 500 to a hard link whose target the archive lacks
# (test_a_hard_link_to_a_missing_member_is_refused); until that is fixed the
# fuzz makes hard links only to members it wrote before.
HARD_LINK_BUG_OPEN = False
_TYPES = (
    tarfile.REGTYPE,
    tarfile.DIRTYPE,
    tarfile.SYMTYPE,
    tarfile.LNKTYPE,
    tarfile.FIFOTYPE,
    tarfile.CHRTYPE,
)


@st.composite
def _archives(draw: st.DrawFn) -> bytes:
    """A small tar archive with hostile names and member types, maybe gzipped or cut short."""
    buf = io.BytesIO()
    fmt = draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]))
    files: list[str] = []  # regular files so far
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for _ in range(draw(st.integers(0, 4))):
            info = tarfile.TarInfo(draw(_NAMES))
            info.type = draw(st.sampled_from(_TYPES))
            info.mode = draw(st.integers(0, 0o7777))
            data = draw(st.binary(max_size=64)) if info.type == tarfile.REGTYPE else b""
            info.size = len(data)
            if info.type == tarfile.SYMTYPE:
                info.linkname = draw(_NAMES)
            elif info.type == tarfile.LNKTYPE:
                if HARD_LINK_BUG_OPEN and not files:
                    continue  # no hard link to a member the archive lacks, yet
                info.linkname = draw(st.sampled_from(files) if HARD_LINK_BUG_OPEN else _NAMES)
            if info.type == tarfile.REGTYPE:
                files.append(info.name)
            tar.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    raw = raw[: draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw
    return gzip.compress(raw) if draw(st.booleans()) else raw


schemathesis.openapi.media_type(
    "application/x-tar", st.one_of(_archives(), st.binary(max_size=256))
)


# ------------------------------------------------------------------ what exists


@dataclass
class Known:
    """What exists in the fuzzed daemon, so fuzzed requests can name it.

    ``base`` and ``sandbox`` stay for the whole run (the guest routes and the
    forks need them); the rest may be deleted by a fuzzed DELETE.
    """

    base: str = "fuzz-base"
    sandbox: str = ""
    volume: str = "fuzz-vol"
    spare_sandboxes: list[str] = field(default_factory=list)
    spare_tags: list[str] = field(default_factory=list)
    spare_volumes: list[str] = field(default_factory=list)
    guest_paths: tuple[str, ...] = ("/work/a.txt", "/work", "/", "/nonexistent/x")

    def for_param(self, method: str, name: str) -> list[str]:
        deleting = method == "DELETE"
        if name == "sandbox_id":
            return self.spare_sandboxes if deleting else [self.sandbox, *self.spare_sandboxes]
        if name == "tag":
            return self.spare_tags if deleting else [self.base, *self.spare_tags]
        if name == "name":
            return self.spare_volumes if deleting else [self.volume, *self.spare_volumes]
        return []

    def note(self, method: str, path: str, params: dict[str, Any], status: int, body: Any) -> None:
        """Keep track of what a fuzzed request made or deleted."""
        if status == 201 and path == "/v1/sandboxes":
            self.spare_sandboxes += [sb["id"] for sb in body]
        elif status == 201 and path in ("/v1/snapshots", "/v1/sandboxes/{sandbox_id}/branch"):
            self.spare_tags.append(body["tag"])
        elif status == 201 and path == "/v1/volumes":
            self.spare_volumes.append(body["name"])
        elif status == 204 and method == "DELETE":
            for spares in (self.spare_sandboxes, self.spare_tags, self.spare_volumes):
                for value in params.values():
                    if value in spares:
                        spares.remove(value)


KNOWN = Known()
# Policies a steered fork asks for: the contract's forms, no hostname (nothing is resolved).
EGRESS = (None, "none", "internet", {"allow": ["10.1.0.0/16", "192.0.2.7"]})


NOT_LISTED = "127.0.0.1:1"  # on loopback, not listed: refused (400), never contacted
REPOSITORIES = ("fuzz/a", "fuzz/b", "fuzz/c")  # few: pulls find what pushes sent


def registry_ref(text: str, registry: str) -> str:
    """A reference made of a fuzzed ``text``: one of :data:`REPOSITORIES` of
    ``registry`` (a registry on loopback that the daemon lists), one time in eight of
    :data:`NOT_LISTED`; mostly tag ``latest`` (so pulls find pushes), else the fuzzed
    tag, and the fuzzed digest, when well-formed. Never a name that resolves off this
    machine (the references' grammar has its own tests)."""
    name, at, digest = text.partition("@")
    tag = name.rpartition(":")[2] if ":" in name.rpartition("/")[2] else ""
    tag = "".join(c for c in tag if c.isascii() and (c.isalnum() or c in "._-"))[:128]
    key = hashlib.sha256(text.encode(errors="replace")).digest()
    host = NOT_LISTED if key[0] % 8 == 0 else registry
    ref = f"{host}/{REPOSITORIES[key[1] % len(REPOSITORIES)]}"
    ref += f":{tag}" if tag[:1].isalnum() and key[2] % 4 == 0 else ":latest"
    return ref + (f"@{digest}" if at and DIGEST.fullmatch(digest) else "")


def steer(case: Any, data: st.DataObject, known: Known) -> None:
    """Most of the time, point a valid part of ``case`` at something that exists.

    A snapshot, sandbox or volume that exists; a guest path that exists; a
    fork of the built template with n of 1 or 2 and a well-formed egress
    policy; a template of the built image. Only parts generated valid are
    steered, and each stays valid, so a request schemathesis made invalid
    stays invalid. Volume sizes are capped at 16 MiB: formatting a big image
    takes seconds.
    """
    op, meta = case.operation, case.meta
    method = op.method.upper()

    def valid(where: ParameterLocation) -> bool:
        return meta is not None and not meta.is_negative_at(where)

    def steer(where: ParameterLocation) -> bool:  # 3 is "leave it": Hypothesis favours 0
        return valid(where) and data.draw(st.integers(0, 3), label=where.value) < 3

    params = case.path_parameters
    if isinstance(params, dict) and len(params) == 1 and steer(ParameterLocation.PATH):
        (name,) = params
        # Drawn whatever exists now: the same draws each time, as Hypothesis requires.
        pick = data.draw(st.integers(0, 63), label=name)
        names = known.for_param(method, name)
        if names:
            case.path_parameters = {name: names[pick % len(names)]}
    query = case.query
    if isinstance(query, dict) and valid(ParameterLocation.QUERY):
        if op.path == "/v1/volumes" and method == "POST":
            with contextlib.suppress(ForkdError):  # unreadable: the daemon's 400 is the point
                if parse_size(query.get("size", "1G")) > 64 << 20:
                    case.query = query = {**query, "size": "16M"}
            if steer(ParameterLocation.QUERY):
                size = data.draw(st.sampled_from(["16M", "20m", "16777216"]), label="size")
                case.query = {**query, "size": size}
        elif "path" in query and steer(ParameterLocation.QUERY):
            case.query = {**query, "path": data.draw(st.sampled_from(known.guest_paths))}
    body = case.body
    body = case.body
    if isinstance(body, dict) and method == "POST" and steer(ParameterLocation.BODY):
        if op.path == "/v1/sandboxes":
            n = data.draw(st.integers(1, 2), label="n")
            egress = data.draw(st.sampled_from(EGRESS), label="egress")
            plain = {k: v for k, v in body.items() if k not in ("egress", "internet")}
            case.body = {**plain, "snapshot_tag": known.base, "n": n, "egress": egress}
        elif op.path == "/v1/snapshots":
            plain = {k: v for k, v in body.items() if k not in ("kernel", "rootfs", "image")}
            if data.draw(st.booleans(), label="with a volume"):
                plain["volumes"] = [{"name": known.volume, "path": "/data"}]
            case.body = plain


# ------------------------------------------------------------------ the daemon


async def _inert_exec(self: FakeVM, argv: list[str], **_: Any) -> dict[str, Any]:
    self._agent("exec")
    return {"stdout": "", "stderr": "", "exit_code": 0, "timed_out": False, "duration_ms": 1.0}


async def _inert_eval(
    self: FakeVM,
    code: str,
    timeout: float = 60.0,
    tag: str | None = None,
    context: str | None = None,
) -> dict[str, Any]:
    self._agent("eval")  # the fake's own eval runs the code in this process: not fuzzed text
    return {"result": repr(len(code)), "error": None, "exit_code": 0, "stdout": "", "stderr": ""}


@dataclass
class FuzzedDaemon:
    url: str
    client: httpx.Client  # for the test's own requests, not fuzzed
    app: Any
    driver: FakeDriver
    settings: Settings
    registry: str  # host:port of the test's registry, listed with --insecure-registry
    stop: Any  # stops the server once (its lifespan kills every VM: kill_on_exit)
    counts: Counter[str] = field(default_factory=Counter)  # requests per operation
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    started: float = field(default_factory=time.monotonic)


def _seed(c: httpx.Client) -> None:
    """A template, a sandbox with a file, spares to delete, a volume and a template using it."""

    def ok(r: httpx.Response, status: int) -> Any:
        assert r.status_code == status, (r.request.url, r.text)
        return r.json() if r.content else None

    ok(c.post("/v1/volumes", params={"name": KNOWN.volume, "size": "16M"}), 201)
    ok(c.post("/v1/volumes", params={"name": "fuzz-spare-vol", "size": "16M"}), 201)
    KNOWN.spare_volumes.append("fuzz-spare-vol")
    ok(c.post("/v1/snapshots", json={"tag": KNOWN.base}), 201)
    vol = {"tag": "fuzz-with-vol", "volumes": [{"name": KNOWN.volume, "path": "/data"}]}
    KNOWN.spare_tags.append(ok(c.post("/v1/snapshots", json=vol), 201)["tag"])
    sandboxes = ok(c.post("/v1/sandboxes", json={"snapshot_tag": KNOWN.base, "n": 3}), 201)
    KNOWN.sandbox = sandboxes[0]["id"]
    KNOWN.spare_sandboxes += [sb["id"] for sb in sandboxes[1:]]
    files = f"/v1/sandboxes/{KNOWN.sandbox}/files"
    ok(c.put(files, params={"path": "/work/a.txt"}, content=b"seed\n"), 200)
    KNOWN.spare_tags.append(
        ok(c.post(f"/v1/sandboxes/{KNOWN.sandbox}/branch", json={}), 201)["tag"]
    )


@pytest.fixture(scope="module")
def registry() -> Iterator[RegistryServer]:
    """A real registry on loopback for push and pull (Debian's docker-registry)."""
    server = RegistryServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fuzzed(
    tmp_path_factory: pytest.TempPathFactory, registry: RegistryServer
) -> Iterator[FuzzedDaemon]:
    tmp = tmp_path_factory.mktemp("fuzz")
    HOST_ROOTS[:] = [str(tmp), os.path.realpath(tmp)]
    with pytest.MonkeyPatch.context() as mp:
        make_image(tmp / "cache")
        mp.setenv("FORKD_CACHE_DIR", str(tmp / "cache"))
        mp.setenv("FORKD_STATE_DIR", str(tmp / "client-state"))
        # A host with namespaces, whatever this one has: per_child_netns is then
        # accepted (the fake driver makes none), as on the hosts forkd serves.
        mp.setattr(network, "netns_problems", lambda: [])
        mp.setattr(FakeVM, "exec", _inert_exec)
        mp.setattr(FakeVM, "eval", _inert_eval)
        state = tmp / "state"
        cfg = Settings(
            state_dir=state,
            snapshot_root=state / "snapshots",
            run_dir=state / "run",
            pool_size=1,
            kill_on_exit=True,
            max_sandboxes=MAX_SANDBOXES,
            max_guest_memory_mib=16 << 10,
            insecure_registries=(registry.address,),
        )
        driver = FakeDriver()
        app = create_app(cfg, TOKEN, driver=driver)
        port = free_port()
        server = serving(app, host="127.0.0.1", port=port)
        server.__enter__()
        stopped = False

        def stop() -> None:
            nonlocal stopped
            if not stopped:
                stopped = True
                server.__exit__(None, None, None)

        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(base_url=url, headers=AUTH, timeout=30) as client:
                _seed(client)
                yield FuzzedDaemon(url, client, app, driver, cfg, registry.address, stop)
        finally:
            stop()


def _housekeep(d: FuzzedDaemon) -> None:
    """Delete the oldest fuzzed forks beyond ``SPARES_KEPT``: forks keep being admitted."""
    while len(KNOWN.spare_sandboxes) > SPARES_KEPT:
        sid = KNOWN.spare_sandboxes.pop(0)
        r = d.client.delete(f"/v1/sandboxes/{sid}")
        assert r.status_code in (204, 404), r.text


def check_error_body(response: Any) -> None:
    """Every error answer is ``{"error": message}`` and nothing else."""
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        raise AssertionError(
            f"{response.status_code} answer is not JSON: {response.text!r}"
        ) from None
    assert isinstance(body, dict) and set(body) == {"error"}, body
    assert isinstance(body["error"], str) and body["error"], body
    for root in HOST_ROOTS:  # errors name the entry and the reason, never the daemon's layout
        assert root not in body["error"], body


def call_and_check(case: Any, url: str, token: str = TOKEN) -> Any:
    """Send ``case`` with ``token``; fail on a 5xx, an undocumented answer or a bad error body."""
    auth = {"Authorization": f"Bearer {token}"}
    # An event stream never ends: schemathesis reads one until the request's timeout
    # (10 s by default), which made GET /v1/events most of this module's minutes. Its
    # head and first events come at once; a second is plenty.
    # Every other request gets a timeout that fits real work (a template build under TCG
    # takes 10-13 s, past schemathesis's default): the test never depends on host speed,
    # and the daemon's own limits bound each route.
    events = case.operation.path == "/v1/events"
    wait = {"timeout": STREAM_READ_SECS if events else WORK_SECS}
    response = case.call_and_validate(base_url=url, headers=auth, checks=CHECKS, **wait)
    check_error_body(response)
    assert response.status_code != 401, "the token was refused"
    return response


# ------------------------------------------------------------------ the fuzz


@schema.parametrize()
@schema.given(data=st.data())
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,  # no failing examples kept in the working tree: each run draws afresh
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)
def test_every_route_answers_as_documented_without_a_server_error(
    case: Any, data: st.DataObject, fuzzed: FuzzedDaemon
) -> None:
    steer(case, data, KNOWN)
    _record(fuzzed, case)


def _record(fuzzed: FuzzedDaemon, case: Any) -> None:
    """Send ``case``, check the answer, note what it made or deleted."""
    if isinstance(case.body, dict) and isinstance(case.body.get("ref"), str):
        # Push, pull and image imports reach the registry a reference names: the test's
        # own, or one on loopback the daemon does not list.
        case.body = {**case.body, "ref": registry_ref(case.body["ref"], fuzzed.registry)}
    image = case.body.get("image") if isinstance(case.body, dict) else None
    if isinstance(image, str) and not NAME_RE.fullmatch(image):
        # A snapshot's image that is no built image's name is a container image to import.
        case.body = {**case.body, "image": registry_ref(image, fuzzed.registry)}
    response = call_and_check(case, fuzzed.url)
    op = case.operation
    fuzzed.counts[op.label] += 1
    fuzzed.statuses[(op.label, response.status_code)] += 1
    try:
        body = response.json()
    except ValueError:
        body = None  # a file's bytes, the metrics text, a 204
    params = case.path_parameters if isinstance(case.path_parameters, dict) else {}
    KNOWN.note(op.method.upper(), op.path, params, response.status_code, body)
    _housekeep(fuzzed)


@boundaries.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_every_route_answers_boundary_values_as_documented(case: Any, fuzzed: FuzzedDaemon) -> None:
    _record(fuzzed, case)


def _layers_in_use(d: FuzzedDaemon) -> set[str]:
    in_use: set[str] = set()
    for recorded in snapshot_files.recorded_volumes(d.settings.snapshot_root).values():
        for att in recorded:
            in_use.update(att.chain)
    for vm in d.app.state.services.vms.all_vms():
        for att in vm.volumes:
            in_use.update(att.chain)
    return in_use


def _layers_on_disk(d: FuzzedDaemon) -> set[str]:
    return {str(p) for p in (d.settings.state_dir / "volumes").glob("*/layers/*")}


def _staging(d: FuzzedDaemon, sandboxes: set[str]) -> list[str]:
    """Staged or trashed files; a hibernation's state counts while its sandbox is listed."""
    roots = (d.settings.snapshot_root, d.settings.state_dir / "volumes")
    return sorted(
        p.name
        for r in roots
        for p in r.glob(".*")
        if HibernatedFiles.owner(p.name) not in sandboxes
    )


def test_the_fuzz_leaves_nothing_behind(fuzzed: FuzzedDaemon) -> None:
    """After the fuzz: the daemon holds every live VM, lists every sandbox it holds, and
    leaves no staging directory, no unused volume layer and, once stopped, no VM."""
    d = fuzzed
    listed = d.client.get("/v1/sandboxes").json()
    tags = {s["tag"] for s in d.client.get("/v1/snapshots").json()}
    services = d.app.state.services
    held = {vm.id for vm in services.vms.all_vms()}
    alive = {vm.id for vm in d.driver.vms if vm.is_alive()}
    assert alive == held, f"VMs alive that the daemon does not hold: {alive - held}"
    live = {s["id"] for s in listed if s["state"] in ("running", "paused")}  # a VM each
    sleeping = {s["id"] for s in listed if s["state"] == "hibernated"}
    assert all(services.hibernated.latest(sid) for sid in sleeping), "a hibernation lost its state"
    assert live == set(services.vms), "the list and the daemon's VMs disagree"
    assert all(s["state"] != "starting" for s in listed), listed
    assert {p.name for p in d.settings.run_dir.iterdir()} == held, "run dirs of no VM"
    on_disk = {p.name for p in d.settings.snapshot_root.iterdir() if not p.name.startswith(".")}
    assert on_disk == tags, "snapshot directories and the registry disagree"
    assert _staging(d, {s["id"] for s in listed}) == [], "staging directories left"
    assert _layers_on_disk(d) <= _layers_in_use(d), "volume layers no one uses"
    assert d.app.state.services.admission.holding() == 0, "admission held after the requests ended"
    assert services.holds.held() == [], "holds left after the requests ended"

    d.stop()  # kill_on_exit: every sandbox and pooled VM is killed
    assert [vm.id for vm in d.driver.vms if vm.is_alive()] == [], "VMs alive after stop"
    assert list(d.settings.run_dir.iterdir()) == [], "run dirs left after stop"
    # Hibernated sandboxes have no VM to kill: they stay, on disk, for the next daemon.
    assert _staging(d, sleeping) == [], "staging directories left after stop"
    assert _layers_on_disk(d) <= _layers_in_use(d), "volume layers no one uses after stop"

    total = sum(d.counts.values())
    print(
        f"\nfuzzed {total} requests over {len(d.counts)} routes "
        f"in {time.monotonic() - d.started:.1f} s"
    )
    for label, n in sorted(d.counts.items()):
        by_status = sorted((s, k) for (lab, s), k in d.statuses.items() if lab == label)
        print(f"  {n:4d}  {label}  " + " ".join(f"{s}x{k}" for s, k in by_status))


# ------------------------------------------------------------------ the checks can fail


def test_a_server_error_fails_the_fuzz(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks the fuzz runs refuse a 500, whatever the route documents."""
    from forkd.controller.services.sandboxes import SandboxService

    def broken(self: Any) -> list[Any]:
        raise RuntimeError("a bug")

    monkeypatch.setattr(SandboxService, "list", broken)
    case = schema["/v1/sandboxes"]["GET"].Case()
    with (
        _served(tmp_path, monkeypatch) as (url, _, _),
        pytest.raises(FailureGroup, match="Server error"),
    ):
        call_and_check(case, url)


# ------------------------------------------------------------------ what the fuzz found


@contextlib.contextmanager
def _served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> Iterator[Any]:
    """A daemon over the fake driver, under uvicorn: its URL, an httpx client, the driver."""
    make_image(tmp_path / "cache")
    monkeypatch.setenv("FORKD_CACHE_DIR", str(tmp_path / "cache"))
    state = tmp_path / "state"
    cfg = Settings(
        state_dir=state, snapshot_root=state / "snapshots", run_dir=state / "run", pool_size=0, **kw
    )
    port, driver = free_port(), FakeDriver()
    with serving(create_app(cfg, TOKEN, driver=driver), host="127.0.0.1", port=port):
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
            yield url, c, driver


def _hard_link_to_nothing() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        link = tarfile.TarInfo("a")
        link.type, link.linkname = tarfile.LNKTYPE, "missing"
        tar.addfile(link)
    return buf.getvalue()


def test_a_hard_link_to_a_missing_member_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _served(tmp_path, monkeypatch) as (_, c, _):
        r = c.post(
            "/v1/volumes", params={"name": "v", "size": "16M"}, content=_hard_link_to_nothing()
        )
        assert c.get("/v1/volumes").json() == []
        assert list((tmp_path / "state" / "volumes").iterdir()) == []  # nothing staged
        assert r.status_code == 400, r.text


def test_a_boolean_where_a_number_is_documented_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _served(tmp_path, monkeypatch) as (_, c, _):
        assert c.post("/v1/snapshots", json={"tag": "t"}).status_code == 201
        r = c.post("/v1/sandboxes", json={"snapshot_tag": "t", "n": True})
        assert r.status_code == 400, r.text
        assert c.get("/v1/sandboxes").json() == []


def _documented(method: str, path: str) -> set[str]:
    return set(_SPEC["paths"][path][method]["responses"])


def test_every_status_the_error_table_answers_is_documented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guest's refusal (403), a guest that does not answer (502) and a feature this host
    lacks (503) are answers a client meets: the contract must list them."""
    answered: list[tuple[str, str, int]] = []
    with _served(tmp_path, monkeypatch, network="user") as (_, c, driver):
        assert c.post("/v1/snapshots", json={"tag": "t"}).status_code == 201
        r = c.post("/v1/sandboxes", json={"snapshot_tag": "t", "per_child_netns": True})
        answered.append(("post", "/v1/sandboxes", r.status_code))
        sid = c.post("/v1/sandboxes", json={"snapshot_tag": "t"}).json()[0]["id"]
        files = "/v1/sandboxes/{sandbox_id}/files"
        r = c.put(files.format(sandbox_id=sid), params={"path": "/proc/x"}, content=b"x")
        answered.append(("put", files, r.status_code))
        next(vm for vm in driver.vms if vm.id == sid).fail = "ping"  # its agent stops answering
        ping = "/v1/sandboxes/{sandbox_id}/ping"
        answered.append(("post", ping, c.post(ping.format(sandbox_id=sid)).status_code))
    assert answered == [("post", "/v1/sandboxes", 503), ("put", files, 403), ("post", ping, 502)]
    undocumented = [a for a in answered if str(a[2]) not in _documented(a[0], a[1])]
    assert undocumented == []
