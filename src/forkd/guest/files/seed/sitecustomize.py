"""Seeds Python's ``random`` from ``FORKD_SEED`` in every Python process of a sandbox
forked with a seed (the guest agent puts this directory first on ``PYTHONPATH`` and
sets ``FORKD_SEED`` for the commands it starts). The image's own ``sitecustomize``, if
it has one further along the path, still runs after this. Standard library only,
and any Python 3 the image brings.
"""

import importlib.machinery
import importlib.util
import os
import random
import sys

_seed = os.environ.get("FORKD_SEED", "")
if _seed.isdigit():
    random.seed(int(_seed))

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
