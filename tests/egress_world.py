"""The egress tests' world, all on this machine: an "internet" of HTTPS, HTTP and raw
TCP servers in a network namespace the test makes, a test CA for their
certificates, and (for tests without a VM) a guest namespace in place of a
sandbox's tap, from which real clients (curl, Python) connect.

Topology (tests/integration/test_network.py's, on other ranges so the two may
run at once): the host is attached to a "LAN" 198.18.0.0/24 whose gateway is the
outside namespace, which holds the "internet" addresses 198.19.0.x (both of
198.18.0.0/15, set aside for test networks by RFC 2544). Every name the tests
use is pinned by the test (--egress-hosts, curl's --resolve): none resolves off
this machine.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

LAN = "198.18.0.0/24"
LAN_HOST = "198.18.0.254"
LAN_GATEWAY = "198.18.0.1"
INTERNET = "198.19.0.0/24"
WEB = "198.19.0.20"  # HTTPS 443, HTTP 80, a raw banner on 2222, a sink on 2223
NAMES = (
    "api.test.example",
    "other.test.example",
    "evil.test.example",
    "git.test.example",
    "pypi.test.example",
)
WHEEL = "forkd_probe-1.0-py3-none-any.whl"  # the package index's one package

SERVER = r"""
import base64, hashlib, http.server, io, json, os, socket, ssl, subprocess, sys, tempfile
import threading, zipfile
cert, key = sys.argv[1], sys.argv[2]
TOKEN = "Bearer " + os.environ.get("FORKD_TEST_TOKEN", "")

def wheel():  # a package an index serves: forkd-probe 1.0, pure Python
    files = {"forkd_probe/__init__.py": b"VALUE = 42\n",
             "forkd_probe-1.0.dist-info/METADATA":
                 b"Metadata-Version: 2.1\nName: forkd-probe\nVersion: 1.0\n",
             "forkd_probe-1.0.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: forkd\nRoot-Is-Purelib: true\n"
                 b"Tag: py3-none-any\n"}
    out, record = io.BytesIO(), ""
    with zipfile.ZipFile(out, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            record += f"{name},sha256={digest.decode()},{len(data)}\n"
        record += "forkd_probe-1.0.dist-info/RECORD,,\n"
        z.writestr("forkd_probe-1.0.dist-info/RECORD", record)
    return out.getvalue()
WHEEL = wheel()
GIT_ROOT = tempfile.mkdtemp(prefix="forkd-test-git-")
work = tempfile.mkdtemp(prefix="forkd-test-work-")
git = ["git", "-c", "user.name=forkd", "-c", "user.email=forkd@test.example", "-C", work]
subprocess.run([*git, "init", "-q"], check=True)
open(os.path.join(work, "README"), "w").write("cloned through the egress proxy\n")
subprocess.run([*git, "add", "README"], check=True)
subprocess.run([*git, "commit", "-qm", "first"], check=True)
subprocess.run(["git", "clone", "-q", "--bare", work, GIT_ROOT + "/repo.git"], check=True)

def git_backend(handler, body):  # git's smart HTTP, as a CGI
    path, _, query = handler.path.partition("?")
    env = {"GIT_PROJECT_ROOT": GIT_ROOT, "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
           "QUERY_STRING": query, "REQUEST_METHOD": handler.command,
           "CONTENT_TYPE": handler.headers.get("content-type", ""),
           "CONTENT_LENGTH": str(len(body)), "PATH": os.environ["PATH"],
           "HTTP_CONTENT_ENCODING": handler.headers.get("content-encoding", "")}
    done = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True)
    head, _, rest = done.stdout.partition(b"\r\n\r\n")
    if not _: head, _, rest = done.stdout.partition(b"\n\n")
    status, headers = 200, []
    for line in head.decode().splitlines():
        name, _, value = line.partition(":")
        if name.lower() == "status": status = int(value.split()[0])
        elif name: headers.append((name, value.strip()))
    handler.send_response(status)
    for name, value in headers: handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(rest))); handler.end_headers()
    handler.wfile.write(rest)

