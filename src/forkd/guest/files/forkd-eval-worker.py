"""Start forkd's eval worker in an image's own Python, or say why it cannot run there.

The agent runs ``<the image's python3> /opt/forkd/forkd-eval-worker.py`` with its
request pipe on stdin and its answer pipe on stdout. This file is kept to syntax
every Python parses (2.7 too), so that one older than forkd_eval supports
still answers, with its version, instead of failing to compile. Then it moves
the pipes off fds 0 and 1 (user code that writes to fd 1 must not reach the
protocol), loads forkd_eval and forkd_eval_worker from beside this file without
putting this directory on sys.path, and serves (forkd_eval_worker.serve).
"""

import json
import os
import sys
import types  # noqa: F401 (named in the type comments)

MIN_PYTHON = (3, 8)


def _say(message):  # type: (dict[str, object]) -> None
    os.write(1, (json.dumps(message) + "\n").encode("ascii"))


def _load(name, directory):  # type: (str, str) -> types.ModuleType
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, os.path.join(directory, name + ".py"))
    if spec is None or spec.loader is None:
        raise ImportError("cannot load " + name + " from " + directory)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main():  # type: () -> int
    version = ".".join(str(part) for part in sys.version_info[:3])
    if tuple(sys.version_info[:2]) < MIN_PYTHON:
        _say({"error": "python_too_old", "python": version, "executable": sys.executable})
        return 3
    here = os.path.dirname(os.path.abspath(__file__))
    # As in a REPL: the working directory, not forkd's, is where imports look first.
    sys.path[:] = [""] + [entry for entry in sys.path if entry != here]
    sys.argv[:] = [""]
    in_fd, out_fd = os.dup(0), os.dup(1)  # not inherited by what user code starts
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    _load("forkd_eval", here)
    worker = _load("forkd_eval_worker", here)
    worker.serve(in_fd, out_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
