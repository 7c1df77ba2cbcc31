#!/usr/bin/env python3
"""Checkpoint every N turns: auto-branch an agent's sandbox, reproduce turn k later.

A long agent conversation accumulates state in its sandbox: variables in a
warm interpreter, files it wrote, results of tool calls that cannot be
replayed (network answers, random choices, timestamps). When turn 7 goes
wrong, or someone wants to debug what the agent saw at turn 6, re-running the
conversation from the start does not give the same state back. Here the agent
loop branches its sandbox every N turns (a pause of milliseconds, the
conversation goes on) and keeps a {turn: snapshot} map. Any checkpointed turn
can be forked later, even after the original sandbox is gone: the fork holds
exactly the state of that turn (checked with a digest of the interpreter
state and the files, computed in the guest at every turn), and the
conversation can continue from there in a new direction.

Run: ``python recipes/checkpoint-every-n/demo.py`` (uses the daemon at
``FORKD_URL``, or starts one for the duration of the demo).
"""

from __future__ import annotations

import argparse
import ast
import os
import secrets
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd import Controller, Sandbox, Snapshot
from forkd.demo import DEFAULT_URL, Checks, cleanup, create_template, ms, run_checks, timed

console = Console(highlight=False)

LOG = "/work/agent/log.jsonl"
# The agent's machinery, defined in the template's warm interpreter. Every
# turn mutates a dict, a counter, derived data and a file, with a nonce from
# os.urandom standing in for a tool result that cannot be replayed.
WARMUP = f"""\
import hashlib, json, os, random

LOG = {LOG!r}
state = {{'turn': 0, 'counter': 0, 'notes': [], 'scores': {{}}, 'derived': {{}}}}

def digest():
    h = hashlib.sha256(json.dumps(state, sort_keys=True).encode())
    if os.path.exists(LOG):
        with open(LOG, 'rb') as f:
            h.update(f.read())
    return h.hexdigest()

def agent_turn(k):
    nonce = os.urandom(4).hex()
    state['turn'] = k
    state['counter'] += k * k
    state['notes'].append(f'turn {{k}}: the tool answered {{nonce}}')
    state['scores'][f'turn{{k}}'] = random.random()
    chain = state['derived'].get('chain', '')
    state['derived'] = {{
        'n_notes': len(state['notes']),
        'best': max(state['scores'], key=state['scores'].get),
        'chain': hashlib.sha256((chain + nonce).encode()).hexdigest(),
    }}
    os.makedirs(os.path.dirname(LOG), exist_ok=True)
    with open(LOG, 'a') as f:
        f.write(json.dumps({{'turn': k, 'nonce': nonce, 'counter': state['counter']}}) + '\\n')
    return digest()
"""


def value(sb: Sandbox, code: str) -> Any:
    """The value of a Python expression evaluated in the sandbox."""
    res = sb.eval(code)
    if not res.ok or res.result is None:
        raise RuntimeError(f"{code!r} failed in {sb.id}: {res.error}")
    return ast.literal_eval(res.result)


def run(ctl: Controller, memory_mib: int, turns: int, every: int, check: Checks) -> None:
    prefix = f"ck-{secrets.token_hex(3)}"
    made: list[Sandbox] = []
    snaps: list[Snapshot] = []
    try:
        msg = f"building template {prefix}: boot a {memory_mib} MiB VM, snapshot"
        template, build_ms = create_template(
            ctl, prefix, console, msg, snaps, image="python", memory_mib=memory_mib, warmup=WARMUP
        )
        console.print(f"[bold]template[/] {prefix} ready in {ms(build_ms)}")
        (agent,), fork_ms = timed(lambda: template.fork(1))
        made.append(agent)
        console.print(f"[bold]{agent.id}[/]: the agent's sandbox, forked in {ms(fork_ms)}")

        digests: dict[int, str] = {}
        checkpoints: dict[int, Snapshot] = {}
        disturbed: list[int] = []  # turns whose state changed when branched
        table = Table("turn", "turn time", "state digest", "checkpoint", "pause", "branch wall")
        for k in range(1, turns + 1):
            digests[k], turn_ms = timed(lambda k=k: value(agent, f"agent_turn({k})"))
            row = [str(k), ms(turn_ms), digests[k][:12], "", "", ""]
            if k % every == 0:
                snap, branch_ms = timed(lambda k=k: agent.branch(tag=f"{prefix}-turn{k}"))
                snaps.append(snap)
                checkpoints[k] = snap
                row[3:] = [snap.tag, ms(snap.pause_ms), ms(branch_ms)]
                if value(agent, "digest()") != digests[k]:
                    disturbed.append(k)
            table.add_row(*row)
        console.print(table)
        check(
            f"agent loop ran {turns} turns, checkpoints at turns {sorted(checkpoints)}",
            sorted(checkpoints) == list(range(every, turns + 1, every))
            and value(agent, "state['turn']") == turns,
        )
        check(
            "branching never changed the agent's state (digest before == after)",
            not disturbed,
            f"changed at turns {disturbed}",
        )
        original_log = agent.files.read_text(LOG).splitlines()
        check(f"the agent's log has {turns} lines", len(original_log) == turns)

        agent.kill()
        console.print(
            f"[bold]{agent.id}[/] killed: the conversation's sandbox is gone, "
            f"its {len(checkpoints)} checkpoints remain"
        )

        replay = Table("turn", "fork", "recorded", "in the fork", "match", "continued")
        for k in (6, 3):
            if k not in checkpoints:
                check(f"turn {k} has a checkpoint", False, f"turns {sorted(checkpoints)}")
                continue
            (kid,), kid_ms = timed(lambda k=k: checkpoints[k].fork(1))
            made.append(kid)
            got = value(kid, "digest()")
            check(f"fork of turn {k} ({kid.id}): digest equals turn {k}'s", got == digests[k])
            check(
                f"fork of turn {k}: interpreter at turn {k}, log = first {k} lines",
                value(kid, "state['turn']") == k
                and kid.files.read_text(LOG).splitlines() == original_log[:k],
            )
            nxt = value(kid, f"agent_turn({k + 1})")
            log = kid.files.read_text(LOG).splitlines()
            counter = value(kid, "state['counter']")
            check(
                f"fork of turn {k}: continues with turn {k + 1}",
                value(kid, "state['turn']") == k + 1
                and len(log) == k + 1
                and log[:k] == original_log[:k]
                and counter == sum(i * i for i in range(1, k + 2))
                and nxt == value(kid, "digest()"),
            )
            diverged = "new history" if nxt != digests.get(k + 1) else "same as before"
            replay.add_row(
                str(k),
                ms(kid_ms),
                digests[k][:12],
                got[:12],
                "yes" if got == digests[k] else "NO",
                f"turn {k + 1}, {diverged}",
            )
        console.print(replay)
        console.print(
            "Turn k+1 in a fork draws fresh tool output (the fork gets fresh entropy), so "
            "the continued conversation is a new history from the exact turn-k state."
        )
    finally:
        cleanup(made, snaps, console, report=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory", type=int, default=256, help="guest memory in MiB")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--every", type=int, default=3, help="branch every N turns")
    parser.add_argument("--url", default=os.environ.get("FORKD_URL", DEFAULT_URL))
    args = parser.parse_args()
    return run_checks(
        args.url, console, lambda ctl, check: run(ctl, args.memory, args.turns, args.every, check)
    )


if __name__ == "__main__":
    sys.exit(main())
