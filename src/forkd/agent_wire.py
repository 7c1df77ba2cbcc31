"""The guest agent's wire format: each op's request and answer, and the bounds both
sides keep (docs/guest-agent.md).

One module for both ends of the channel. The daemon builds its requests from these
types and checks every answer against them (:mod:`forkd.wire_shape`: the guest is
untrusted);
the agent, which imports this file from ``/opt/forkd/forkd/`` as the daemon imports it
from the package, returns them from its handlers. mypy checks both sides, so a field
renamed on one side fails the type check, not a test with a real VM.

An answer field is ``NotRequired`` where an agent of an older snapshot may lack it (the
daemon then takes a default); everything a daemon reads without one is required.

Standard library only. Imported by the agent (Python 3.11 and later; not the eval
worker, which runs in whatever python3 a container image has). No ``from __future__
import annotations`` here: Python 3.11 only sees ``NotRequired`` in a TypedDict whose
annotations are evaluated.
"""

from collections.abc import Mapping
from typing import Any, Generic, Literal, NotRequired, TypedDict, TypeVar

# --------------------------------------------------------------------------- bounds

MAX_FILE_BYTES = 32 << 20  # file_read / file_write payload (base64 adds a third)
MAX_LIST_ENTRIES = 100_000  # file_list answers at most this many entries
MAX_CHUNK_BYTES = 1 << 20  # of data in one chunked write or read (file_*_range, tar)
MAX_OUTPUT_BYTES = 1 << 20  # exec: kept of each stream; the rest is counted as truncated
MAX_PROC_READ_BYTES = 1 << 20  # of output in one proc_read answer
MAX_PROC_STDIN_BYTES = 1 << 20  # of data in one proc_stdin request
RING_MAX_CHUNKS = 16384  # a process's output ring holds at most this many chunks
LISTED_CMD_CHARS = 2048  # proc_list cuts each command line to this many characters
MAX_STATS_PATHS = 64  # mount points one stats request asks about
MAX_MANIFEST_ENTRIES = 1_000_000  # entries one fs_manifest_open may ask for
MAX_LOWER_PATHS = 1000  # paths of one fs_lower_stat request


# --------------------------------------------------------------------------- ops


class Empty(TypedDict):
    """The answer of an op that reports nothing but success."""


class PingAnswer(TypedDict, total=False):
    pong: bool
    pid: int
    hostname: str
    uptime_s: float
    agent_version: str
    features: list[str]  # "payload": reads a chunk sent raw after its request's line
    # What the original forkd agent's ping said too.
    agent_lang: str
    numpy_version: str
    warmup_ready: bool


class ExecParams(TypedDict):
    argv: list[str]
    cwd: str | None
    env: dict[str, str] | None
    stdin: str | None
    timeout: float
    user: NotRequired[str]


class ExecAnswer(TypedDict):
    exit_code: int | None  # 124: timeout; 126, 127: could not be started; 128+N: signal N
    stdout: str
    stderr: str
    timed_out: NotRequired[bool]
    stdout_truncated: NotRequired[bool]
    stderr_truncated: NotRequired[bool]
    duration_ms: NotRequired[float | None]


class ConfigureParams(TypedDict):
    """An image's defaults, for every command that does not set its own."""

    env: dict[str, str]
    cwd: str | None
    user: str | None


class EnvSetParams(TypedDict):
    """Variables added to the image's environment, for every command started from now;
    ``cwd`` and ``user``, when given, replace the image's defaults."""

    env: dict[str, str]
    cwd: NotRequired[str]
    user: NotRequired[str]


class EvalParams(TypedDict):
    code: str
    timeout_s: float
    tag: NotRequired[str]
    context: NotRequired[str]  # an eval context's id (eval_context_open); none: the agent's


class EvalInterruptParams(TypedDict):
    context: NotRequired[str]


