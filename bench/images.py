"""Container-image benchmark: imports from a loopback registry, a template from an image,
and forks from it beside forks from a recipe template.

Run from the repository root::

    python bench/images.py                 # table on stdout, then one JSON line
    python bench/images.py --json-only     # only the JSON line

It starts Debian's ``docker-registry`` on loopback and pushes two images to it
(bench/image_fixture.py): the first is the ``python`` recipe's Debian tree
(minbase + python3, gzip) with ``--big-mib`` MiB of files on top (a layer with
a big incompressible file and 400 modules, gzip; a big text file, zstd) and a
small top layer of its own; the second shares every layer but the top, which
brings 12 MiB of its own. Both serve ``/srv/app`` with ``python3 -m
http.server``. Every run labels their configs anew, and imports into a blob
store of its own, so the first import is a first fetch and a first build (what
a host makes once for every image, forkd's runtime disk, kernel and initramfs, is
made beforehand). Then, the same steps the daemon runs (``snapshot create --image REF --start
--ready-port``), each timed, through forkd's own functions and VM driver:

1. ``import_first``: the first image fetched (``fetch_s``, ``fetch_mib_s``:
   bytes fetched per second), flattened (``flatten_s``, ``flatten_mib_s``: its
   layers' uncompressed bytes per second) and built (``build_other_s``: kernel,
   initramfs, runtime disk, commit), ``total_s`` and ``import_mib_s`` (bytes
   fetched per second of the whole import); ``import_again``: the same
   reference a second time (only its manifest is read; the build is found);
2. ``template_image``: a ``--memory`` MiB template booted from it
   (``boot_s``), its Cmd started until the port listens (``start_s``), its
   snapshot (``snapshot_s``); ``ready_template_s`` adds the first import;
3. ``import_shared_base``: the second image, fetching only its own layer;
4. a template of the ``python`` recipe image of the same size running the same
   server, then ``--forks`` forks of each template, alternating, each killed
   after its first command: ``fork_{image,recipe}_ms_p50/p95`` (QEMU start to the
   agent's answer after the restore) and their ratio
   ``fork_image_vs_recipe_p50`` (target ≤ 1.2: an image must not make forks
   slower); ``fork_{image,recipe}_cpu_ms_p50``, the CPU its QEMU used until
   then (in clock ticks of 10 ms, but barely moved by other work on the host),
   and their ratio. The first fork of each is checked to serve its page.

Every VM is killed, the registry stopped, the images built here removed and the
work dir deleted at the end, also on failure or Ctrl-C. The last line of stdout
is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from forkd import accel, paths
from forkd.controller.models import SnapshotCreate
from forkd.controller.services import template_start
from forkd.errors import ImageError
from forkd.guest import container_image, kernel, recipe, runtime
from forkd.guest import image as guest_image
from forkd.image_import.blob_store import BlobStore
from forkd.image_import.fetch import fetch_image
from forkd.oci.policy import RegistryPolicy
from forkd.vmm.vm import VM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # see bench/fork.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' registry helper
from tests.registry_server import RegistryServer

import benchlib
import image_fixture
from benchlib import MIB, allocated_mib, judge, percentile, r1

PORT = 8000
READY_SECS = 60.0
TARGETS = {"fork_image_vs_recipe_p50": ("fork_image_vs_recipe_p50", "<=", 1.2)}
PAGE_CHECK = (
    f"import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:{PORT}/').status)"
)


def r2(value: float) -> float:
    return round(value, 2)


class ImagesBench(benchlib.BenchBase):
    def __init__(self, args: argparse.Namespace, workdir: Path, say: Console) -> None:
        super().__init__(args, workdir, say)
        self.registry: RegistryServer | None = None
        self.store = BlobStore(workdir / "blobs")
        self.built: list[guest_image.Image] = []  # removed at the end
        self.run_label = secrets.token_hex(8)
        self.tar_mib: dict[str, float] = {}  # per reference: its layers uncompressed

    # -------------------------------------------------------------- setup

    def prepare(self) -> tuple[str, str]:
        """The two images pushed to a fresh registry (their references); forkd's runtime
        disk, kernel and initramfs made (once per host), so the first import times the
        import and not those."""
        spec = recipe.builtin(guest_image.DEFAULT_IMAGE)
        cache = paths.cache_dir()
        staging, scratch = self.workdir / "staging", self.workdir / "boot-files"
        staging.mkdir()
        scratch.mkdir()
        debian = guest_image.base_tarball(spec, cache, staging, self.say.log)
        runtime.build(debian, spec.base_key(guest_image.VARIANT), cache, self.say.log)
        kpkg = kernel.resolve(cache / "kernel-package.json")
        guest_image.boot_files(kpkg, cache, staging, scratch, self.say.log)
        self.say.log(f"writing the layers ({self.args.big_mib} MiB of files over {debian.name})")
        t0 = time.monotonic()
        layers = image_fixture.make_layers(self.workdir, debian, self.args.big_mib)
        self.results["layers_make_s"] = r1(time.monotonic() - t0)
        self.registry = RegistryServer()
        first = [layers.base, layers.deps, layers.data, layers.app]
        second = [layers.base, layers.deps, layers.data, layers.app2]
        refs = []
        for tag, lays in (("1", first), ("2", second)):
            ref = image_fixture.push_image(
                self.registry.address, "bench/app", tag, lays, self.run_label, PORT
            )
            self.tar_mib[ref] = sum(lay.tar_bytes for lay in lays) / MIB
            refs.append(ref)
        self.results.update(
            image_layers=len(first),
            image_tar_mib=r1(self.tar_mib[refs[0]]),
            image_blob_mib=r1(sum(lay.size for lay in first) / MIB),
            second_own_blob_mib=r1(layers.app2.size / MIB),
        )
        return refs[0], refs[1]

    # -------------------------------------------------------------- imports

    def import_image(self, ref: str, label: str) -> guest_image.Image:
        """Fetch and build ``ref`` as the daemon does; its figures in ``results[label]``."""
        assert self.registry is not None
        self.say.log(f"{label}: importing {ref}")
        marks: list[tuple[float, str]] = []

        def note(message: str) -> None:
            marks.append((time.monotonic(), message))

        t0 = time.monotonic()
        fetched = fetch_image(
            ref, self.store, policy=RegistryPolicy.of([self.registry.address]), progress=note
        )
        t1 = time.monotonic()
        img = container_image.build(fetched, note)
        t2 = time.monotonic()
        if img.dir not in {i.dir for i in self.built}:
            self.built.append(img)
        start = next((t for t, m in marks if m.startswith("flattening")), None)
        end = next((t for t, m in marks if m.startswith("squashfs:")), None)
        flatten = end - start if start is not None and end is not None else 0.0
        fetch_s, total_s = t1 - t0, t2 - t0
        tar_mib = self.tar_mib[ref]
        self.results[label] = {
            "fetch_s": r2(fetch_s),
            "fetch_mib_s": r1(fetched.bytes_fetched / MIB / fetch_s),
            "flatten_s": r2(flatten),
            "flatten_mib_s": r1(tar_mib / flatten) if flatten else None,
            "build_other_s": r2(t2 - t1 - flatten),
            "total_s": r2(total_s),
            "import_mib_s": r1(fetched.bytes_fetched / MIB / total_s),
            "bytes_fetched": fetched.bytes_fetched,
            "bytes_reused": fetched.bytes_reused,
            "rootfs_mib": r1(img.rootfs.stat().st_size / MIB),
            # When each step began (seconds into the import), layer progress left out.
            "steps": [[r2(t - t0), m] for t, m in marks if not m.startswith("layer ")],
        }
        return img

    # -------------------------------------------------------------- templates

    async def _snapshot(self, vm: VM, label: str) -> tuple[Path, float]:
        snap = self._new_snap_dir(label)
        t0 = time.monotonic()
        await vm.snapshot(snap)
        return snap, time.monotonic() - t0

    async def template_from_image(self, img: guest_image.Image, ref: str) -> Path:
        """What ``snapshot create --image REF --start --ready-port`` does after the import."""
        mem = self.args.memory
        self.say.log(f"template from the image: {mem} MiB, its Cmd started until :{PORT}")
        req = SnapshotCreate(
            tag="bench-image",
            image=ref,
            memory_mib=mem,
            start=True,
            ready_port=PORT,
            ready_timeout_secs=READY_SECS,
        )
        t0 = time.monotonic()
        vm = await self._boot(img, mem)
        t1 = time.monotonic()
        try:
            await template_start.configure(vm, img, req)
            await template_start.start(vm, img, req)
            t2 = time.monotonic()
            snap, snapshot_s = await self._snapshot(vm, "image")
        finally:
            await self._kill([vm])
        phases = {"boot_s": t1 - t0, "start_s": t2 - t1, "snapshot_s": snapshot_s}
        imported = self.results["import_first"]["total_s"]
        self.results["template_image"] = {
            "import_s": imported,
            **{k: r2(v) for k, v in phases.items()},
            "ready_template_s": r2(imported + sum(phases.values())),
            "memory_bin_mib": r1(allocated_mib(snap / "memory.bin")),
        }
        return snap

    async def template_from_recipe(self, img: guest_image.Image) -> Path:
        """The ``python`` recipe image, same size, running the same server."""
        mem = self.args.memory
        self.say.log(f"template from the python recipe image: {mem} MiB, the same server")
        t0 = time.monotonic()
        vm = await self._boot(img, mem)
        t1 = time.monotonic()
        try:
            await vm.guest.proc_start(
                ["python3", "-m", "http.server", str(PORT), "--directory", "/tmp"]
            )
            deadline = time.monotonic() + READY_SECS
            while not await template_start.listening(vm.guest, PORT):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the recipe template's server never listened on {PORT}")
                await asyncio.sleep(template_start.POLL_SECS)
            t2 = time.monotonic()
            snap, snapshot_s = await self._snapshot(vm, "recipe")
        finally:
            await self._kill([vm])
        self.results["template_recipe"] = {
            "boot_s": r2(t1 - t0),
            "start_s": r2(t2 - t1),
            "snapshot_s": r2(snapshot_s),
            "memory_bin_mib": r1(allocated_mib(snap / "memory.bin")),
        }
        return snap

    # -------------------------------------------------------------- forks

    async def _fork_once(self, snap: Path, check: bool) -> tuple[float, float, float]:
        """One fork: ms to the agent's answer, QEMU's CPU ms until then (less noisy than
        wall time on a busy host), ms of its first command; killed after."""
        vm = await self._fork(snap)
        try:
            cpu_ms = benchlib.cpu_secs(vm.pid) * 1000
            t0 = time.monotonic()
            out = await vm.guest.exec(["true"])
            first_exec = (time.monotonic() - t0) * 1000
            if out.get("exit_code") != 0:
                raise RuntimeError(f"`true` failed in a fork of {snap.name}: {out}")
            if check:
                page = await vm.guest.exec(["python3", "-c", PAGE_CHECK])
                if page.get("stdout", "").strip() != "200":
                    raise RuntimeError(f"a fork of {snap.name} did not serve its page: {page}")
            return vm.ready_ms or 0.0, cpu_ms, first_exec
        finally:
            await self._kill([vm])

    async def forks(self, image_snap: Path, recipe_snap: Path) -> None:
        n = self.args.forks
        self.say.log(f"forking each template {n} times, alternating")
        ready: dict[str, list[float]] = {"image": [], "recipe": []}
        first: dict[str, list[float]] = {"image": [], "recipe": []}
        cpu: dict[str, list[float]] = {"image": [], "recipe": []}
        snaps = {"image": image_snap, "recipe": recipe_snap}
        for i in range(n):
            # Alternate which goes first, so neither always meets the other's leftovers.
            for kind in ("image", "recipe") if i % 2 == 0 else ("recipe", "image"):
                ms, cpu_ms, exec_ms = await self._fork_once(snaps[kind], check=i == 0)
                ready[kind].append(ms)
                cpu[kind].append(cpu_ms)
                first[kind].append(exec_ms)
        res = self.results
        res["forks_each"] = n
        for kind in ("image", "recipe"):
            res[f"fork_{kind}_ms"] = [r1(x) for x in ready[kind]]
            res[f"fork_{kind}_ms_p50"] = r1(percentile(ready[kind], 50))
            res[f"fork_{kind}_ms_p95"] = r1(percentile(ready[kind], 95))
            res[f"fork_{kind}_cpu_ms_p50"] = r1(percentile(cpu[kind], 50))
            res[f"first_exec_{kind}_ms_p50"] = r1(percentile(first[kind], 50))
        for q in ("p50", "p95", "cpu_p50"):
            key = "cpu_ms_p50" if q == "cpu_p50" else f"ms_{q}"
            img, rec = res[f"fork_image_{key}"], res[f"fork_recipe_{key}"]
            res[f"fork_image_vs_recipe_{q}"] = round(img / rec, 2) if rec else None

    # -------------------------------------------------------------- the run

    async def run(self) -> None:
        self.results["accel"] = accel.choose().name
        recipe_img = await self.python_image()
        first_ref, second_ref = await asyncio.to_thread(self.prepare)
        first = await asyncio.to_thread(self.import_image, first_ref, "import_first")
        await asyncio.to_thread(self.import_image, first_ref, "import_again")
        image_snap = await self.template_from_image(first, first_ref)
        await asyncio.to_thread(self.import_image, second_ref, "import_shared_base")
        recipe_snap = await self.template_from_recipe(recipe_img)
        self.results["rootfs_mib"] = {
            "image": r1(first.rootfs.stat().st_size / MIB),
            "recipe": r1(recipe_img.rootfs.stat().st_size / MIB),
        }
        await self.forks(image_snap, recipe_snap)

    async def kill_all(self) -> None:
        await super().kill_all()
        for img in self.built:  # no VM of this run uses them any more
            with contextlib.suppress(ImageError, OSError):
                guest_image.remove(f"{img.name}-{img.key}", roots=[])
        if self.registry is not None:
            self.registry.stop()


def finish_results(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    results["memory_mib"] = args.memory
    results["host_cores"] = len(os.sched_getaffinity(0))
    results["targets"] = judge(results, TARGETS)
    results["all_targets_met"] = all(t["met"] for t in results["targets"].values())
    return results


def render(out: Console, bench: ImagesBench, res: dict[str, Any]) -> None:
    def get(dotted: str, unit: str = "") -> str:
        value = benchlib.lookup(res, dotted)
        return "-" if value is None else f"{value}{unit}"

    main = Table(
        title=f"forkd container-image benchmark ({res.get('accel')}, "
        f"{res.get('image_tar_mib')} MiB image in {res.get('image_layers')} layers, "
        f"{res.get('image_blob_mib')} MiB compressed)"
    )
    for col in ("", "fetch", "flatten", "build rest", "total", "fetched", "reused"):
        main.add_column(col, justify="right" if col else "left")
    for key, label in (
        ("import_first", "first import"),
        ("import_again", "again (cached)"),
        ("import_shared_base", "second image, shared base"),
    ):
        if key not in res:
            continue
        main.add_row(
            label,
            f"{get(key + '.fetch_s', ' s')} ({get(key + '.fetch_mib_s', ' MiB/s')})",
            f"{get(key + '.flatten_s', ' s')} ({get(key + '.flatten_mib_s', ' MiB/s')})",
            get(key + ".build_other_s", " s"),
            f"{get(key + '.total_s', ' s')} ({get(key + '.import_mib_s', ' MiB/s')})",
            f"{res[key]['bytes_fetched'] / MIB:.1f} MiB",
            f"{res[key]['bytes_reused'] / MIB:.1f} MiB",
        )
    out.print(main)

    tpl = Table(
        title=f"template of {res.get('memory_mib')} MiB: snapshot create --image "
        "--start --ready-port, and a recipe template beside it"
    )
    for col in ("", "import", "boot", "start", "snapshot", "ready", "memory.bin"):
        tpl.add_column(col, justify="right" if col else "left")
    for key in ("template_image", "template_recipe"):
        if key in res:
            tpl.add_row(
                key.split("_")[1],
                get(key + ".import_s", " s"),
                get(key + ".boot_s", " s"),
                get(key + ".start_s", " s"),
                get(key + ".snapshot_s", " s"),
                get(key + ".ready_template_s", " s"),
                get(key + ".memory_bin_mib", " MiB"),
            )
    out.print(tpl)

    forks = Table(title=f"{res.get('forks_each')} forks of each template, alternating")
    for col in ("", "fork p50", "fork p95", "QEMU CPU p50", "first command p50", "root disk"):
        forks.add_column(col, justify="right" if col else "left")
    for kind in ("image", "recipe"):
        forks.add_row(
            kind,
            get(f"fork_{kind}_ms_p50", " ms"),
            get(f"fork_{kind}_ms_p95", " ms"),
            get(f"fork_{kind}_cpu_ms_p50", " ms"),
            get(f"first_exec_{kind}_ms_p50", " ms"),
            get(f"rootfs_mib.{kind}", " MiB"),
        )
    t = res["targets"]["fork_image_vs_recipe_p50"]
    forks.add_row(
        "image / recipe",
        f"{t['value']}x (≤ 1.2: {benchlib.MET_MARK[t['met']]})",
        get("fork_image_vs_recipe_p95", "x"),
        get("fork_image_vs_recipe_cpu_p50", "x"),
        "",
        "",
    )
    out.print(forks)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--memory", type=int, default=256, help="both templates' RAM in MiB (256)")
    p.add_argument("--forks", type=int, default=20, help="forks of each template (20)")
    p.add_argument("--big-mib", type=int, default=90, help="MiB of files over the Debian tree (90)")
    benchlib.add_common_args(p)
    args = p.parse_args(argv)
    if args.forks < 1 or args.big_mib < 2:
        p.error("--forks must be at least 1 and --big-mib at least 2")
    return benchlib.run_main(
        benchlib.amain(args, ImagesBench, finish_results, render, workdir_prefix="forkd-images-")
    )


if __name__ == "__main__":
    sys.exit(main())
