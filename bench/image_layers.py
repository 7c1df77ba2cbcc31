"""Image-layer flattening benchmark: layers merged and written as squashfs, MiB/s and memory.

Run from the repository root::

    python bench/image_layers.py                   # ~300 MiB, 3 layers; table, then JSON
    python bench/image_layers.py --many 1000000    # also: one layer of a million entries
    python bench/image_layers.py --json-only

It writes a synthetic image into ``--workdir`` (a temporary directory by default,
removed at the end): a gzip base layer of many small files (text-like, so they
compress as real ones do) and two big ones, a zstd layer that rewrites and whites
out part of it and adds a big file, and an uncompressed layer with a big random
file. Then a fresh interpreter runs
:func:`forkd.image_import.squash.build_rootfs` on them, timed, and reports:

- ``flatten_s``, ``flatten_mib_s``: wall time, and the layers' uncompressed tar
  bytes per second of it (``compressed_mib_s``: their blob bytes per second);
- ``peak_rss_mib``: the flattening process's peak RSS (VmHWM);
  ``tar2sqfs_peak_rss_mib`` the writer's, sampled every 20 ms;
- ``scratch_mib``: disk the layers' data files took in the scratch directory;
- ``entries``, ``file_mib``, ``image_mib``: what ``RootfsStats`` says.

With ``--many N``, one more layer of N empty files in 1000 directories is
flattened alone: ``many.flatten_s`` and ``many.peak_rss_mib`` (the tree's cost
per entry: ``many.rss_bytes_per_entry``). The last line of stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zstandard

MIB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------ the synthetic image


class LayerWriter:
    """One layer's tar, written as it goes (nothing held in memory beyond a file)."""

    def __init__(self, path: Path, compress: str) -> None:
        self.path = path
        self.raw = open(path, "wb")  # noqa: SIM115 (closed in close())
        if compress == "gzip":
            self.stream: Any = gzip.GzipFile(fileobj=self.raw, mode="wb", compresslevel=6)
        elif compress == "zstd":
            self.stream = zstandard.ZstdCompressor(level=3).stream_writer(self.raw)
        else:
            self.stream = self.raw
        self.tar = tarfile.open(fileobj=self.stream, mode="w|", format=tarfile.PAX_FORMAT)  # noqa: SIM115
        self.tar_bytes = 0

    def add(self, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE,
            link: str = "", mode: int = 0o644) -> None:  # fmt: skip
        info = tarfile.TarInfo(name)
        info.type = kind
        info.mode = mode
        info.mtime = 1_700_000_000
        info.linkname = link
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        self.tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        self.tar_bytes += 512 + -(-info.size // 512) * 512

    def close(self) -> None:
        self.tar.close()
        if self.stream is not self.raw:
            self.stream.close()
        self.raw.close()


def text(rng: random.Random, words: list[bytes], size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        out += b" ".join(rng.choices(words, k=64)) + b"\n"
    return bytes(out[:size])


def make_image(root: Path, seed: int) -> list[tuple[Path, int]]:
    """The three layers; (blob path, uncompressed tar bytes) of each."""
    rng = random.Random(seed)
    words = [os.urandom(rng.randint(2, 9)).hex().encode() for _ in range(4000)]
    made = []

    base = LayerWriter(root / "layer-1.tar.gz", "gzip")
    for d in range(500):
        base.add(f"usr/lib/pkg{d}", kind=tarfile.DIRTYPE, mode=0o755)
        for f in range(50):  # 25,000 small files, ~4 KiB each
            base.add(f"usr/lib/pkg{d}/f{f}", text(rng, words, rng.randint(200, 8000)))
        base.add(f"usr/lib/pkg{d}/link", kind=tarfile.SYMTYPE, link="f0")
        base.add(f"usr/lib/pkg{d}/hard", kind=tarfile.LNKTYPE, link=f"usr/lib/pkg{d}/f1")
    base.add("opt/big-text", text(rng, words, 40 * MIB))
    base.add("opt/big-random", os.urandom(40 * MIB))
    base.close()
    made.append((base.path, base.tar_bytes))

    middle = LayerWriter(root / "layer-2.tar.zst", "zstd")
    for d in range(0, 500, 5):
        middle.add(f"usr/lib/pkg{d}/.wh.f2", b"")
        for f in range(0, 50, 2):  # 2,500 files rewritten
            middle.add(f"usr/lib/pkg{d}/f{f}", text(rng, words, rng.randint(200, 8000)))
    middle.add("usr/lib/.wh.pkg499", b"")
    middle.add("opt/.wh.big-random", b"")
    middle.add("opt/data.bin", text(rng, words, 60 * MIB))
    middle.close()
    made.append((middle.path, middle.tar_bytes))

    top = LayerWriter(root / "layer-3.tar", "plain")
    for f in range(2000):
        top.add(f"srv/app/m{f}.py", text(rng, words, rng.randint(500, 3000)))
    top.add("srv/app/model.bin", os.urandom(48 * MIB))
    top.close()
    made.append((top.path, top.tar_bytes))
    return made


def make_many(root: Path, entries: int) -> tuple[Path, int]:
    """One gzip layer of ``entries`` empty files in 1000 directories."""
    layer = LayerWriter(root / "many.tar.gz", "gzip")
    per_dir = max(1, entries // 1000)
    made = 0
    for d in range(1000):
        layer.add(f"d{d}", kind=tarfile.DIRTYPE, mode=0o755)
        made += 1
        for f in range(per_dir):
            if made >= entries:
                break
            layer.add(f"d{d}/file-number-{f}")
            made += 1
    layer.close()
    return layer.path, layer.tar_bytes


# ------------------------------------------------------------------ flattening, measured


def flatten(blobs: list[str], out: str, work: str) -> dict[str, Any]:
    """In a fresh interpreter: build_rootfs on the blobs, timed, with peak RSS."""
    from forkd.image_import.model import LayerBlob
    from forkd.image_import.squash import build_rootfs

    layers = [LayerBlob(f"sha256:{i:064x}", os.path.getsize(b), "bench", Path(b))
              for i, b in enumerate(blobs)]  # fmt: skip
    writer_peak = [0]
    stop = threading.Event()
    watcher = threading.Thread(target=_watch_children, args=(writer_peak, stop), daemon=True)
    watcher.start()
    started = time.monotonic()
    stats = build_rootfs(layers, Path(out), Path(work))
    elapsed = time.monotonic() - started
    stop.set()
    watcher.join()
    scratch = sum(p.stat().st_blocks * 512 for p in Path(work).iterdir() if p.is_file())
    return {
        "flatten_s": elapsed,
        "entries": stats.entries,
        "file_mib": stats.file_bytes / MIB,
        "image_mib": stats.image_bytes / MIB,
        "scratch_mib": scratch / MIB,
        "peak_rss_mib": _hwm_kib("self") / 1024,
        "tar2sqfs_peak_rss_mib": writer_peak[0] / 1024,
    }


def _hwm_kib(pid: str) -> int:
    """VmHWM: peak RSS of this process image (ru_maxrss would carry the parent's over
    fork and exec)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def _watch_children(peak: list[int], stop: threading.Event) -> None:
    """The largest VmHWM any child (tar2sqfs) reached, sampled every 20 ms."""
    while not stop.wait(0.02):
        for task in Path("/proc/self/task").iterdir():
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in children:
                peak[0] = max(peak[0], _hwm_kib(child))


def run_flatten(blobs: list[tuple[Path, int]], root: Path, name: str) -> dict[str, Any]:
    work = root / f"work-{name}"
    work.mkdir()
    argv = [sys.executable, __file__, "--flatten", str(root / f"{name}.sqfs"), str(work),
            *[str(p) for p, _ in blobs]]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"flattening failed:\n{done.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    tar_mib = sum(size for _, size in blobs) / MIB
    blob_mib = sum(p.stat().st_size for p, _ in blobs) / MIB
    result["layers_tar_mib"] = tar_mib
    result["layers_blob_mib"] = blob_mib
    result["flatten_mib_s"] = tar_mib / result["flatten_s"]
    result["compressed_mib_s"] = blob_mib / result["flatten_s"]
    shutil.rmtree(work)
    return result


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--flatten":
        out, work, *paths = sys.argv[2:]
        print(json.dumps(flatten(paths, out, work)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="where the layers and images go")
    parser.add_argument("--many", type=int, default=0, help="also flatten N empty files")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json-only", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="forkd-bench-layers-", dir=args.workdir))
    try:
        started = time.monotonic()
        blobs = make_image(root, args.seed)
        report: dict[str, Any] = {"generate_s": time.monotonic() - started}
        report.update(run_flatten(blobs, root, "image"))
        if args.many:
            many = run_flatten([make_many(root, args.many)], root, "many")
            many["rss_bytes_per_entry"] = many["peak_rss_mib"] * MIB / many["entries"]
            report["many"] = many
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = json.loads(json.dumps(report), parse_float=lambda v: round(float(v), 2))
    if not args.json_only:
        for key, value in report.items():
            if isinstance(value, dict):
                for sub, v in value.items():
                    print(f"{key}.{sub:<28} {v}")
            else:
                print(f"{key:<33} {value}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