class EvalContextOpenParams(TypedDict):
    """An eval context of its own (E2B's code interpreter contexts): a worker process,
    ``python`` or ``javascript`` (Node.js), started at its first eval in ``cwd``."""

    context: str
    language: str
    cwd: NotRequired[str]


class EvalContextOpenAnswer(TypedDict):
    created: bool  # false: one of that id was open already


class EvalContextCloseParams(TypedDict):
    context: str


class EvalContextCloseAnswer(TypedDict):
    closed: bool  # false: there was none


class EvalPeekParams(TypedDict):
    tag: str  # the eval's, as it was run
    stdout_from: int  # characters of its stdout already seen
    stderr_from: int


class EvalPeekAnswer(TypedDict):
    running: bool  # the eval of that tag runs now (False: not yet, done, or not peekable)
    stdout: str  # what it printed since stdout_from
    stderr: str


class DisplayItem(TypedDict):
    mime: str  # image/png and image/jpeg: data is base64
    data: str


class EvalAnswer(TypedDict, total=False):
    result: str | None
    error: str | None  # the traceback
    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    display: list[DisplayItem]
    display_truncated: bool
    timed_out: bool


class EvalInterruptAnswer(TypedDict):
    interrupted: bool


class PathParams(TypedDict):
    path: str


class FileReadAnswer(TypedDict):
    data: str  # base64
    size: int


class FileWriteParams(TypedDict):
    path: str
    data: str  # base64
    mode: int
    append: NotRequired[bool]


class SizeAnswer(TypedDict):
    size: int


class FileListEntry(TypedDict):
    name: str
    type: str  # file, dir, symlink, other
    size: int
    mode: int
    mtime: float


class FileListAnswer(TypedDict):
    entries: list[FileListEntry]
    truncated: NotRequired[bool]


class FileRemoveParams(TypedDict):
    path: str
    recursive: bool


class FileRemoveAnswer(TypedDict, total=False):
    removed: bool


class UploadOpenParams(TypedDict):
    path: str
    format: Literal["file", "tar"]
    commit: bool  # the first chunk is the whole file: write it and answer path and size
    data: str  # base64


class UploadOpenAnswer(TypedDict):
    size: int
    transfer_id: NotRequired[str]  # to write the rest to (not with commit)
    payload: NotRequired[bool]  # the agent reads chunks sent raw after their request's line
    path: NotRequired[str]  # with commit: where it was written


class UploadWriteParams(TypedDict):
    transfer_id: str
    offset: int
    data: NotRequired[str]  # base64; absent when the chunk follows the line raw


class TransferParams(TypedDict):
    transfer_id: str


class CommitAnswer(TypedDict):
    size: int
    path: NotRequired[str]


class AbortAnswer(TypedDict, total=False):
    aborted: bool


class ReadRangeParams(TypedDict):
    path: str
    offset: int
    length: int
    raw: bool  # the bytes follow the answer's line, not as base64 in it


class ReadAnswer(TypedDict):
    """A read's answer. ``raw`` is not sent in the object: the daemon's client puts there
    the bytes that followed its line; an agent older than raw reads sends ``data``."""

    eof: bool
    size: NotRequired[int | None]  # file_read_range: the file's (None: not a regular file)
    data: NotRequired[str]  # base64
    raw: NotRequired[bytes]


class TarOpenParams(TypedDict, total=False):
    path: str  # a directory's content
    paths: list[str]  # or these files, named by their paths


class TransferIdAnswer(TypedDict):
    transfer_id: str


class TarReadParams(TypedDict):
    transfer_id: str
    length: int
    raw: bool


class ManifestParams(TypedDict):
    path: str
    max_entries: int


class ManifestAnswer(TypedDict):
    transfer_id: str  # read with file_tar_read
    lower: str  # the image's directory, to read what a file was before
    format: NotRequired[str]  # "records" (GNU find's) or "lines" (the agent's own walk)


class PathsParams(TypedDict):
    paths: list[str]


# What the image holds at a path: [type, mode, size, mtime, link target], "-" for none.
LowerStat = list[str | int | float | None]


