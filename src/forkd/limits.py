"""Defaults and bounds of every value a user sets, and the checks on names.

One place for what the HTTP models, the services, the VM driver, the image
recipes and the volume store would otherwise each define for themselves.
Standard library only: the SDK may import it.
"""

from __future__ import annotations

import re
from pathlib import Path

from forkd.errors import Invalid

# Names: snapshot tags, volume names, image recipe names.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
NAME_RE = re.compile(NAME_PATTERN)
NAME_RULE = "1-64 characters of A-Z, a-z, 0-9, '_' and '-'"

# Secrets (forkd.controller.services.secrets): a name, as ${secrets.NAME} places it.
SECRET_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$"
SECRET_NAME_RULE = "1-64 characters of A-Z, a-z, 0-9, '_' and '-', not starting with a digit or '-'"
SECRET_PLACEHOLDER = re.compile(r"\$\{secrets\.([A-Za-z_][A-Za-z0-9_-]{0,63})\}")
# A value goes into HTTP headers: visible ASCII, spaces and tabs (no CR, LF or NUL).
# ... and no space or tab at either end (HTTP would strip it, h11 refuses it).
SECRET_VALUE_PATTERN = r"^[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?$"
MAX_SECRET_VALUE_CHARS = 8192
MAX_SECRETS = 1000
MAX_SECRET_HOSTS = 32

# Guest machine.
MIN_MEMORY_MIB = 128  # the Debian kernel + Python guest does not boot in less
MAX_MEMORY_MIB = 65536
DEFAULT_MEMORY_MIB = 512
MAX_VCPUS = 64
DEFAULT_VCPUS = 1

# Waits, in seconds.
BOOT_TIMEOUT_SECS = 90.0  # cold boot until the agent answers
MAX_BOOT_TIMEOUT_SECS = 3600.0
RESTORE_TIMEOUT_SECS = 30.0  # fork until the agent answers
SETUP_TIMEOUT_SECS = 900.0  # each template setup command and warm-up
READY_TIMEOUT_SECS = 120.0  # a container image's started service until it is ready
EXEC_TIMEOUT_SECS = 30.0
MAX_EXEC_TIMEOUT_SECS = 86400.0
EVAL_TIMEOUT_SECS = 60.0  # an eval's default timeout_s; then it is interrupted
MAX_EVAL_TIMEOUT_SECS = 86400.0
MAX_SANDBOX_TIMEOUT_SECS = 30 * 86400.0
EXPLORE_TIMEOUT_SECS = 300.0  # an explore's variants and scores, from its branch on
DEFAULT_PREVIEW_TTL_SECS = 3600  # a preview URL's life
MAX_PREVIEW_TTL_SECS = 7 * 86400
PORT_CONNECT_SECS = 10.0  # the daemon's connection to a guest port
PORT_HEAD_SECS = 60.0  # a proxied request's answer head, once its body was sent

# Counts.
MAX_FORK_N = 1000
MAX_EXPLORE_VARIANTS = 100  # children of one explore (POST /v1/sandboxes/{id}/explore)
EXPLORE_STDOUT_TAIL = 2048  # characters of a variant's stdout in its result
# GET /v1/sandboxes/{id}/diff: the changed paths a manifest may list (more: truncated),
# the bytes it may take, and what a patch shows.
MAX_DIFF_ENTRIES = 200_000
MAX_MANIFEST_BYTES = 64 << 20
PATCH_FILE_MAX_BYTES = 512 << 10  # a text file larger is "differs", not a hunk
PATCH_MAX_BYTES = 8 << 20  # a patch longer is cut, and says so
PATCH_MAX_FILES = 2000
MAX_SETUP_COMMANDS = 100
MAX_VOLUMES_PER_VM = 8
# Diff layers over a full snapshot that a fork resolves; a deeper diff branch is a 409
# (compact the chain first). Deeper on disk: the chain is called broken (a loop).
MAX_DIFF_DEPTH = 64
# Labels (``metadata``) on snapshots and sandboxes, filtered on by the list routes.
MAX_METADATA_PAIRS = 64
METADATA_KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"
MAX_METADATA_VALUE_CHARS = 256
MIN_MEMORY_LIMIT_MIB = 64