class Echo(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # its head and body are two writes: no 40 ms stall
    def log_message(self, *a): pass
    def _answer(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path.startswith("/redirect"):
            self.send_response(302); self.send_header("Location", "https://evil.test.example/")
            self.send_header("Content-Length", "0"); self.end_headers(); return
        if self.path.startswith(("/simple/", "/packages/", "/repo.git")):  # ask for the token
            if self.headers.get("authorization") != TOKEN:
                self.send_response(401); self.send_header("WWW-Authenticate", "Bearer")
                self.send_header("Content-Length", "0"); self.end_headers(); return
            if self.path.startswith("/repo.git"):
                return git_backend(self, body)
            if self.path.startswith("/simple/"):
                sha = hashlib.sha256(WHEEL).hexdigest()
                out = (f'<html><body><a href="/packages/forkd_probe-1.0-py3-none-any.whl'
                       f'#sha256={sha}">forkd_probe-1.0-py3-none-any.whl</a></body></html>').encode()
                kind = "text/html"
            else:
                out, kind = WHEEL, "application/octet-stream"
            self.send_response(200); self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers(); self.wfile.write(out); return
        if self.path.startswith("/check-token"):  # says whether, never echoes it
            good = self.headers.get("authorization") == TOKEN
            out = json.dumps({"authorized": good}).encode()
            self.send_response(200 if good else 401)
            self.send_header("Content-Length", str(len(out))); self.end_headers()
            self.wfile.write(out); return
        if self.path.startswith("/bytes/"):
            n = int(self.path.split("/")[2]); self.send_response(200)
            self.send_header("Content-Length", str(n)); self.end_headers()
            chunk = b"x" * 65536
            while n > 0:
                self.wfile.write(chunk[:n]); n -= len(chunk)
            return
        out = json.dumps({"host": self.headers.get("host"), "path": self.path,
                          "method": self.command, "body": len(body),
                          "headers": dict(self.headers.items())}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out))); self.end_headers()
        self.wfile.write(out)
    do_GET = do_POST = do_PUT = do_HEAD = _answer

def serve(port, tls):
    srv = http.server.ThreadingHTTPServer(("0.0.0.0", port), Echo)
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER); ctx.load_cert_chain(cert, key)
        ctx.set_alpn_protocols(["http/1.1"])
        srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    srv.serve_forever()

def banner(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept()
        def talk(c=c):
            c.sendall(b"SSH-2.0-fake\r\n")
            while (d := c.recv(65536)): c.sendall(d)
            c.close()
        threading.Thread(target=talk, daemon=True).start()

def sink(port):  # takes connections and never reads from them
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(256); held = []
    while True:
        held.append(s.accept()[0])

for target, args in ((serve, (443, True)), (serve, (80, False)), (banner, (2222,)),
                     (sink, (2223,))):
    threading.Thread(target=target, args=args, daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


@dataclass
class TestCA:
    dir: Path
    cert: Path  # the CA's certificate (what a client trusts)
    leaf_cert: Path
    leaf_key: Path


def made_ca(where: Path) -> TestCA:
    """The CA :func:`make_ca` wrote in ``where``."""
    return TestCA(where, where / "ca.pem", where / "leaf.pem", where / "leaf.key")


def make_ca(where: Path, names: tuple[str, ...] = NAMES) -> TestCA:
    """A CA and one leaf for ``names`` (and ``*.test.example``), with ``cryptography``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    where.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "forkd test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in (*names, "*.test.example")]
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (where / "ca.pem").write_bytes(ca.public_bytes(pem))
    (where / "leaf.pem").write_bytes(leaf.public_bytes(pem))
    (where / "leaf.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return TestCA(where, where / "ca.pem", where / "leaf.pem", where / "leaf.key")


def host_networks() -> list[ipaddress.IPv4Network]:
    """The networks of this host's addresses and of its routes (the default aside)."""
    from pyroute2 import IPRoute

    nets = []
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=socket.AF_INET):
            nets.append(
                ipaddress.IPv4Network(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}", strict=False)
            )
        for r in ipr.get_routes(family=socket.AF_INET):
            if dst := r.get_attr("RTA_DST"):
                nets.append(ipaddress.IPv4Network(f"{dst}/{r['dst_len']}", strict=False))
    return nets


def clash(*ranges: str) -> ipaddress.IPv4Network | None:
    """A network of this host's that overlaps one of a test's own ``ranges``, if any."""
    for net in host_networks():
        if any(net.overlaps(ipaddress.IPv4Network(r)) for r in ranges):
            return net
    return None


@contextlib.contextmanager
def link_to(
    netns: str, host_if: str, address: str, gateway: str, routes: Iterable[str]
) -> Iterator[None]:
    """A veth from the host (``host_if``, ``address``/24) to ``netns`` (its end ``eth0``),
    and ``routes`` through ``gateway`` over it alone (``oif``: never a gateway of the
    host's of that address); the host's end removed after."""
    from pyroute2 import IPRoute

    try:
        with IPRoute() as ipr:
            ipr.link(
                "add", ifname=host_if, kind="veth", peer={"ifname": "eth0", "net_ns_fd": netns}
            )
            idx = ipr.link_lookup(ifname=host_if)[0]
            ipr.addr("add", index=idx, address=address, prefixlen=24)
            ipr.link("set", index=idx, state="up")
            for dst in routes:
                ipr.route("add", dst=dst, gateway=gateway, oif=idx)
        yield
    finally:
        with IPRoute() as ipr, contextlib.suppress(Exception):
            for idx in ipr.link_lookup(ifname=host_if):
                ipr.link("del", index=idx)


@dataclass
class Outside:
    netns: str
    ca: TestCA
    hosts_file: Path  # --egress-hosts: every test name pinned to WEB


@contextlib.contextmanager
def outside(where: Path, ca: TestCA | None = None, token: str = "") -> Iterator[Outside]:
    """The fake internet: a namespace one hop past the host's fake LAN, serving HTTPS
    (certificates of ``ca``, else a CA made here), HTTP and a raw banner at WEB;
    ``/check-token`` accepts ``Authorization: Bearer <token>``. Removed after."""
    from forkd.vmm.jail import netns_ops

    if (taken := clash(LAN, INTERNET)) is not None:
        raise RuntimeError(f"this host is on {taken}: the test's LAN and internet would clash")
    name, host_if = f"fkt-web-{os.getpid()}", f"fkw{os.getpid() % 100000}"
    ca = ca or make_ca(where / "ca")
    hosts = where / "egress-hosts"
    hosts.write_text("".join(f"{WEB} {n}\n" for n in NAMES))
    # Namespaces made and entered on threads (forkd's netns_ops), never by a forked
    # helper: a fork of a process with an event loop inherits its signal wake-up
    # descriptor, and the helper's SIGTERM at close would stop the loop's program.
    netns_ops.create(name)
    server, stack = None, contextlib.ExitStack()
    try:
        stack.enter_context(link_to(name, host_if, LAN_HOST, LAN_GATEWAY, [INTERNET]))
        netns_ops.run_inside(name, _outside_links)
        server = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{name}",
                "--",
                sys.executable,
                "-c",
                textwrap.dedent(SERVER),
                str(ca.leaf_cert),
                str(ca.leaf_key),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "FORKD_TEST_TOKEN": token},
        )
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        yield Outside(name, ca, hosts)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        stack.close()
        netns_ops.remove(name)