class LowerStatAnswer(TypedDict):
    stats: list[LowerStat | None]


class PtySize(TypedDict):
    cols: int
    rows: int


class ProcStartParams(TypedDict):
    cmd: list[str] | str  # a string runs in the shell
    env: dict[str, str] | None
    cwd: str | None
    stdin: bool  # keep its stdin open for proc_stdin
    pty: PtySize | None
    timeout_s: float | None
    user: NotRequired[str]


class ProcInfo(TypedDict):
    pid: int
    cmd: list[str]
    pty: bool
    stdin: bool
    running: bool
    exit_code: int | None  # 124: timeout_s; 128+N: signal N
    started_at: float  # guest unix time
    ended_at: float | None
    output_end: int  # offset after the last byte of output
    output_start: int  # oldest offset still held


class ProcListAnswer(TypedDict):
    processes: list[ProcInfo]


class PidParams(TypedDict):
    pid: int


class ProcReadParams(TypedDict):
    pid: int
    offset: int
    wait_s: float
    max_bytes: int
    min_bytes: int
    linger_s: float
    raw: bool


class OutputChunk(TypedDict):
    stream: str  # stdout, stderr, pty
    offset: int
    size: NotRequired[int]  # raw: its bytes, in order, after the line
    data: NotRequired[str]  # else base64


OutputGap = TypedDict("OutputGap", {"from": int, "to": int})  # "from" is a keyword


class ProcReadAnswer(TypedDict):
    chunks: list[OutputChunk]
    next_offset: int
    gap: OutputGap | None
    running: bool
    exit_code: int | None
    eof: bool
    raw: NotRequired[bytes]  # put here by the daemon's client, as in ReadAnswer


class ProcStdinParams(TypedDict):
    pid: int
    data: str  # base64, at most MAX_PROC_STDIN_BYTES
    eof: bool


class ProcStdinAnswer(TypedDict):
    written: int


class ProcSignalParams(TypedDict):
    pid: int
    signal: int | str


class ProcResizeParams(TypedDict):
    pid: int
    cols: int
    rows: int


class CpuFigures(TypedDict):
    busy_s: float
    idle_s: float
    count: int


class Space(TypedDict):
    total_bytes: int
    used_bytes: int


class NetworkFigures(TypedDict):
    rx_bytes: int
    tx_bytes: int


class StatsAnswer(TypedDict, total=False):
    cpu: CpuFigures
    memory: Space
    disk: Space | None
    mounts: dict[str, Space | None]
    network: NetworkFigures
    processes: int
    load: list[float]


class RestoreParams(TypedDict):
    time_ns: int
    entropy: str  # base64
    hostname: str
    seed: NotRequired[int]  # Python's random seeded from it (a seeded fork)
    keep_random: NotRequired[bool]  # a seeded sandbox's resume: not a clone


class RestoreAnswer(TypedDict, total=False):
    clock_set: bool
    rng_reseeded: bool
    random_reseeded: bool
    hostname_set: bool
    seeded: bool
    errors: list[str]  # of the steps that failed
    timings_ms: dict[str, float]


# --------------------------------------------------------------------------- the table

P = TypeVar("P", bound=Mapping[str, object] | None)  # an op's request
A = TypeVar("A")  # and its answer


class Op(Generic[P, A]):
    """One op: its name on the wire, its request's type ``P`` and its answer's ``A``.
    Called with a request, it gives the :class:`Request` to send."""

    def __init__(self, name: str, answer: object) -> None:
        self.name = name
        self.answer = answer  # the TypedDict class A, which check() walks

    def __call__(self, params: P) -> "Request[A]":
        return Request(self, params)

    def __repr__(self) -> str:
        return f"Op({self.name!r})"


class Request(Generic[A]):
    """An op's request, ready to send; its answer is an ``A``."""

    def __init__(self, op: "Op[Any, A]", params: Mapping[str, object] | None) -> None:
        self.op = op
        self.params = params


