"""The egress proxy with real namespaces, nftables rules, sockets and clients, but no
VM: a guest namespace stands where a sandbox's tap would be (tests/egress_world.py),
and curl and Python run in it as a guest's programs would. The "internet" is a
namespace of this test; every name is pinned by it."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import pytest

from forkd.egress.proxy import EgressProxy
from forkd.egress.records import EgressRecord
from forkd.egress.resolver import PinnedHosts, Resolver
from forkd.vmm.jail import network
from forkd.vmm.jail.egress import Egress
from tests import egress_world
from tests.egress_world import WEB, Outside, in_guest

if network.netns_problems():
    pytest.skip(
        "no network namespaces here: " + "; ".join(network.netns_problems()),
        allow_module_level=True,
    )

T = TypeVar("T")
_ids = itertools.count(1)


class Loop:
    """An event loop on a thread of its own: the daemon's, in miniature."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 30) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout)

    def call(self, fn: Callable[[], T]) -> T:
        async def wrapped() -> T:
            return fn()

        return self.run(wrapped())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outside]:
    try:
        with egress_world.outside(tmp_path_factory.mktemp("egress")) as made:
            yield made
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def daemon(world: Outside) -> Iterator[tuple[Loop, network.HostNetwork, EgressProxy]]:
    loop = Loop()
    host = network.HostNetwork(mode="netns")
    proxy = EgressProxy(Resolver(PinnedHosts(world.hosts_file)), str(host.cidr))
    host.use_egress(proxy)
    try:
        yield loop, host, proxy
    finally:
        loop.run(proxy.close())
        host.use_egress(None)
        loop.stop()


class Guest:
    def __init__(self, world: Outside, vm_id: str, netns: str, net: network.SandboxNet) -> None:
        self.world, self.vm_id, self.netns, self.net = world, vm_id, netns, net

    def curl(self, url: str, *extra: str) -> subprocess.CompletedProcess[str]:
        """curl as a guest runs it: its DNS answer for every test name is an address
        nobody listens on (the proxy must not care)."""
        resolve = [
            arg
            for n in egress_world.NAMES
            for p in (80, 443)
            for arg in ("--resolve", f"{n}:{p}:198.19.0.99")
        ]
        return in_guest(
            self.netns,
            "curl",
            "-sS",
            "--max-time",
            "15",
            "--cacert",
            str(self.world.ca.cert),
            *resolve,
            *extra,
            url,
        )

    def python(self, code: str) -> subprocess.CompletedProcess[str]:
        return in_guest(self.netns, sys.executable, "-c", code)


@pytest.fixture
def sandbox(
    world: Outside, daemon: tuple[Loop, network.HostNetwork, EgressProxy]
) -> Iterator[Callable[[Any], Guest]]:
    loop, host, _ = daemon
    made: list[Guest] = []

    def make(policy: Any) -> Guest:
        vm_id = f"fkt-{os.getpid()}-{next(_ids)}"
        net = loop.run(network.attach(host, vm_id, Egress.parse(policy)))
        assert net is not None
        guest = Guest(world, vm_id, f"fkt-g-{os.getpid()}-{next(_ids)}", net)
        made.append(guest)
        egress_world.swap_in_guest(net.netns, guest.netns)
        return guest

    yield make
    from forkd.vmm.jail import netns_ops

    for guest in made:
        loop.run(network.detach(guest.net))
        netns_ops.remove(guest.netns)


def records(daemon: tuple[Loop, Any, EgressProxy], guest: Guest) -> list[EgressRecord]:
    """The guest's records, once each has ended (a connection's record is complete when
    the proxy has seen both sides close)."""
    loop, _, proxy = daemon

    def ended() -> list[EgressRecord] | None:
        found: list[EgressRecord] = loop.call(lambda: proxy.log.of(guest.vm_id))
        return found if all(r.ended_at for r in found) else None

    assert egress_world.wait_for(ended), "a connection's record never ended"
    return ended() or []