def _outside_links() -> None:
    """Inside the outside namespace (on a thread there): its end of the LAN, the web."""
    from pyroute2 import IPRoute

    with IPRoute() as ns:
        eth = ns.link_lookup(ifname="eth0")[0]
        ns.addr("add", index=eth, address=LAN_GATEWAY, prefixlen=24)
        ns.addr("add", index=eth, address=WEB, prefixlen=32)
        ns.link("set", index=eth, state="up")
        ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
        ns.route("add", dst="0.0.0.0/0", gateway=LAN_HOST)


def swap_in_guest(sandbox_netns: str, guest_netns: str) -> None:
    """Put a namespace where a VM would be: ``tap0`` of the sandbox's namespace becomes
    a veth whose other end is ``eth0`` (10.0.2.15) of ``guest_netns``, so real clients
    run there are the guest as the sandbox's rules and proxy see it."""
    from forkd.vmm.jail import netns_ops

    netns_ops.create(guest_netns)
    netns_ops.run_inside(sandbox_netns, lambda: _tap_to(guest_netns))
    netns_ops.run_inside(guest_netns, _guest_links)


def _tap_to(guest_netns: str) -> None:
    from pyroute2 import IPRoute

    with IPRoute() as ns:
        [tap] = ns.link_lookup(ifname="tap0")
        ns.link("del", index=tap)
        ns.link(
            "add", ifname="tap0", kind="veth", peer={"ifname": "eth0", "net_ns_fd": guest_netns}
        )
        [tap] = ns.link_lookup(ifname="tap0")
        ns.addr("add", index=tap, address="10.0.2.2", prefixlen=24)
        ns.addr("add", index=tap, address="10.0.2.3", prefixlen=32)  # the guest's resolver
        ns.link("set", index=tap, state="up")


def _guest_links() -> None:
    from pyroute2 import IPRoute

    with IPRoute() as g:
        eth = g.link_lookup(ifname="eth0")[0]
        g.addr("add", index=eth, address="10.0.2.15", prefixlen=24)
        g.link("set", index=eth, state="up")
        g.link("set", index=g.link_lookup(ifname="lo")[0], state="up")
        g.route("add", dst="0.0.0.0/0", gateway="10.0.2.2")


def in_guest(guest_netns: str, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as the guest does, in its namespace."""
    return subprocess.run(
        ["nsenter", f"--net=/run/netns/{guest_netns}", "--", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def wait_for(predicate: object, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if callable(predicate) and predicate():
            return True
        time.sleep(0.05)
    return False
