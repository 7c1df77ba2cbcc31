"""The blob store: a blob is kept only whole and checked, a refused one leaves nothing, two
writers of one blob both succeed, and removing what no image needs frees its bytes."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from forkd.errors import Invalid, UpstreamError
from forkd.image_import.blob_store import STALE_TEMP_SECS, BlobStore


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def store(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def leftovers(store: BlobStore) -> list[str]:
    return os.listdir(store.tmp_dir) if store.tmp_dir.exists() else []


def test_a_blob_is_stored_under_its_digest_and_found(store: BlobStore) -> None:
    data = b"layer" * 1000
    assert not store.has(digest(data)) and store.path(digest(data)) is None
    with store.writer(digest(data), len(data)) as w:
        for i in range(0, len(data), 777):
            w.write(data[i : i + 777])
        got, path = w.commit()
    assert got == digest(data) and path == store.root / "sha256" / digest(data)[7:]
    assert store.path(got) == path and path.read_bytes() == data
    assert store.read(got, len(data)) == data and store.read(got, 10) is None
    assert store.total_bytes() == len(data) and list(store.digests()) == [got]
    assert leftovers(store) == []


def test_a_blob_of_the_wrong_digest_or_size_is_refused_and_leaves_nothing(
    store: BlobStore,
) -> None:
    data = b"x" * 100
    with (
        pytest.raises(UpstreamError, match="digest"),
        store.writer(digest(b"y" * 100), 100, error=UpstreamError) as w,
    ):
        w.write(data)
        w.commit()
    with pytest.raises(Invalid, match="longer"), store.writer(digest(data), 99) as w:
        w.write(data)
    with pytest.raises(Invalid, match="stated"), store.writer(digest(data), 101) as w:
        w.write(data)
        w.commit()
    with store.writer(digest(data), 100) as w:  # given up on: an exception elsewhere
        w.write(data[:50])
    assert leftovers(store) == [] and list(store.digests()) == []


def test_digests_are_checked_before_they_become_names(store: BlobStore) -> None:
    for bad in ("sha256:../../etc/passwd", "sha512:" + "a" * 128, "sha256:" + "A" * 64, ""):
        with pytest.raises(Invalid):
            store.writer(bad, 1)
        with pytest.raises(Invalid):
            store.path(bad)


def test_two_writers_of_one_blob_at_once_both_succeed(store: BlobStore) -> None:
    data = os.urandom(8 << 20)
    barrier = threading.Barrier(4)
    results: list[object] = []

    def write() -> None:
        try:
            with store.writer(digest(data), len(data)) as w:
                barrier.wait()
                for i in range(0, len(data), 1 << 20):
                    w.write(data[i : i + (1 << 20)])
                results.append(w.commit()[0])
        except Exception as exc:  # reported below
            results.append(exc)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [digest(data)] * 4
    assert list(store.digests()) == [digest(data)] and store.total_bytes() == len(data)
    assert leftovers(store) == []


def test_removing_unreferenced_blobs_frees_what_no_image_needs(store: BlobStore) -> None:
    kept, dropped = store.put(b"k" * 10), store.put(b"d" * 1000)
    other = store.put(b"o" * 50)
    fd, stale = store.temp_file(".blob")
    os.write(fd, b"s" * 7)
    os.close(fd)
    old = time.time() - STALE_TEMP_SECS - 60
    os.utime(stale, (old, old))
    fd, live = store.temp_file(".blob")  # an import still writing
    os.close(fd)
    assert store.remove_unreferenced({kept}) == 1000 + 50 + 7
    assert list(store.digests()) == [kept] and not store.has(dropped) and not store.has(other)
    assert not stale.exists() and live.exists()
    assert store.remove_unreferenced({kept}) == 0
    assert BlobStore(store.root / "never").remove_unreferenced(set()) == 0