# A fork's seed (POST /v1/sandboxes "seed"): child i gets seed + i, a non-negative
# integer every JSON client takes whole (seed + i stays under it: checked).
MAX_SEED = (1 << 53) - 1  # JavaScript's largest exact integer: the TS SDK reads it too

# Admission (forkd serve --max-sandboxes, --memory-overcommit or --max-guest-memory,
# --memory-reserve): over a cap is a 429. Sandboxes are admitted by the host memory
# they really take (forkd.controller.services.host_memory); CPU is shared by the
# scheduler and shows in metrics, never in refusals. docs/RUNBOOK.md, "Sizing a host",
# has the figures these come from (2 cores, 24 GiB, TCG).
# An idle fork of a 256 MiB template holds 27 MiB of its own, 40 once it ran a command:
# what a new sandbox is counted at until three of its siblings have run.
FORK_ESTIMATE_MIB = 48
# Guest RAM given to sandboxes, over the host's RAM: what they would take if every
# guest filled its memory at once. Forks hold a tenth to a sixth of theirs, so 4 leaves
# room to spare for 300 idle 256 MiB forks on 24 GiB (3.1) while bounding the worst case.
MEMORY_OVERCOMMIT = 4.0
HOST_RESERVE_MIB = 1024  # the least kept for the host, the daemon and snapshots' hot pages
DISK_RESERVE_MIB = 1024  # free disk a VM's memory is never written into (--disk-reserve)
MAX_SANDBOXES_CEILING = 1000  # the most forks one request asks (the original's n)
# Reclaim (forkd serve --reclaim-low, --reclaim-high, --reclaim-idle): when the host's
# available memory falls under the low watermark, idle sandboxes are hibernated, the
# least recently used first, until the high one is available again. Twice and three
# times the reserve: reclaim starts well before admission refuses (at the reserve).
RECLAIM_LOW_RESERVES = 2
RECLAIM_HIGH_RESERVES = 3
RECLAIM_IDLE_SECS = 60.0  # no request and no process output this long: idle
# /metrics has series labelled by sandbox for at most this many (those holding the most
# host memory): a scrape of a host with a thousand sandboxes stays bounded.
SANDBOX_SERIES_CAP = 200

# Request bodies.
JSON_BODY_LIMIT = 1 << 20  # the JSON routes
FILE_BODY_LIMIT = 32 << 20  # volume archives, read whole before the app sees them
# A file upload streams to the guest in chunks: the guest's free space is the real
# bound; this one (forkd serve --max-upload-mib) only stops an endless body.
FILE_UPLOAD_LIMIT = 64 << 30
# An imported container image's files, expanded (forkd serve --max-image-mib): what one
# layer, and all of them merged, may unpack to; a gzip bomb stops here.
MAX_IMAGE_BYTES = 64 << 30
# Entries in one layer, and in an image's merged tree (forkd serve --max-image-entries):
# merging costs CPU by the entry (a 7 MB layer of 999,000 entries cost ten minutes).
MAX_IMAGE_ENTRIES = 400_000
# All of one image import, fetching and flattening (forkd serve --import-timeout).
IMPORT_TIMEOUT_SECS = 3600.0