def _echo(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_tls_passes_through_by_its_server_name_not_the_guests_dns(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    guest = sandbox("internet")
    answer = _echo(guest.curl("https://api.test.example/echo?q=1"))
    assert answer["host"] == "api.test.example" and answer["path"] == "/echo?q=1"
    [record] = records(daemon, guest)
    assert (record.verdict, record.kind, record.host, record.port) == (
        "allowed",
        "tls",
        "api.test.example",
        443,
    )
    assert record.address == WEB  # the pinned address, not the guest's 198.19.0.99
    assert record.bytes_out > 200 and record.bytes_in > 500  # a handshake each way, unread


def test_an_allow_list_of_names_lets_only_those_out(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    guest = sandbox({"allow_out": ["api.test.example"]})
    assert guest.curl("https://api.test.example/").returncode == 0
    refused = guest.curl("https://other.test.example/")
    assert refused.returncode != 0 and "access denied" in refused.stderr
    plain = guest.curl("http://other.test.example/echo", "-i")
    assert plain.stdout.startswith("HTTP/1.1 403") and "not allowed" in plain.stdout
    assert _echo(guest.curl("http://api.test.example/echo"))["host"] == "api.test.example"
    verdicts = [(r.kind, r.host, r.verdict) for r in records(daemon, guest)]
    assert verdicts == [
        ("tls", "api.test.example", "allowed"),
        ("tls", "other.test.example", "refused"),
        ("http", "other.test.example", "refused"),
        ("http", "api.test.example", "allowed"),
    ]


def test_deny_wins_over_allow_and_wildcards_match_below_their_domain(
    sandbox: Callable[[Any], Guest],
) -> None:
    guest = sandbox({"allow_out": ["*.test.example"], "deny_out": ["evil.test.example"]})
    assert guest.curl("https://other.test.example/").returncode == 0
    assert guest.curl("https://evil.test.example/").returncode != 0
    # no other spelling (curl's own --resolve for it: the guest's DNS is the test's)
    spelled = guest.curl(
        "https://EVIL.test.example./", "--resolve", "EVIL.test.example.:443:198.19.0.99"
    )
    assert spelled.returncode != 0 and "access denied" in spelled.stderr, spelled.stderr


KEEP_ALIVE = """
import socket, sys
s = socket.create_connection(("198.19.0.99", 80), timeout=10)
f = s.makefile("rb")
def ask(host):
    s.sendall(f"GET /echo HTTP/1.1\\r\\nHost: {host}\\r\\n\\r\\n".encode())
    status, length = f.readline().decode().strip(), 0
    while (line := f.readline()) not in (b"\\r\\n", b""):
        if line.lower().startswith(b"content-length:"): length = int(line.split(b":")[1])
    f.read(length)
    return status
print(ask("api.test.example")); print(ask(sys.argv[1]))
"""


def test_a_second_request_for_another_host_on_one_connection_is_misdirected(
    sandbox: Callable[[Any], Guest],
) -> None:
    guest = sandbox("internet")  # both hosts allowed: still one connection, one host
    out = in_guest(guest.netns, sys.executable, "-c", KEEP_ALIVE, "other.test.example")
    assert out.stdout.splitlines() == ["HTTP/1.1 200 OK", "HTTP/1.1 421 Misdirected Request"]


def test_raw_tcp_is_judged_by_address_only(
    sandbox: Callable[[Any], Guest], daemon: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.egress import connection

    monkeypatch.setattr(connection, "QUIET_CLIENT_SECS", 1.0)  # refused sooner
    banner = (
        f"import socket; s = socket.create_connection(('{WEB}', 2222), timeout=10);"
        "print(s.recv(100).decode().strip() or 'closed')"
    )
    assert guest_says(sandbox("internet"), banner) == "SSH-2.0-fake"  # the server first
    by_name = sandbox({"allow_out": ["api.test.example"]})
    assert guest_says(by_name, banner) in ("closed", "ConnectionResetError")
    assert (records(daemon, by_name)[0].reason or "").endswith("network policy")
    assert guest_says(sandbox({"allow_out": [f"{WEB}/32"]}), banner) == "SSH-2.0-fake"


SLOW_TLS = """
import socket, ssl, sys, time
ctx = ssl.create_default_context(cafile=sys.argv[1])
raw = socket.create_connection(("198.19.0.99", 443), timeout=30)
time.sleep(2.5)  # a guest's TLS library, slow to say its ClientHello (TCG, a loaded host)
with ctx.wrap_socket(raw, server_hostname="api.test.example") as s:
    s.sendall(b"GET /echo HTTP/1.1\\r\\nHost: api.test.example\\r\\nConnection: close\\r\\n\\r\\n")
    print(s.recv(100).split(b"\\r\\n")[0].decode())
"""


def test_a_tls_client_slow_to_say_hello_still_goes_out_by_name(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    """Silence after connecting is raw TCP only where raw TCP could go; to an address
    the policy does not open, the proxy waits for the client's TLS or HTTP."""
    guest = sandbox({"allow_out": ["api.test.example"]})
    out = in_guest(guest.netns, sys.executable, "-c", SLOW_TLS, str(guest.world.ca.cert))
    assert out.stdout.strip() == "HTTP/1.1 200 OK", out.stderr
    [record] = records(daemon, guest)
    assert (record.verdict, record.kind, record.host) == ("allowed", "tls", "api.test.example")


def guest_says(guest: Guest, code: str) -> str:
    out = guest.python(f"try:\n    {code}\nexcept OSError as e:\n    print(type(e).__name__)")
    return out.stdout.strip()


def test_the_host_and_the_proxy_itself_are_fenced_off(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    guest = sandbox({"allow_out": ["0.0.0.0/0"]})  # the widest policy: still fenced in
    for target in (egress_world.LAN_HOST, "10.0.2.2", "10.201.0.1"):
        probe = (
            f"s = __import__('socket').create_connection(('{target}', 80), timeout=10);"
            "s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n');"
            "print(s.recv(100) or 'closed')"
        )
        said = guest_says(guest, probe)
        assert "200" not in said, (target, said)
    reasons = [r.reason or "" for r in records(daemon, guest)]
    assert len(reasons) == 3 and all(
        "host's" in r or "403" in r or "never" in r for r in reasons
    ), reasons


def test_a_name_resolving_to_loopback_is_refused(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    guest = sandbox("internet")
    answer = guest.curl("http://localhost/", "-i", "--resolve", "localhost:80:198.19.0.99")
    assert answer.stdout.startswith("HTTP/1.1 403"), answer.stdout
    assert "127.0.0.1" in (records(daemon, guest)[0].reason or "")


def test_redirects_are_the_guests_to_follow_and_each_is_judged(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    guest = sandbox({"allow_out": ["api.test.example"]})
    followed = guest.curl("https://api.test.example/redirect", "-L")
    assert followed.returncode != 0  # evil.test.example: refused when the guest asks
    assert [(r.host, r.verdict) for r in records(daemon, guest)] == [
        ("api.test.example", "allowed"),
        ("evil.test.example", "refused"),
    ]


def test_a_policy_change_applies_to_the_next_connection(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    loop, _, proxy = daemon
    guest = sandbox("internet")
    assert guest.curl("https://api.test.example/").returncode == 0
    loop.call(lambda: proxy.set_policy(guest.vm_id, Egress.parse({"deny_out": ["*"]})))
    assert guest.curl("https://api.test.example/").returncode != 0


def test_released_namespaces_leave_no_socket_behind(
    world: Outside, daemon: tuple[Loop, network.HostNetwork, EgressProxy]
) -> None:
    loop, host, _ = daemon
    vm_id = f"fkt-{os.getpid()}-{next(_ids)}"
    net = loop.run(network.attach(host, vm_id, Egress("internet")))
    assert net is not None and Path(f"/sys/class/net/{net.host_if}").exists()
    loop.run(network.detach(net))
    # the veth goes with the namespace only once no socket of ours holds it
    assert egress_world.wait_for(lambda: not Path(f"/sys/class/net/{net.host_if}").exists())


# -- interception: hosts with secrets or rules --------------------------------------


class Secrets:
    """The daemon's secrets as the proxy sees them (the real service is tested in
    test_secrets.py): a value for a host among its hosts, else nothing."""

    def __init__(self) -> None:
        self.values = {"openai": ("sk-test-0123456789", ("api.test.example",))}

    def value_for(self, name: str, host: str) -> str | None:
        value, hosts = self.values.get(name, ("", ()))
        return value if host in hosts else None

    def any_for(self, host: str) -> bool:
        return any(host in hosts for _, hosts in self.values.values())


@pytest.fixture(scope="module")
def secrets(
    daemon: tuple[Loop, network.HostNetwork, EgressProxy],
    world: Outside,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Secrets]:
    from forkd.egress.ca import EgressCA
    from forkd.egress.intercept import Interceptor

    _, _, proxy = daemon
    made = Secrets()
    ca = EgressCA(tmp_path_factory.mktemp("state"))
    proxy.interception = Interceptor(ca, made, world.ca.cert)  # the test's "internet" CA
    both = tmp_path_factory.mktemp("trust") / "both.pem"
    both.write_bytes(ca.pem + world.ca.cert.read_bytes())  # what a template's guest trusts
    world.trust = both  # type: ignore[attr-defined]
    yield made
    proxy.interception = None


PLACEHOLDER = "Authorization: Bearer ${secrets.openai}"


def test_a_secret_is_put_in_only_for_its_own_host_over_tls(
    sandbox: Callable[[Any], Guest], daemon: Any, secrets: Secrets, world: Outside
) -> None:
    guest = sandbox("internet")
    trust = str(world.trust)  # type: ignore[attr-defined]
    mine = _echo(guest.curl("https://api.test.example/echo", "--cacert", trust, "-H", PLACEHOLDER))
    assert mine["headers"]["Authorization"] == "Bearer sk-test-0123456789"
    other = _echo(
        guest.curl("https://other.test.example/echo", "--cacert", trust, "-H", PLACEHOLDER)
    )
    assert other["headers"]["Authorization"] == "Bearer ${secrets.openai}"  # passed through
    plain = _echo(guest.curl("http://api.test.example/echo", "-H", PLACEHOLDER))
    assert plain["headers"]["Authorization"] == "Bearer ${secrets.openai}"  # no TLS: never
    found = [(r.kind, r.host, r.secrets) for r in records(daemon, guest)]
    assert found == [
        ("https", "api.test.example", ["openai"]),
        ("tls", "other.test.example", []),
        ("http", "api.test.example", []),
    ]


def test_a_fronted_host_gets_no_secret_and_no_other_host(
    sandbox: Callable[[Any], Guest], secrets: Secrets, world: Outside
) -> None:
    guest = sandbox("internet")
    fronted = guest.curl(
        "https://api.test.example/echo",
        "--cacert",
        str(world.trust),  # type: ignore[attr-defined]
        "-H",
        "Host: other.test.example",
        "-H",
        PLACEHOLDER,
        "-i",
    )
    assert fronted.stdout.startswith("HTTP/1.1 421"), fronted.stdout
    assert "sk-test" not in fronted.stdout


def test_rules_set_headers_and_a_rotation_is_the_next_requests(
    sandbox: Callable[[Any], Guest], secrets: Secrets, world: Outside
) -> None:
    rule = {"transform": {"headers": {"X-Api-Key": "${secrets.openai}", "X-Team": "forkd"}}}
    guest = sandbox({"rules": {"api.test.example": [rule]}})
    args = ("--cacert", str(world.trust), "-H", "X-Team: spoofed")  # type: ignore[attr-defined]
    first = _echo(guest.curl("https://api.test.example/echo", *args))
    assert first["headers"]["X-Api-Key"] == "sk-test-0123456789"
    assert first["headers"]["X-Team"] == "forkd"  # the rule's, not the guest's
    secrets.values["openai"] = ("sk-rotated-42", ("api.test.example",))
    assert (
        _echo(guest.curl("https://api.test.example/echo", *args))["headers"]["X-Api-Key"]
        == "sk-rotated-42"
    )


H2_ONLY = """
import socket, ssl
ctx = ssl.create_default_context(cafile=%r); ctx.set_alpn_protocols(["h2"])
try:
    with ctx.wrap_socket(socket.create_connection(("198.19.0.99", 443), timeout=10),
                         server_hostname="api.test.example") as s:
        print("connected", s.selected_alpn_protocol())
except (ssl.SSLError, OSError) as e:
    print("refused", type(e).__name__)
"""


def test_an_h2_only_client_of_an_intercepted_host_is_refused(
    sandbox: Callable[[Any], Guest], secrets: Secrets, world: Outside, daemon: Any
) -> None:
    guest = sandbox("internet")
    said = guest.python(H2_ONLY % str(world.trust)).stdout  # type: ignore[attr-defined]
    assert said.startswith("refused"), said
    assert "HTTP/1.1" in (records(daemon, guest)[0].reason or "")


HOLD_OPEN = f"""
import socket, sys, time
s = socket.create_connection(("{WEB}", 2222), timeout=10)
assert s.recv(100).startswith(b"SSH")
print("open", flush=True)
s.settimeout(10)
start = time.monotonic()
try:
    while s.recv(100):
        pass
    print("closed after", round(time.monotonic() - start, 2))
except OSError as e:
    print("closed after", round(time.monotonic() - start, 2), type(e).__name__)
"""


def test_a_policy_change_closes_the_connections_it_denies(
    sandbox: Callable[[Any], Guest], daemon: Any
) -> None:
    loop, _, proxy = daemon
    guest = sandbox("internet")
    held = subprocess.Popen(
        ["nsenter", f"--net=/run/netns/{guest.netns}", "--", sys.executable, "-c", HOLD_OPEN],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert held.stdout is not None and held.stdout.readline().strip() == "open"
        closed = loop.call(lambda: proxy.set_policy(guest.vm_id, Egress.parse("none")))
        assert closed == 1
        said = held.stdout.readline().split()
        assert said[:2] == ["closed", "after"] and float(said[2]) < 1.0, said
    finally:
        held.kill()
        held.wait()


# -- a hostile guest -----------------------------------------------------------------
#
# Each attack is followed by a plain request from another sandbox: the proxy (one
# event loop in the daemon) must still answer it at once.

RAW = """
import socket, sys, time
s = socket.create_connection(("198.19.0.99", int(sys.argv[1])), timeout=15)
try:
    s.sendall(bytes.fromhex(sys.stdin.read()))
except OSError as e:  # cut off while sending (past the head's limit)
    print(type(e).__name__, 0.0)
    sys.exit()
start = time.monotonic()
try:
    got = s.recv(200)
except OSError as e:
    got = type(e).__name__.encode()
print(repr(got[:120]), round(time.monotonic() - start, 1))
"""


def send_raw(guest: Guest, port: int, data: bytes) -> str:
    out = subprocess.run(
        ["nsenter", f"--net=/run/netns/{guest.netns}", "--", sys.executable, "-c", RAW, str(port)],
        input=data.hex(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return out.stdout.strip() or out.stderr.strip()


@pytest.fixture
def bystander(sandbox: Callable[[Any], Guest]) -> Callable[[], None]:
    """A second sandbox whose plain request must be answered promptly."""
    other = sandbox("internet")

    def still_served() -> None:
        started = time.monotonic()
        assert _echo(other.curl("http://api.test.example/echo"))["host"] == "api.test.example"
        assert time.monotonic() - started < 5

    return still_served


@pytest.mark.parametrize(
    ("port", "data", "says"),
    [
        (
            80,
            b"GET / HTTP/1.1\r\nHost: api.test.example\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n",
            "400|ConnectionResetError|BrokenPipeError",
        ),  # a 1 MiB header: cut
        (
            80,
            b"POST /echo HTTP/1.1\r\nHost: api.test.example\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
            "403",
        ),  # CL+TE smuggling
        (80, b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n", "403"),
        (80, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "400"),  # an h2 preface, in the clear
        (80, b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "400"),  # two hosts
        (443, b"\x16\x03\x01\x00\x10" + b"\xff" * 16, "\\x15\\x03\\x03"),  # a garbage hello
    ],
)
def test_malformed_requests_are_refused_with_an_answer(
    sandbox: Callable[[Any], Guest],
    bystander: Callable[[], None],
    port: int,
    data: bytes,
    says: str,
) -> None:
    guest = sandbox("internet")
    said = send_raw(guest, port, data)
    assert any(s in said for s in says.split("|")), said
    bystander()


def test_an_http_1_0_request_without_host_goes_to_its_address(
    sandbox: Callable[[Any], Guest],
) -> None:
    guest = sandbox("internet")
    code = (
        "import socket; s = socket.create_connection(('198.19.0.20', 80), timeout=10); "
        "s.sendall(b'GET /echo HTTP/1.0\\r\\n\\r\\n'); got = b''\n"
        "while (d := s.recv(65536)): got += d\n"
        "print(got.decode())"
    )
    said = guest.python(code).stdout
    head, _, body = said.partition("\n\n")  # (read as text: CRLF became LF)
    assert head.startswith("HTTP/1.") and " 200 " in head.splitlines()[0], said
    assert json.loads(body)["host"] == "198.19.0.20", said


def test_a_slow_head_is_cut_and_holds_nothing(
    sandbox: Callable[[Any], Guest],
    bystander: Callable[[], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from forkd.egress import http as egress_http

    monkeypatch.setattr(egress_http, "HEAD_SECS", 1.0)
    guest = sandbox("internet")
    said = send_raw(guest, 80, b"GET /echo HTTP/1.1\r\nHost: api.tes")  # and nothing more
    got, took = said.rsplit(" ", 1)
    assert got in ("b''", "b'ConnectionResetError'") and float(took) < 5, said
    bystander()


@pytest.mark.parametrize(
    ("policy", "sni"),
    [
        ({"deny_out": ["bücher.test.example"]}, "xn--bcher-kva.test.example"),
        ({"deny_out": ["xn--bcher-kva.test.example"]}, "BÜCHER.test.example."),
        ({"deny_out": ["evil.test.example"]}, "evil.test.example."),
        ({"allow_out": ["api.test.example"]}, "api.test.example.evil.test.example"),
    ],
)
def test_no_spelling_of_a_name_slips_past_its_rule(
    sandbox: Callable[[Any], Guest], policy: Any, sni: str
) -> None:
    guest = sandbox(policy)
    code = (
        f"import socket, ssl; ctx = ssl.create_default_context(); "
        f"ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE\n"
        f"try:\n    ctx.wrap_socket(socket.create_connection(('198.19.0.99', 443), "
        f"timeout=10), server_hostname={sni!r}); print('through')\n"
        f"except (OSError, UnicodeError) as e: print('refused', type(e).__name__)"
    )
    said = guest.python(code).stdout.strip()
    assert said.startswith("refused"), said


FLOOD = """
import resource, select, socket, sys, time
n = int(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, n + 64), hard), hard))
n = min(n, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 64)
held = []
for _ in range(n):  # all at once, as fast as the guest can: nobody waits for an answer
    s = socket.socket(); s.setblocking(False); s.connect_ex(("198.19.0.20", 2222)); held.append(s)
time.sleep(float(sys.argv[2]))
alive = 0
for s in held:  # a banner came: the proxy took it on (the rest: closed, or never taken)
    try:
        alive += bool(s.recv(100))
    except OSError:
        pass
print(alive, n)
"""


def test_a_flood_of_connections_is_capped_and_the_proxy_keeps_serving(
    sandbox: Callable[[Any], Guest],
    bystander: Callable[[], None],
    daemon: Any,
) -> None:
    from forkd.egress.proxy import MAX_CONNECTIONS

    guest = sandbox("internet")
    flood = subprocess.Popen(
        [
            "nsenter",
            f"--net=/run/netns/{guest.netns}",
            "--",
            sys.executable,
            "-c",
            FLOOD,
            "10000",
            "4",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2)
        bystander()  # while the flood holds what it got
        alive, tried = (int(n) for n in flood.communicate(timeout=120)[0].split())
    finally:
        flood.kill()
    assert tried >= 5000, tried  # (the test's own descriptor limit)
    assert alive <= MAX_CONNECTIONS  # each beyond the cap was closed as it came
    refused = [r for r in records(daemon, guest) if r.verdict == "refused"]
    assert refused and "too many connections" in (refused[0].reason or "")
    bystander()


FILL = """
import socket, sys, time
held = [socket.create_connection(("198.19.0.20", 2223), timeout=5) for _ in range(int(sys.argv[1]))]
for s in held:
    s.setblocking(False)
chunk, sent, deadline = b"x" * 65536, 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < deadline:
    moved = False
    for s in held:
        try:
            sent += s.send(chunk)
            moved = True
        except BlockingIOError:
            pass
    if not moved:
        time.sleep(0.02)
print(sent)
"""


def test_a_guest_flooding_a_peer_that_never_reads_holds_no_more_than_its_share(
    sandbox: Callable[[Any], Guest],
    bystander: Callable[[], None],
    daemon: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop, _, proxy = daemon
    monkeypatch.setattr(proxy, "held_bytes", 1 << 20)
    guest = sandbox("internet")
    out = in_guest(guest.netns, sys.executable, "-c", FILL, "40", "3")
    assert out.returncode == 0, out.stderr
    meter = loop.call(lambda: proxy.meter_of(guest.vm_id))
    # 40 connections would hold 40 chunks (10 MiB) without a share; the kernel's
    # buffers took some, the share the rest, and no more.
    assert int(out.stdout) > 4 << 20
    assert 0 < meter.held <= meter.peak <= 1 << 20
    bystander()


@pytest.mark.parametrize(
    "url", ["https://other.test.example/bytes/3145728", "http://api.test.example/bytes/3145728"]
)
def test_a_rate_set_by_the_operator_holds_each_sandbox_to_it(
    sandbox: Callable[[Any], Guest],
    bystander: Callable[[], None],
    daemon: Any,
    monkeypatch: pytest.MonkeyPatch,
    url: str,
) -> None:
    _, _, proxy = daemon
    monkeypatch.setattr(proxy, "rate", 1 << 20)  # 1 MiB/s, a second's burst
    guest = sandbox("internet")
    started = time.monotonic()
    got = guest.curl(url, "-o", "/dev/null", "-w", "%{size_download}")
    took = time.monotonic() - started
    assert got.stdout == "3145728", got.stderr
    assert took >= 1.5, took  # 3 MiB at 1 MiB/s after a 1 MiB burst: 2 s
    bystander()


# -- the guest's DNS, answered by the daemon -------------------------------------------

ASK = """
import random, socket, struct, sys
name, raw = sys.argv[1], sys.argv[2] == "raw"
qid = random.randrange(65536)
if raw:
    query = bytes.fromhex(name)
else:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    query = struct.pack("!6H", qid, 0x0100, 1, 0, 0, 0) + labels + b"\\0" + struct.pack("!HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
s.sendto(query, ("10.0.2.3", 53))
try:
    data, peer = s.recvfrom(4096)
except OSError:
    print("no answer"); sys.exit()
rcode, count = data[3] & 0xF, struct.unpack("!H", data[6:8])[0]
addrs = [socket.inet_ntoa(data[i - 4:i]) for i in range(len(data), len(data) - 16 * count, -16)]
print(rcode, " ".join(sorted(addrs)), peer[0])
"""


def ask(guest: Guest, name: str, raw: bool = False) -> str:
    """The rcode, the A records and who answered, as the guest's resolver would ask."""
    out = in_guest(guest.netns, sys.executable, "-c", ASK, name, "raw" if raw else "name")
    return out.stdout.strip() or out.stderr.strip()


@pytest.mark.parametrize(
    ("policy", "name", "said"),
    [
        ("internet", "api.test.example", f"0 {WEB} 10.0.2.3"),  # pinned: the operator's word
        ({"allow_out": ["api.test.example"]}, "API.test.example", f"0 {WEB} 10.0.2.3"),
        ({"allow_out": ["api.test.example"]}, "other.test.example", "3  10.0.2.3"),  # NXDOMAIN
        ({"deny_out": ["evil.test.example"]}, "evil.test.example", "3  10.0.2.3"),
        ({"allow_out": ["198.19.0.0/24"]}, "api.test.example", f"0 {WEB} 10.0.2.3"),
        ("internet", "not-pinned.example", "2  10.0.2.3"),  # no resolver here: SERVFAIL
    ],
)
def test_the_guests_dns_is_answered_by_its_policy(
    sandbox: Callable[[Any], Guest], policy: Any, name: str, said: str
) -> None:
    assert ask(sandbox(policy), name) == said


def test_a_malformed_query_gets_no_answer_and_breaks_nothing(
    sandbox: Callable[[Any], Guest],
) -> None:
    guest = sandbox("internet")
    pointer = "abcd01000001000000000000c00c00010001"  # a compression pointer in the question
    assert ask(guest, pointer, raw=True) == "no answer"
    assert ask(guest, "ff" * 600, raw=True) == "no answer"
    assert ask(guest, "api.test.example") == f"0 {WEB} 10.0.2.3"