PING: Op[None, PingAnswer] = Op("ping", PingAnswer)
EXEC: Op[ExecParams, ExecAnswer] = Op("exec", ExecAnswer)
CONFIGURE: Op[ConfigureParams, Empty] = Op("configure", Empty)
ENV_SET: Op[EnvSetParams, Empty] = Op("env_set", Empty)
EVAL: Op[EvalParams, EvalAnswer] = Op("eval", EvalAnswer)
EVAL_INTERRUPT: Op[EvalInterruptParams | None, EvalInterruptAnswer] = Op(
    "eval_interrupt", EvalInterruptAnswer
)
EVAL_CONTEXT_OPEN: Op[EvalContextOpenParams, EvalContextOpenAnswer] = Op(
    "eval_context_open", EvalContextOpenAnswer
)
EVAL_CONTEXT_CLOSE: Op[EvalContextCloseParams, EvalContextCloseAnswer] = Op(
    "eval_context_close", EvalContextCloseAnswer
)
EVAL_PEEK: Op[EvalPeekParams, EvalPeekAnswer] = Op("eval_peek", EvalPeekAnswer)
FILE_READ: Op[PathParams, FileReadAnswer] = Op("file_read", FileReadAnswer)
FILE_WRITE: Op[FileWriteParams, SizeAnswer] = Op("file_write", SizeAnswer)
FILE_LIST: Op[PathParams, FileListAnswer] = Op("file_list", FileListAnswer)
FILE_REMOVE: Op[FileRemoveParams, FileRemoveAnswer] = Op("file_remove", FileRemoveAnswer)
UPLOAD_OPEN: Op[UploadOpenParams, UploadOpenAnswer] = Op("file_upload_open", UploadOpenAnswer)
UPLOAD_WRITE: Op[UploadWriteParams, SizeAnswer] = Op("file_upload_write", SizeAnswer)
UPLOAD_COMMIT: Op[TransferParams, CommitAnswer] = Op("file_upload_commit", CommitAnswer)
TRANSFER_ABORT: Op[TransferParams, AbortAnswer] = Op("file_transfer_abort", AbortAnswer)
READ_RANGE: Op[ReadRangeParams, ReadAnswer] = Op("file_read_range", ReadAnswer)
TAR_OPEN: Op[TarOpenParams, TransferIdAnswer] = Op("file_tar_open", TransferIdAnswer)
TAR_READ: Op[TarReadParams, ReadAnswer] = Op("file_tar_read", ReadAnswer)
MANIFEST_OPEN: Op[ManifestParams, ManifestAnswer] = Op("fs_manifest_open", ManifestAnswer)
LOWER_STAT: Op[PathsParams, LowerStatAnswer] = Op("fs_lower_stat", LowerStatAnswer)
PROC_START: Op[ProcStartParams, ProcInfo] = Op("proc_start", ProcInfo)
PROC_LIST: Op[None, ProcListAnswer] = Op("proc_list", ProcListAnswer)
PROC_INFO: Op[PidParams, ProcInfo] = Op("proc_info", ProcInfo)
PROC_READ: Op[ProcReadParams, ProcReadAnswer] = Op("proc_read", ProcReadAnswer)
PROC_STDIN: Op[ProcStdinParams, ProcStdinAnswer] = Op("proc_stdin", ProcStdinAnswer)
PROC_SIGNAL: Op[ProcSignalParams, Empty] = Op("proc_signal", Empty)
PROC_RESIZE: Op[ProcResizeParams, Empty] = Op("proc_resize", Empty)
STATS: Op[PathsParams, StatsAnswer] = Op("stats", StatsAnswer)
RESTORE: Op[RestoreParams, RestoreAnswer] = Op("restore", RestoreAnswer)

# Every op above, by its name on the wire.
OPS: dict[str, Op[Any, Any]] = {op.name: op for op in globals().values() if isinstance(op, Op)}