# What a guest may make the daemon read and wait for (forkd.vmm.agent.client).
# Answer lines, by op, sized from the agent's own caps (docs/guest-agent.md):
AGENT_LINE_MAX_BYTES = 4 << 20  # file_write, proc_start, proc_info: a command line at most
# ping and restore (asked at every boot, fork, wake and resume, unasked by any user) and
# the other ops whose answer is a few fields: a few hundred bytes.
AGENT_SMALL_LINE_MAX_BYTES = 64 << 10
AGENT_STATS_LINE_MAX_BYTES = 64 << 10  # stats: its figures and up to 8 mount points
# proc_list, asked by the idle check of a guest that may be hostile: 128 processes, each
# command line cut to 2048 characters (agent_wire.LISTED_CMD_CHARS) of up to 6 bytes as
# JSON. 2 MiB of the worst JSON parses in ~50 ms; 16 MiB took half a second of the loop.
AGENT_LISTING_LINE_MAX_BYTES = 2 << 20
# exec: 2 streams of 1 MiB; JSON escaping makes a byte at most 6 ("\ufffd"): 12 MiB.
# eval (3 x 1 Mi chars, ASCII or BMP text) and file_list (100 000 entries) fit too.
AGENT_OUTPUT_LINE_MAX_BYTES = 16 << 20
EVAL_DISPLAY_MAX_BYTES = 8 << 20  # an eval's display outputs as JSON (the agent's cap)
AGENT_EVAL_LINE_MAX_BYTES = AGENT_OUTPUT_LINE_MAX_BYTES + EVAL_DISPLAY_MAX_BYTES
AGENT_FILE_LINE_MAX_BYTES = 48 << 20  # file_read: 32 MiB as base64 is 42.7 MiB
AGENT_READ_LINES_PER_SEC = 2000  # per VM; the agent writes one line per answer
AGENT_READ_BYTES_PER_SEC = 64 << 20  # per VM; the largest answer passes in one burst
# A pause or snapshot waits this long for a request or an upload chunk still crossing
# the agent channel (a 1 MiB chunk takes ~25 ms under TCG); then it is a 503 to retry.
AGENT_HOLD_SECS = 10.0
AGENT_WRITE_STALL_SECS = 10.0  # a guest taking none of a request for this long is aborted
AGENT_CLOSE_SECS = 2.0  # closing a VM's channels (agent, QMP)
KILL_WAIT_SECS = 10.0  # for QEMU to exit after SIGKILL

# Lifecycle events (GET /v1/events). A stream holds only its place in the ring, so a
# client that stops reading costs nothing; one that falls this far behind gets a gap.
EVENT_RING_SIZE = 1000  # recent events kept for replay (Last-Event-ID)
MAX_EVENT_SUBSCRIBERS = 64  # event streams open at once; one more is a 429
EVENT_HEARTBEAT_SECS = 15.0  # a comment on a quiet stream, so proxies keep it open

# Client connections to the daemon and the gateway (forkd.controller.connection_limits).
# A client sends its request head in one write: 10 s is room for a stalled link, and
# more than httpx's 5 s keep-alive expiry, so an idle client closes before the server.
REQUEST_HEADER_TIMEOUT_SECS = 10.0  # connect, or the end of an answer, to a whole request head
REQUEST_BODY_IDLE_TIMEOUT_SECS = 30.0  # no byte of a body being read (its source may stall)
MAX_CONNECTIONS = 1024  # open at once (WebSockets too); less when descriptors are few
# A quarter of the total: one host never holds more, yet one SDK client's pool (100),
# its event streams and terminals fit. Behind a proxy every client has its address.
MAX_CONNECTIONS_PER_ADDRESS = 256
# A keep-alive connection that never sent the token is closed when it goes idle this
# long after it opened (a browser on a preview URL opens another at once).
UNAUTHENTICATED_KEEPALIVE_SECS = 60.0

# Volume content archives (the upload is capped above; what it expands to, here).
VOLUME_MAX_ENTRIES = 100_000  # files, directories and links in one archive
VOLUME_BYTES_PER_ENTRY = 4096  # and one per 4 KiB of volume: ext4's inode ratio for small disks
VOLUME_TAR_HEADER_LIMIT = 1 << 20  # one long-name or pax header, read whole into memory

# The audit log.
AUDIT_LOG_MAX_BYTES = 64 << 20  # then audit.log becomes audit.log.1
AUDIT_LOG_FILES = 4  # rotated files kept: audit.log.1 .. audit.log.4
AUDIT_FIELD_LIMIT = 256  # characters of one client-controlled field (path, client)
AUDIT_401_PER_SEC = 10  # 401 records a second per client address; then one summary line
AUDIT_401_CLIENTS = 64  # addresses counted apart in one second; the rest share one count
AUDIT_WARN_INTERVAL_SECS = 60.0  # at most one daemon-log warning this often about failed writes


