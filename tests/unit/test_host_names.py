"""Destinations are compared in one canonical form, so no spelling of a name passes a
rule that lists it, or slips past one that denies it."""

from __future__ import annotations

import ipaddress

import pytest

from forkd.errors import Invalid
from forkd.host_names import canonical_name, name_matches, parse_destination, parse_destinations


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("API.Example.COM", "api.example.com"),
        ("api.example.com.", "api.example.com"),  # the trailing dot
        ("Bücher.example", "xn--bcher-kva.example"),  # IDNA
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("localhost", "localhost"),
    ],
)
def test_names_have_one_spelling(given: str, canonical: str) -> None:
    assert canonical_name(given) == canonical


@pytest.mark.parametrize(
    "given",
    [
        "",
        ".",
        "a..b",
        "-a.example",
        "a-.example",
        "a_b.example",
        "1.2.3.4",
        "::1",
        "example.123",
        "a" * 64 + ".example",
        "a b",
        "a/b",
        "a:443",
        "*.example",
        "x" * 2000,
    ],
)
def test_what_is_no_host_name_is_refused(given: str) -> None:
    assert canonical_name(given) is None


def test_entries_are_names_wildcards_addresses_networks_or_everything() -> None:
    assert parse_destination("*.Example.com.").text == "*.example.com"
    assert parse_destination("203.0.113.7").network == ipaddress.ip_network("203.0.113.7/32")
    assert parse_destination("203.0.113.7/32").text == "203.0.113.7"
    assert parse_destination("10.1.2.3/8").text == "10.0.0.0/8"
    assert parse_destination("2001:db8::/32").text == "2001:db8::/32"
    assert parse_destination("*").anything
    with pytest.raises(Invalid, match="not a host name after"):
        parse_destination("*.-bad")
    with pytest.raises(Invalid, match=r"not a host name, '\*\.domain', IP address or network"):
        parse_destination("http://example.com/")
    with pytest.raises(Invalid, match="every host"):
        parse_destination("*", names_only=True)
    with pytest.raises(Invalid, match="names"):
        parse_destination("10.0.0.0/8", names_only=True)


def test_a_wildcard_names_what_is_below_its_domain_only() -> None:
    rules = parse_destinations(["*.example.com", "api.test"])
    assert name_matches("a.b.EXAMPLE.com.", rules)
    assert name_matches("API.test", rules)
    for other in ("example.com", "badexample.com", "example.com.evil", "api.test.evil", "x"):
        assert not name_matches(other, rules), other


def test_duplicates_are_dropped_and_lists_bounded() -> None:
    assert [d.text for d in parse_destinations(["A.test", "a.test.", "b.test"])] == [
        "a.test",
        "b.test",
    ]
    with pytest.raises(Invalid, match="at most 2"):
        parse_destinations(["a.test", "b.test", "c.test"], limit=2)


@pytest.mark.parametrize("name", ["straße.example", "ς.example", "a\u200db.example"])
def test_names_idna_2003_and_2008_read_apart_are_refused(name: str) -> None:
    assert canonical_name(name) is None
    with pytest.raises(Invalid):
        parse_destination(name)
