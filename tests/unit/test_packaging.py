"""pyproject.toml as setuptools reads it: a license of the form that keeps building after
setuptools drops the table form (2027-02-18), so an install prints no deprecation wall."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_the_license_is_an_spdx_expression_and_setuptools_reads_it() -> None:
    meta = tomllib.loads(PYPROJECT.read_text())
    assert meta["project"]["license"] == "Apache-2.0"  # not {text = ...}: deprecated
    assert not any(c.startswith("License ::") for c in meta["project"].get("classifiers", []))
    (setuptools,) = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    floor = re.fullmatch(r"setuptools>=(\d+)", setuptools)
    assert floor and int(floor[1]) >= 77, setuptools  # the first to read PEP 639's form
