"""Run the test suite and print the number of tests that passed, alone on the last line
of stdout (what a search over candidate patches ranks them by). A test passes when all
of it passes, its subtests included. unittest's report goes to stderr; the exit status
is 0 whatever the tests found.

Usage: python3 -B tools/score.py    (-B: leave no bytecode behind in the checkout)
"""

from __future__ import annotations

import sys
import unittest
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Counted(unittest.TextTestResult):
    """unittest's result, counting the tests that passed."""

    passed = 0

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self.passed += 1


def main() -> int:
    sys.path.insert(0, str(ROOT))
    suite = unittest.defaultTestLoader.discover(str(ROOT / "tests"), top_level_dir=str(ROOT))
    result = unittest.TextTestRunner(stream=sys.stderr, resultclass=Counted).run(suite)
    assert isinstance(result, Counted)
    print(result.passed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
