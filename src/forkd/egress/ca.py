"""The daemon's CA, which mints the certificates of the hosts the egress proxy
intercepts (those with rules or secrets), and the TLS contexts made of them.

Made once per state directory in ``<state dir>/egress-ca/`` (``ca.key`` 0600,
never leaving the host; ``ca.pem``, which every template's guest trusts): an EC
P-256 key and a certificate valid for ten years, constrained to sign server
certificates only (``pathlen 0``). A leaf lives 7 days and is minted again after
one; leaves are never written to disk (their key and chain reach OpenSSL through a
memory file).
"""

from __future__ import annotations

import datetime
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from forkd.errors import ForkdError

CA_DIR = "egress-ca"
CA_YEARS = 10
LEAF_DAYS = 7
LEAF_REMINT_SECS = 86400.0
MAX_LEAVES = 4096  # minted certificates kept (by name); the oldest go first
_PEM = serialization.Encoding.PEM


class CAError(ForkdError):
    """The CA's files are unsafe or unreadable."""


def _write_private(path: Path, data: bytes) -> None:
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(staged, path)


@dataclass(frozen=True)
class _Leaf:
    context: ssl.SSLContext
    minted: float


class EgressCA:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / CA_DIR
        self.cert_path = self.dir / "ca.pem"
        self._lock = threading.Lock()
        self._leaves: dict[str, _Leaf] = {}
        self._key, self._cert = self._load_or_make()
        self._leaf_key = ec.generate_private_key(ec.SECP256R1())  # this process's, in memory

    @property
    def pem(self) -> bytes:
        return self._cert.public_bytes(_PEM)

    def _load_or_make(self) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key_path = self.dir / "ca.key"
        if key_path.exists():
            st = key_path.stat()
            if st.st_mode & 0o077 or st.st_uid != os.geteuid():
                raise CAError(f"{key_path}: the CA key must be the daemon user's, mode 0600")
            try:
                key = serialization.load_pem_private_key(key_path.read_bytes(), None)
                cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
            except (OSError, ValueError) as exc:
                raise CAError(f"{self.dir}: cannot read the egress CA: {exc}") from None
            if not isinstance(key, ec.EllipticCurvePrivateKey):
                raise CAError(f"{key_path}: not an EC key")
            return key, cert
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        common = f"forkd egress CA {os.urandom(4).hex()}"
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "forkd"),
                x509.NameAttribute(NameOID.COMMON_NAME, common),
            ]
        )
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        self.cert_path.write_bytes(cert.public_bytes(_PEM))
        _write_private(
            key_path,
            key.private_bytes(
                _PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )
        return key, cert

    def cached(self, name: str) -> ssl.SSLContext | None:
        """``name``'s context if one is minted and fresh: no signing, no waiting."""
        with self._lock:
            leaf = self._leaves.get(name)
            if leaf is None or time.monotonic() - leaf.minted > LEAF_REMINT_SECS:
                return None
            return leaf.context

    def server_context(self, name: str) -> ssl.SSLContext:
        """A TLS server context presenting a certificate for ``name`` (canonical),
        minted now if need be (a signature and a context: run it off the event loop)."""
        with self._lock:
            leaf = self._leaves.get(name)
            if leaf is None or time.monotonic() - leaf.minted > LEAF_REMINT_SECS:
                if len(self._leaves) >= MAX_LEAVES:
                    self._leaves.pop(next(iter(self._leaves)))
                leaf = self._leaves[name] = _Leaf(self._mint(name), time.monotonic())
            return leaf.context

    def _mint(self, name: str) -> ssl.SSLContext:
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
            .issuer_name(self._cert.subject)
            .public_key(self._leaf_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=LEAF_DAYS))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                critical=False,
            )
            .sign(self._key, hashes.SHA256())
        )
        chain = cert.public_bytes(_PEM) + self.pem
        key = self._leaf_key.private_bytes(
            _PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])
        _load_chain_from_memory(ctx, chain, key)
        return ctx


def _load_chain_from_memory(ctx: ssl.SSLContext, chain: bytes, key: bytes) -> None:
    """``load_cert_chain`` takes paths only: give it memory files, never on disk."""
    cert_fd = os.memfd_create("forkd-leaf-cert", os.MFD_CLOEXEC)
    key_fd = os.memfd_create("forkd-leaf-key", os.MFD_CLOEXEC)
    try:
        os.write(cert_fd, chain)
        os.write(key_fd, key)
        ctx.load_cert_chain(f"/proc/self/fd/{cert_fd}", f"/proc/self/fd/{key_fd}")
    finally:
        os.close(cert_fd)
        os.close(key_fd)


def upstream_context(extra_ca: Path | None) -> ssl.SSLContext:
    """How the proxy checks the real host of an intercepted connection: the host's
    trust store, plus ``extra_ca`` (--egress-ca-file: an operator's private CA)."""
    ctx = ssl.create_default_context()
    if extra_ca is not None:
        ctx.load_verify_locations(cafile=str(extra_ca))
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx
