"""Version strings such as 1.10.2 or v2.0.0-rc1: parse them, compare them, pick the newest."""


def parse(version: str) -> tuple:
    """The parts of ``version``, in the order they compare."""
    return tuple(version.strip().lstrip("v").split("."))


def compare(a: str, b: str) -> int:
    """-1, 0 or 1 as ``a`` is older than, the same as or newer than ``b``."""
    pa, pb = parse(a), parse(b)
    return (pa > pb) - (pa < pb)


def newest(versions: list[str]) -> str | None:
    """The newest of ``versions`` (the first of equals); None for none."""
    best = None
    for version in versions:
        if best is None or compare(version, best) > 0:
            best = version
    return best