def check_name(name: object, what: str = "tag") -> str:
    """``name`` if it is a valid tag or volume name, else :class:`Invalid`."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise Invalid(f"invalid {what} {name!r}: {what}s are {NAME_RULE}")
    return name


def check_tag(tag: object) -> str:
    return check_name(tag, "tag")


def check_memory_mib(memory_mib: int) -> int:
    if not MIN_MEMORY_MIB <= memory_mib <= MAX_MEMORY_MIB:
        raise Invalid(
            f"memory_mib must be between {MIN_MEMORY_MIB} and {MAX_MEMORY_MIB}, not {memory_mib}"
        )
    return memory_mib


def check_vcpus(vcpus: int) -> int:
    if not 1 <= vcpus <= MAX_VCPUS:
        raise Invalid(f"vcpus must be between 1 and {MAX_VCPUS}, not {vcpus}")
    return vcpus


def default_memory_reserve_mib(host_mib: int | None = None) -> int:
    """Host memory admission keeps free: a sixteenth of the RAM, at least 1 GiB."""
    host = host_memory_mib() if host_mib is None else host_mib
    return max(HOST_RESERVE_MIB, host // 16)


def default_reclaim_watermarks(reserve_mib: int) -> tuple[int, int]:
    """The low and high watermarks of reclaim for a reserve of ``reserve_mib``."""
    return reserve_mib * RECLAIM_LOW_RESERVES, reserve_mib * RECLAIM_HIGH_RESERVES


def default_max_sandboxes(host_mib: int | None = None) -> int:
    """As many sandboxes as the host's memory holds at FORK_ESTIMATE_MIB each, above
    the reserve (at most MAX_SANDBOXES_CEILING, at least 1)."""
    host = host_memory_mib() if host_mib is None else host_mib
    room = host - default_memory_reserve_mib(host)
    return max(1, min(MAX_SANDBOXES_CEILING, room // FORK_ESTIMATE_MIB))


def host_memory_mib(meminfo: Path = Path("/proc/meminfo")) -> int:
    """This host's RAM (MemTotal), in MiB."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) >> 10
    raise ValueError(f"no MemTotal in {meminfo}")


def overcommitted_guest_memory_mib(ratio: float, host_mib: int | None = None) -> int:
    """The nominal cap: guest RAM given to sandboxes, ``ratio`` times the host's RAM."""
    host = host_memory_mib() if host_mib is None else host_mib
    return max(MIN_MEMORY_MIB, int(ratio * host))


def default_pool_memory_mib(host_mib: int | None = None) -> int:
    """Host memory the fork pool's waiting QEMUs may hold: a sixteenth of the host's
    RAM, between 256 MiB and 4 GiB."""
    host = host_memory_mib() if host_mib is None else host_mib
    return min(4096, max(256, host // 16))


def default_max_connections(descriptors: int | None = None) -> int:
    """``MAX_CONNECTIONS``, or half this process's descriptor limit when that is less:
    the other half stays for the VMs' sockets, pipes and files, which a flood of
    connections would otherwise starve (``accept`` itself fails at the limit)."""
    return max(1, min(MAX_CONNECTIONS, _open_file_limit(descriptors) // 2))


def default_max_proxied(descriptors: int | None = None) -> int:
    """``MAX_CONNECTIONS``, or a quarter of this process's descriptor limit when that is
    less: connections a process opens onward for its clients' (a guest port's, a
    gateway's node's), beside the clients' own half."""
    return descriptor_share(MAX_CONNECTIONS, descriptors)


def descriptor_share(most: int, descriptors: int | None = None) -> int:
    """Connections opened onward for clients: ``most``, or a quarter of this process's
    descriptor limit when that is less (each holds two, the client's and its own)."""
    return max(1, min(most, _open_file_limit(descriptors) // 4))


def _open_file_limit(descriptors: int | None) -> int:
    if descriptors is not None:
        return descriptors
    import resource  # Unix only; the SDK, which imports this module, may run elsewhere

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS * 4 if soft == resource.RLIM_INFINITY else soft


def check_guest_path(path: object) -> str:
    """A path inside the sandbox: absolute, no NUL byte."""
    if not isinstance(path, str) or not path:
        raise Invalid("path is required")
    if "\x00" in path:
        raise Invalid("path must not contain a NUL byte")
    if not path.startswith("/"):
        raise Invalid(f"path must be absolute (start with '/'), got {path!r}")
    return path
