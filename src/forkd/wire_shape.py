"""Whether a JSON value has the shape a type says: a ``TypedDict`` (required keys
present, each field of its type), a list, a dict, a union, a ``Literal`` or a JSON
scalar (an int is a number; a bool is neither). The daemon checks every answer of a
guest agent with it (:mod:`forkd.agent_wire` holds the types; the guest is untrusted).

Each type's checker is built once: an answer of 100,000 entries is checked on the
daemon's event loop, and a message is only written for the value that is wrong.
Standard library only.
"""

import functools
import types
import typing
from collections.abc import Callable
from typing import Any, Literal


class Malformed(ValueError):
    """A value that does not have its type's shape."""


def check(expected: object, value: object, what: str = "the answer") -> None:
    """Check that ``value`` has the shape of type ``expected``. Fields a ``TypedDict``
    does not name are left unchecked (a newer agent's). :class:`Malformed` says what is
    wrong and where: "the answer's 'entries'[3] is not a string"."""
    problem = _checker(expected)(value)
    if problem is not None:
        where, wrong = problem
        raise Malformed(f"{what}{where} {wrong}")


# What is wrong with a value and where in it ("'s 'entries'[3]", "is not a string"), or
# None.
Problem = tuple[str, str] | None
Checker = Callable[[object], Problem]


@functools.cache
def _checker(expected: Any) -> Checker:
    if expected is Any or expected is object:
        return lambda value: None
    if typing.is_typeddict(expected):
        return _object_checker(expected)
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin in (types.UnionType, typing.Union):
        return _union_checker(expected, tuple(_checker(option) for option in args))
    if origin is list:
        return _list_checker(_checker(args[0]))
    if origin is dict:
        return _dict_checker(_checker(args[1]))
    if origin is Literal:
        wrong = ("", f"is not one of {args}")
        return lambda value: None if value in args and not isinstance(value, bool) else wrong
    wrong = ("", f"is not {_name(expected)}")
    taken = _SCALARS.get(expected)
    if taken is None:  # a class of its own
        return lambda value: None if isinstance(value, expected) else wrong
    if expected is int or expected is float:  # a bool is not a number
        return lambda value: None if isinstance(value, taken) and type(value) is not bool else wrong
    return lambda value: None if isinstance(value, taken) else wrong


# The JSON scalars, and what each takes (an int is a number; None is null).
_SCALARS: dict[object, type | tuple[type, ...]] = {
    str: str,
    int: int,
    float: (int, float),
    bool: bool,
    bytes: bytes,
    None: type(None),
    type(None): type(None),
}


def _object_checker(typed: Any) -> Checker:
    required: frozenset[str] = getattr(typed, "__required_keys__")  # noqa: B009 - not on type
    fields = [(name, _checker(hint)) for name, hint in typing.get_type_hints(typed).items()]

    def check_object(value: object) -> Problem:
        if not isinstance(value, dict):
            return ("", "is not an object")
        missing = sorted(required - value.keys())
        if missing:
            return ("", f"has no {missing[0]!r}")
        for name, check_field in fields:
            if name in value:
                problem = check_field(value[name])
                if problem is not None:
                    return (f"'s {name!r}{problem[0]}", problem[1])
        return None

    return check_object


def _union_checker(expected: Any, options: tuple[Checker, ...]) -> Checker:
    wrong = ("", f"is not {_name(expected)}")

    def check_union(value: object) -> Problem:
        return None if any(option(value) is None for option in options) else wrong

    return check_union


def _list_checker(check_item: Checker) -> Checker:
    def check_list(value: object) -> Problem:
        if not isinstance(value, list):
            return ("", "is not a list")
        for i, each in enumerate(value):
            problem = check_item(each)
            if problem is not None:
                return (f"[{i}]{problem[0]}", problem[1])
        return None

    return check_list


def _dict_checker(check_item: Checker) -> Checker:
    def check_dict(value: object) -> Problem:
        if not isinstance(value, dict):
            return ("", "is not an object")
        for key, each in value.items():
            problem = check_item(each)
            if problem is not None:
                return (f"[{key!r}]{problem[0]}", problem[1])
        return None

    return check_dict


def _name(expected: object) -> str:
    names = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "true or false",
        bytes: "bytes",
        type(None): "null",
    }
    if typing.get_origin(expected) in (types.UnionType, typing.Union):
        return " or ".join(_name(option) for option in typing.get_args(expected))
    if isinstance(expected, type) and expected in names:
        return names[expected]
    return getattr(expected, "__name__", str(expected))
