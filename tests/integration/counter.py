"""A counter process for tests of processes that carry on across pauses, branches and
forks: it prints "N HOSTNAME" every 0.2 s, the hostname saying in which sandbox."""

from __future__ import annotations

import time
from collections.abc import Callable

from forkd.client import CommandHandle

COUNTER = "i=0; while :; do i=$((i+1)); echo $i $(cat /proc/sys/kernel/hostname); sleep 0.2; done"

Lines = list[tuple[int, str]]


def read_until(
    handle: CommandHandle, enough: Callable[[Lines], bool], timeout: float = 60
) -> Lines:
    """The counter's ``(N, hostname)`` lines from the handle's offset on, until ``enough``."""
    lines: Lines = []
    partial = ""
    deadline = time.monotonic() + timeout
    for stdout, _stderr, _pty in handle:
        partial += stdout or ""
        *whole, partial = partial.split("\n")
        lines += [(int(n), host) for n, host in (w.split(" ", 1) for w in whole)]
        if enough(lines):
            return lines
        assert time.monotonic() < deadline, f"the counter gave only {lines[-3:]}"
    raise AssertionError("the counter's output ended")
