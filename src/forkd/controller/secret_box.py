"""The key that seals secrets at rest, and sealing with it (AES-256-GCM).

A secret's value is stored only sealed: ``nonce (12 bytes) || ciphertext+tag``,
with the secret's name in the associated data, so a sealed value moved onto
another name's row does not open. The key is 32 random bytes, kept as base64
text in ``<state dir>/secrets.key`` (made at first use, mode 0600) or in the
file ``--secrets-key-file`` / ``FORKD_SECRETS_KEY_FILE`` names (the operator's:
never made, e.g. a mounted Kubernetes secret). Either must be a regular file
owned by the daemon's user that no one else may read; anything else is refused
with a message saying what to fix, never used.

Losing the key loses every secret's value (names and hosts stay readable):
back it up with the database, apart from it (docs/RUNBOOK.md, "Secrets").
"""

from __future__ import annotations

import base64
import binascii
import os
import secrets
import stat
import threading
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from forkd.errors import ForkdError

KEY_FILE = "secrets.key"
KEY_ENV = "FORKD_SECRETS_KEY_FILE"
KEY_BYTES = 32
NONCE_BYTES = 12
_AAD = b"forkd secret v1\0"  # a sealed value means nothing outside this use
_MAX_KEY_FILE = 4096


class SecretKeyError(ForkdError):
    """The key file is missing, unsafe or malformed, or a value does not open with it."""


def _parse_key(data: bytes, path: Path) -> bytes:
    if len(data) == KEY_BYTES:  # 32 raw bytes, as `head -c 32 /dev/urandom` writes
        return data
    try:
        key = base64.b64decode(data.strip(), validate=True)
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise SecretKeyError(
            f"{path}: not a secrets key: it must hold 32 bytes, raw or base64 "
            f"(make one with: head -c 32 /dev/urandom | base64 > {path}; chmod 600 {path})"
        )
    return key


def _read_checked(path: Path) -> bytes:
    """The key file's bytes, if it is a regular file of this user's that only it may
    read; :class:`SecretKeyError` saying what is wrong otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SecretKeyError(f"{path}: the secrets key file does not exist") from None
    except OSError as exc:
        raise SecretKeyError(f"{path}: cannot open the secrets key file: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretKeyError(f"{path}: the secrets key must be a regular file")
        if st.st_uid != os.geteuid():
            raise SecretKeyError(
                f"{path}: the secrets key file belongs to uid {st.st_uid}, not to the "
                f"daemon's user (uid {os.geteuid()})"
            )
        if st.st_mode & 0o077:
            raise SecretKeyError(
                f"{path}: others may read the secrets key (mode "
                f"{stat.S_IMODE(st.st_mode):04o}): chmod 600 {path}"
            )
        return os.read(fd, _MAX_KEY_FILE)
    finally:
        os.close(fd)


def _make_key_file(path: Path) -> None:
    """Write a new key at ``path``, whole or not at all: staged 0600, fsynced, then
    linked into place (a key another daemon made first wins, and is used)."""
    staged = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, base64.b64encode(secrets.token_bytes(KEY_BYTES)) + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(staged, path)
    except FileExistsError:
        pass
    finally:
        staged.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class SecretBox:
    """Seals and opens values under the daemon's key, read (or made) at first use."""

    def __init__(self, state_dir: Path, key_file: Path | None = None) -> None:
        given = key_file or (Path(os.environ[KEY_ENV]) if os.environ.get(KEY_ENV) else None)
        self.path = given or state_dir / KEY_FILE
        self._may_make = given is None  # the operator's file is theirs to make
        self._aead: AESGCM | None = None
        self._lock = threading.Lock()

    def check(self) -> None:
        """At start: a key file that exists (or was named) must be usable; a default one
        not made yet is made at the first secret."""
        if self._may_make and not self.path.exists():
            return
        self._cipher()

    def _cipher(self) -> AESGCM:
        with self._lock:
            if self._aead is None:
                if self._may_make and not self.path.exists():
                    _make_key_file(self.path)
                self._aead = AESGCM(_parse_key(_read_checked(self.path), self.path))
            return self._aead

    def seal(self, name: str, value: str) -> bytes:
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._cipher().encrypt(nonce, value.encode(), _AAD + name.encode())

    def open(self, name: str, sealed: bytes) -> str:
        """The value sealed for ``name``; :class:`SecretKeyError` when this key did not
        seal it (the key file was replaced) or the row was altered."""
        aead = self._cipher()
        try:
            plain = aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], _AAD + name.encode())
        except (InvalidTag, ValueError):
            raise SecretKeyError(
                f"secret {name!r} does not open with the key in {self.path}: the key file "
                f"was replaced or the database altered; set the secret again (PUT "
                f"/v1/secrets/{name})"
            ) from None
        return plain.decode()
