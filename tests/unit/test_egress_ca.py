"""The egress proxy's CA (forkd.egress.ca) and how the interceptor asks it for
certificates: off the event loop, a few at a time, from the cache when it can."""

from __future__ import annotations

import asyncio
import stat
import threading
from pathlib import Path

import pytest

from forkd.egress import intercept
from forkd.egress.ca import CAError, EgressCA
from forkd.egress.intercept import Interceptor, NoSecrets


def test_the_ca_is_made_once_its_key_private_and_kept(tmp_path: Path) -> None:
    first = EgressCA(tmp_path)
    key = tmp_path / "egress-ca" / "ca.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert EgressCA(tmp_path).pem == first.pem  # a restart keeps it
    key.chmod(0o644)
    with pytest.raises(CAError, match="0600"):
        EgressCA(tmp_path)


def test_certificates_are_minted_on_threads_a_few_at_once_and_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = EgressCA(tmp_path)
    minted_on: list[str] = []
    at_once = [0, 0]  # now, most
    mint = ca.server_context

    def counted(name: str) -> object:
        at_once[0] += 1
        at_once[1] = max(at_once[1], at_once[0])
        minted_on.append(threading.current_thread().name)
        try:
            return mint(name)
        finally:
            at_once[0] -= 1

    monkeypatch.setattr(ca, "server_context", counted)
    interceptor = Interceptor(ca, NoSecrets())

    async def main() -> None:
        names = [f"n{i}.test.example" for i in range(12)]
        await asyncio.gather(*(interceptor.server_context(n) for n in names))
        again = await interceptor.server_context(names[0])  # the cache: no thread
        assert again is ca.cached(names[0])

    asyncio.run(main())
    assert len(minted_on) == 12
    assert threading.main_thread().name not in minted_on
    assert at_once[1] <= intercept.MINTS
