"""forkd guest agent: runs inside the VM and executes the host's requests.

Started by the guest's init as root (``python3 /opt/forkd/forkd-agent.py``) and
respawned if it dies. Standard library only.

Protocol (full reference: docs/guest-agent.md): newline-delimited JSON over a
byte stream, one UTF-8 object per line.

    host -> guest  {"id": 7, "op": "exec", "argv": ["ls", "/"]}
    guest -> host  {"id": 7, "ok": true, "result": {...}}
                   {"id": 7, "ok": false, "error": "message", "kind": "ValueError"}

Every request runs in its own thread, so many can be in flight; answers are
written in completion order, each as one whole line. Blank lines, lines that
are not JSON objects and requests without an integer id are ignored (a
snapshot may leave half a line behind; the host sends a lone newline first).

Background processes (ops ``proc_*``) outlive their request and the host
connection; forkd_procs.py, beside this file, runs them and keeps their output.

Transports: the virtio-serial port named "agent" (default), ``--device PATH``,
``--socket PATH`` (unix socket, for tests) or ``--stdio``.

Beside the virtio-serial channel, the agent serves the original forkd agent
protocol on TCP port 8888 (``--tcp``), which the host reaches at a sandbox's
guest_addr: one JSON request per connection (``ping``, ``exec``, ``eval``),
one JSON answer, then close.

This file is the command line; the agent's modules lie beside it:

    forkd_agent_transport.py    the channel: framing, request threads, port/socket/stdio
    forkd_agent_protocol.py     a request line in, its handler run, one answer line out
    forkd_agent_handlers.py     ping, exec, eval, whole files, restore, configure
    forkd_agent_proc_handlers.py  the proc_* ops (forkd_procs.py runs the processes)
    forkd_agent_params.py       a request's parameters, checked
    forkd_agent_command.py      a command's environment, directory, user and shell
    forkd_agent_legacy.py       the original forkd's TCP protocol (port 8888)
    forkd_agent_log.py          the agent's log lines on stderr
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable

# The agent's modules live beside it; the directory is on sys.path when the agent runs
# as a script, not when a test loads this file as a module.
_AGENT_DIR = os.path.dirname(os.path.abspath(__file__))
if _AGENT_DIR not in sys.path:
    sys.path.insert(0, _AGENT_DIR)
import forkd_agent_command  # noqa: E402
import forkd_agent_handlers as handlers  # noqa: E402
import forkd_agent_legacy as legacy  # noqa: E402
import forkd_agent_transport as transport  # noqa: E402
import forkd_eval_proc  # noqa: E402
import forkd_identity  # noqa: E402
from forkd_agent_log import log  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``tcp`` comes back as ``(host, port)`` or None."""
    parser = argparse.ArgumentParser(description="forkd guest agent")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--device", help="serve this character device instead of the 'agent' port")
    mode.add_argument("--socket", help="serve a unix socket at this path (host tests)")
    mode.add_argument("--stdio", action="store_true", help="serve stdin/stdout")
    parser.add_argument(
        "--tcp",
        metavar="[HOST:]PORT|off",
        help=f"also serve the TCP protocol here (default: {legacy.TCP_HOST}:{legacy.TCP_PORT} when "
        "serving the virtio port, off with --socket and --stdio)",
    )
    parser.add_argument(
        "--eval-in",
        choices=("auto", "agent", "image"),
        default="auto",
        help="where eval runs: this interpreter ('agent', a recipe image), a worker in the "
        "image's python3 ('image', a container image), or 'auto': 'image' when this agent "
        f"runs from forkd's runtime ({forkd_eval_proc.RUNTIME_PREFIX})",
    )
    parser.add_argument(
        "--defaults-file",
        default=forkd_identity.DEFAULTS_FILE,
        help="where the image's defaults (the configure op) are kept (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.tcp is None:
        args.tcp = "off" if (args.socket or args.stdio) else f"{legacy.TCP_HOST}:{legacy.TCP_PORT}"
    try:
        args.tcp = legacy.tcp_address(args.tcp)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    forkd_identity.DEFAULTS_FILE = args.defaults_file
    # A respawned agent: what it was told.
    forkd_agent_command.set_image_defaults(forkd_identity.load_defaults())
    if args.eval_in == "image" or (args.eval_in == "auto" and forkd_eval_proc.in_runtime()):
        handlers.use_image_python()
    sys.modules["__main__"] = handlers.EVAL_MODULE  # eval's namespace is the __main__ module
    # Evals run on this, the main thread: only it can be interrupted in a
    # blocking call. Claimed before any request can arrive.
    handlers.EVAL.claim_thread()
    # Every snapshot, even one taken before a request, has an idle one.
    transport.WORKERS.prestart()
    if args.tcp is not None:
        # From the template's boot on, so every fork inherits a listening socket.
        legacy.TcpServer(*args.tcp).start()
    if args.stdio:
        serve: Callable[[], None] = transport.serve_stdio
    elif args.socket:
        serve = lambda: transport.serve_socket(args.socket)  # noqa: E731
    else:
        serve = lambda: transport.serve_device(args.device)  # noqa: E731
    exit_code: list[int] = []
    serving = threading.Thread(target=_serve_then_stop, args=(serve, exit_code), name="serve")
    serving.daemon = True
    serving.start()
    handlers.EVAL.serve_forever()
    return exit_code[0] if exit_code else 0


def _serve_then_stop(serve: Callable[[], None], exit_code: list[int]) -> None:
    """Serve the host; when that ends (stdio at EOF) or fails, the agent exits."""
    try:
        serve()
        exit_code.append(0)
    except BaseException as exc:
        log(f"serving failed: {type(exc).__name__}: {exc}")
        exit_code.append(1)
    finally:
        handlers.EVAL.stop()


if __name__ == "__main__":
    sys.exit(main())
