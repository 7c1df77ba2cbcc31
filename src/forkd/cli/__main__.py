"""``python -m forkd.cli``: the ``forkd`` command, as tests and the launcher run it."""

from forkd.cli import main

main()
