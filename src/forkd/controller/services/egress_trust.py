"""The daemon's egress CA in a template's guest, so every fork trusts the certificates
the egress proxy presents for intercepted hosts (docs/RUNBOOK.md, "The egress proxy").

At build, before setup commands run: the CA goes to
``/usr/local/share/ca-certificates/forkd-egress.crt`` (where Debian's and Alpine's
``update-ca-certificates`` keep it from then on) and is appended to each system
bundle found (Debian/Ubuntu ``/etc/ssl/certs/ca-certificates.crt``, Alpine
``/etc/ssl/cert.pem``, Fedora/RHEL ``/etc/pki/tls/certs/ca-bundle.crt``);
``/etc/ssl/forkd-bundle.pem`` is the system bundle with it (or it alone). Every
command's environment then names that bundle for the runtimes that read their
own variable (``SSL_CERT_FILE``: OpenSSL, Python, curl; ``REQUESTS_CA_BUNDLE``;
``PIP_CERT``; ``GIT_SSL_CAINFO``; ``NODE_EXTRA_CA_CERTS``: Node adds it to its
own list), unless the image sets the variable itself.
"""

from __future__ import annotations

import logging

from forkd.controller.services.sandbox_vm import SandboxGuest
from forkd.errors import ForkdError

log = logging.getLogger(__name__)

CA_FILE = "/usr/local/share/ca-certificates/forkd-egress.crt"
BUNDLE = "/etc/ssl/forkd-bundle.pem"
MARKER = "# forkd egress CA"
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/ssl/cert.pem",
    "/etc/pki/tls/certs/ca-bundle.crt",
)
ENV = {
    "SSL_CERT_FILE": BUNDLE,
    "REQUESTS_CA_BUNDLE": BUNDLE,
    "PIP_CERT": BUNDLE,
    "GIT_SSL_CAINFO": BUNDLE,
    "NODE_EXTRA_CA_CERTS": CA_FILE,
}
# Run as root in the guest; paths are the module's constants, nothing a user gave.
_SCRIPT = f"""
set -e
mkdir -p /usr/local/share/ca-certificates /etc/ssl
found=""
for b in {" ".join(SYSTEM_BUNDLES)}; do
  if [ -f "$b" ] && [ ! -L "$b" ]; then
    grep -q "{MARKER}" "$b" || {{ printf '\\n{MARKER}\\n' >> "$b"; cat {CA_FILE} >> "$b"; }}
    [ -n "$found" ] || found="$b"
  fi
done
if [ -n "$found" ]; then cp "$found" {BUNDLE}; else cp {CA_FILE} {BUNDLE}; fi
chmod 644 {BUNDLE} {CA_FILE}
"""


async def install(guest: SandboxGuest, ca_pem: bytes, tag: str) -> dict[str, str]:
    """Put the CA in the guest's trust stores; the environment every command should
    get for it (to merge under the image's own). An image without a shell or a root
    user (distroless, scratch) gets the CA file and ``NODE_EXTRA_CA_CERTS`` at most:
    the build goes on, its runtimes' own stores as they are (logged)."""
    try:
        await guest.write_file(CA_FILE, ca_pem)
    except ForkdError as exc:
        log.warning("%s: the egress CA could not be written in the guest: %s", tag, exc)
        return {}
    try:
        ran = await guest.exec(["/bin/sh", "-c", _SCRIPT], timeout=60, user="root")
    except ForkdError as exc:
        ran = {"exit_code": None, "stdout": "", "stderr": str(exc)}
    if ran["exit_code"] != 0:
        tail = (ran["stderr"] or ran["stdout"]).strip()[-300:]
        log.warning(
            "%s: the egress CA is in %s only (no trust store updated): %s", tag, CA_FILE, tail
        )
        return {"NODE_EXTRA_CA_CERTS": CA_FILE}
    return dict(ENV)
