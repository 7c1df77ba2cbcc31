"""Preview URL tokens: an HMAC-SHA256 over what a token grants, keyed by a per-daemon secret.

A token is ``p1.<sandbox id>.<port>.<expires at, unix s>.<MAC>``; the MAC
(base64url, unpadded) covers the sandbox id, the sandbox's creation time,
the port and the expiry. The creation time is not in the token: a token
cannot be replayed onto another sandbox, even one that later reuses the id.

The key is 32 random bytes in ``<state dir>/preview.key`` (mode 0600), made
on first use. Deleting the file rotates it: every outstanding preview URL
stops working at once, no restart needed (the file is checked at each use).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from forkd.errors import Forbidden, ForkdError

KEY_FILE = "preview.key"
KEY_BYTES = 32
TOKEN_VERSION = "p1"
MAX_TOKEN_CHARS = 160
_TOKEN = re.compile(r"p1\.([A-Za-z0-9_-]{1,80})\.([0-9]{1,5})\.([0-9]{1,12})\.([A-Za-z0-9_-]{43})")
_DOMAIN = b"forkd preview url v1"  # a MAC of this key means nothing anywhere else


@dataclass(frozen=True)
class PreviewClaim:
    """What a token says; trust it only once :meth:`PreviewKey.verify` passed it."""

    sandbox_id: str
    port: int
    expires_at_unix: int
    mac: str


def parse(token: str) -> PreviewClaim:
    """The claim ``token`` makes; :class:`Forbidden` when it is not a token at all."""
    m = _TOKEN.fullmatch(token) if len(token) <= MAX_TOKEN_CHARS else None
    if m is None:
        raise Forbidden("not a valid preview URL")
    return PreviewClaim(m.group(1), int(m.group(2)), int(m.group(3)), m.group(4))


class PreviewKey:
    """The daemon's preview key file: sign and verify tokens."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / KEY_FILE
        self._cached: tuple[tuple[int, int, int], bytes] | None = None

    def sign(self, sandbox_id: str, created_at_unix: int, port: int, expires_at_unix: int) -> str:
        mac = self._mac(sandbox_id, created_at_unix, port, expires_at_unix)
        return f"{TOKEN_VERSION}.{sandbox_id}.{port}.{expires_at_unix}.{mac}"

    def verify(self, claim: PreviewClaim, created_at_unix: int) -> None:
        """:class:`Forbidden` unless the claim's MAC is this key's (a constant-time compare)."""
        want = self._mac(claim.sandbox_id, created_at_unix, claim.port, claim.expires_at_unix)
        if not hmac.compare_digest(want.encode(), claim.mac.encode()):
            raise Forbidden("not a valid preview URL")

    def _mac(self, sandbox_id: str, created_at_unix: int, port: int, expires: int) -> str:
        message = b"\n".join(
            [
                _DOMAIN,
                sandbox_id.encode(),
                str(created_at_unix).encode(),
                str(port).encode(),
                str(expires).encode(),
            ]
        )
        digest = hmac.new(self._key(), message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def access_token(self, sandbox_id: str, created_at_unix: int) -> str:
        """The token E2B's SDKs send to a sandbox's in-guest daemon (``X-Access-Token``):
        keyed to this sandbox (and its creation, so a reused id gets another)."""
        message = b"\n".join([b"e2b-envd", sandbox_id.encode(), str(created_at_unix).encode()])
        digest = hmac.new(self._key(), message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def volume_token(self, volume_id: str, created_at_unix: float) -> str:
        """The token of a shared volume's content API (E2B's ``Volume.token``): keyed to
        the volume and its creation, so a volume made again under its name gets another."""
        message = b"\n".join([b"e2b-volume", volume_id.encode(), repr(created_at_unix).encode()])
        digest = hmac.new(self._key(), message, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()

    def cookie_tag(self, prefix: str) -> bytes:
        """What the names of a guest's cookies on the daemon's origin begin with, for the
        route ``prefix``: keyed, so no page (another sandbox's, whose id may be known) can
        work it out and set a cookie under it; the same across restarts, with the key."""
        digest = hmac.new(self._key(), b"cookie\n" + prefix.encode(), hashlib.sha256)
        return b"fk" + digest.hexdigest()[:16].encode() + b"-"

    def _key(self) -> bytes:
        """The key, made on first use; read again whenever the file changed."""
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._create()
            st = self.path.stat()
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ForkdError(
                f"{self.path} may be read by others (mode "
                f"{stat.S_IMODE(st.st_mode):o}): chmod 600 it, or delete it to "
                "make a new one (that ends every preview URL)"
            )
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if self._cached is not None and self._cached[0] == seen:
            return self._cached[1]
        key = self.path.read_bytes()
        if len(key) != KEY_BYTES:
            raise ForkdError(
                f"{self.path} holds {len(key)} bytes, not {KEY_BYTES}: delete "
                "it to make a new one (that ends every preview URL)"
            )
        self._cached = (seen, key)
        return key

    def _create(self) -> None:
        """Write a new key beside the file, then link it into place: a reader never
        sees half a key, and of two daemons racing one key wins."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(f".{KEY_FILE}.{secrets.token_hex(4)}")
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            with contextlib.suppress(FileExistsError):
                os.link(partial, self.path)
        finally:
            partial.unlink()
