"""Images: container images imported as guest images (from a registry, a Docker Engine
or an archive), every guest image listed, and removed when nothing needs it.

An import fetches the image into the blob cache (layers by digest: what the
cache holds is not fetched again), flattens its layers into a root disk and
builds the guest image beside the recipe images; importing an image already
built fetches its manifest and finds the build. Imports run on threads of
their own, side by side, at most :data:`MAX_IMPORTS` at once (past that a 503
to retry), and one reference is imported once at a time. A removal waits on no
import: the blobs imports in progress use are held from it
(:meth:`~forkd.image_import.blob_store.BlobStore.held`), and an image whose
build an import is making or finding is refused with a 409 meanwhile.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forkd import import_deadline, paths, tracing
from forkd.archive.errors import ArchiveError
from forkd.controller.models import (
    ImageConfigInfo,
    ImageImport,
    ImageInfo,
    ImportProgress,
    OutputEvent,
)
from forkd.controller.services import image_catalog, image_requests
from forkd.controller.services.received import receive_to as _receive
from forkd.controller.settings import Settings
from forkd.disk_reserve import DiskReserve
from forkd.errors import Busy, Conflict, ImageError, Invalid, NoRoom, NotFound
from forkd.guest import container_image, image_sharing, recipe
from forkd.guest import image as images
from forkd.image_import.model import FetchedImage
from forkd.vmm.jail import qemu_user

if TYPE_CHECKING:
    from forkd.image_import.blob_store import BlobStore

MAX_IMPORTS = 2
KEEPALIVE_SECS = 15.0  # an import's event stream is never quiet longer than this
LOADED = "loaded:"  # the references of images clients sent as archives: loaded:TAG

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Imported:
    image: images.Image
    fetched: FetchedImage
    seconds: float


# Runs on an import thread: (request, progress) -> the built image and what was fetched.
Importer = Callable[[ImageImport, Progress], Imported]


class ImageService:
    def __init__(
        self,
        settings: Settings,
        importer: Importer | None = None,
    ) -> None:
        self.settings = settings
        self._importer = importer or self._import_sync
        self._pool = ThreadPoolExecutor(MAX_IMPORTS, thread_name_prefix="forkd-import")
        self._running = 0
        self._receiving = 0  # image archives on their way in (POST /v1/images/load)
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(
            asyncio.Lock
        )

    # ------------------------------------------------------------ import

    async def import_(self, req: ImageImport, progress: Progress | None = None) -> ImageInfo:
        """Import ``req.ref``; the image's info with what was fetched and reused."""
        with tracing.span("image.import"):
            return await self._import_or_local(req, progress)

    async def _import_or_local(self, req: ImageImport, progress: Progress | None) -> ImageInfo:
        say = progress or (lambda _msg: None)
        loaded = await asyncio.to_thread(
            image_catalog.local, req.ref
        )  # sent here: no registry is asked
        if loaded is not None:
            say(f"{req.ref} is a local image ({loaded.name}): nothing to fetch")
            info = self._info_of(loaded)
            update = {"bytes_fetched": 0, "bytes_reused": info.layer_bytes or 0, "import_secs": 0.0}
            return info.model_copy(update=update)
        return self._answer(await self._import(req, say))

    def _answer(self, done: Imported) -> ImageInfo:
        return self._info_of(done.image).model_copy(
            update={
                "bytes_fetched": done.fetched.bytes_fetched,
                "bytes_reused": done.fetched.bytes_reused,
                "import_secs": round(done.seconds, 2),
            }
        )

    async def import_events(self, req: ImageImport) -> AsyncIterator[OutputEvent]:
        """:meth:`import_` as events: ``progress`` as it goes (a keep-alive when quiet),
        then ``image``. A failure is raised (the stream's last event says it)."""
        async for event in _as_events(lambda progress: self.import_(req, progress)):
            yield event

    async def receive(self, body: AsyncIterator[bytes]) -> Path:
        """An image archive a client sends, written to a file of the blob store's as it
        arrives (at most --max-image-mib); :meth:`load` imports it, then removes it."""
        self._check_room()  # a busy daemon says so before the upload, not after it
        if self._receiving >= MAX_IMPORTS:
            raise Busy(f"{MAX_IMPORTS} image archives are arriving: retry shortly")
        from forkd.image_import.blob_store import BlobStore, write_error

        meter = self._reserve().meter("receiving an image archive")
        self._receiving += 1
        fd, path = BlobStore(paths.blobs_dir()).temp_file(".load.tar")
        try:
            with os.fdopen(fd, "wb") as out:
                cap = self.settings.max_image_bytes
                await _receive(body, out, cap, meter, "the archive", "--max-image-mib")
        except BaseException as exc:
            path.unlink(missing_ok=True)
            if isinstance(exc, OSError):  # the disk filled up: a 500 that says so
                raise write_error(exc) from exc
            raise
        finally:
            self._receiving -= 1
        return path

    async def load(
        self, archive: Path, tag: str | None, progress: Progress | None = None
    ) -> ImageInfo:
        """Import the image of an archive :meth:`receive` kept (``docker save``, ``podman
        save`` or an OCI archive) and remove the archive. Its reference is ``loaded:TAG``:
        ``image=TAG`` then finds it before any registry, as ``docker run`` does."""
        say = progress or (lambda _msg: None)
        try:
            say(f"received the archive ({archive.stat().st_size / (1 << 20):.1f} MiB)")
            reference = f"{LOADED}{tag}" if tag else f"{LOADED}archive"
            done = await self._run(
                f"{LOADED}{tag or archive.name}",
                lambda progress: self._load_sync(archive, tag, reference, progress),
                say,
            )
        finally:
            archive.unlink(missing_ok=True)
        return self._answer(done)

    async def load_events(self, archive: Path, tag: str | None) -> AsyncIterator[OutputEvent]:
        """:meth:`load` as events, as :meth:`import_events` (they begin once the archive
        has arrived: a client shows its own upload's progress)."""
        try:
            async for event in _as_events(lambda progress: self.load(archive, tag, progress)):
                yield event
        finally:
            archive.unlink(missing_ok=True)  # a stream never started or cut short

    async def resolve(self, name_or_ref: str | None) -> images.Image:
        """The guest image a template boots: a built image's name (default python), else
        a local image's name (one built, loaded or imported here, as ``docker run`` finds
        a local image before it pulls), else a container image reference, imported now
        (fetching what changed)."""
        name = name_or_ref or images.DEFAULT_IMAGE
        no_registry = not self.settings.registries().default_registry
        if recipe.NAME_RE.fullmatch(name):
            try:
                return images.find_image(name)
            except ImageError:
                imported = image_catalog.newest_import(name) or image_catalog.local(
                    name
                )  # oci-<id>, or myapp
                if imported is not None:
                    return imported
                if no_registry:  # a short name reaches no registry
                    said = await asyncio.to_thread(
                        image_catalog.no_local_image, name, "no built or local image"
                    )
                    raise Invalid(said) from None
        local = await asyncio.to_thread(image_catalog.local, name)
        if local is not None:
            return local
        from forkd.oci.reference import names_registry

        if no_registry and "@" not in name and not names_registry(name):
            raise Invalid(await asyncio.to_thread(image_catalog.no_local_image, name))
        done = await self._import(ImageImport(ref=name), lambda _msg: None)
        return done.image

    async def _import(self, req: ImageImport, progress: Progress) -> Imported:
        return await self._run(req.ref, lambda say: self._importer(req, say), progress)

    def _timed(self, job: Callable[[Progress], Imported]) -> Callable[[Progress], Imported]:
        """``job`` on its import thread held to --import-timeout, all of it."""
        seconds = self.settings.import_timeout_secs

        def run(progress: Progress) -> Imported:
            with import_deadline.import_deadline(seconds):
                return job(progress)

        return run

    def _reserve(self) -> DiskReserve:
        """The free disk an import's blobs, archive and build may not take."""
        return DiskReserve(paths.blobs_dir(), self.settings.disk_reserve_mib << 20)

    def _check_room(self) -> None:
        if self._running >= MAX_IMPORTS:
            raise Busy(f"{MAX_IMPORTS} image imports are running: retry shortly")

    async def _run(
        self, key: str, job: Callable[[Progress], Imported], progress: Progress
    ) -> Imported:
        """``job`` on an import thread, one at a time per ``key``, at most MAX_IMPORTS."""
        self._check_room()
        async with self._locks[key]:
            self._check_room()
            self._running += 1
            try:
                loop = asyncio.get_running_loop()
                work = loop.run_in_executor(self._pool, self._timed(job), progress)
                # A cancelled caller does not stop the thread: it finishes (or cleans
                # up after itself) and still counts, until it has.
                return await asyncio.shield(work)
            finally:
                self._running -= 1
                if not self._locks[key].locked():
                    self._locks.pop(key, None)

    def _import_sync(self, req: ImageImport, progress: Progress) -> Imported:
        from forkd.image_import import references
        from forkd.image_import.fetch import fetch_image
        from forkd.image_import.layers import layer_cap
        from forkd.oci import auth
        from forkd.oci.policy import RegistryPolicy

        settings = self.settings
        started = time.monotonic()

        def credentials(registry: str) -> auth.Credentials | None:
            if req.token:
                return auth.Credentials(bearer=req.token)
            return auth.from_docker_config(registry, settings.registry_auth)

        registries = settings.registries()
        policy = RegistryPolicy.of(registries.insecure_registries, registries.default_registry)
        image_requests.check_allowed(references.parse(req.ref, policy), req.ref, settings)
        with self._holding() as store:
            fetched = fetch_image(
                req.ref,
                store,
                policy=policy,
                credentials_for=credentials,
                docker_host=settings.docker_host,
                progress=progress,
                layer_cap=layer_cap(settings.max_image_bytes, settings.max_image_entries),
            )
            return self._build(fetched, progress, started)

    def _load_sync(
        self, archive: Path, tag: str | None, reference: str, progress: Progress
    ) -> Imported:
        from forkd.image_import.layers import layer_cap
        from forkd.image_import.local_sources import fetch_loaded

        started = time.monotonic()
        settings = self.settings
        cap = layer_cap(settings.max_image_bytes, settings.max_image_entries)
        with self._holding() as store:
            fetched = fetch_loaded(archive, tag, store, progress, shown=reference, layer_cap=cap)
            return self._build(fetched, progress, started)

    @contextlib.contextmanager
    def _holding(self) -> Iterator[BlobStore]:
        """The blob store, for one import: what it looks at or writes is held from removal
        while it runs. An import refused for its layers (while flattened) or for want of
        disk leaves none of those blobs behind, but those a build needs or another import
        holds."""
        from forkd.image_import.blob_store import BlobStore

        touched: set[str] = set()
        try:
            with BlobStore(paths.blobs_dir(), reserve=self._reserve()).held() as store:
                try:
                    yield store
                finally:
                    touched = store.looked_at()
        except (_LayerRefused, NoRoom):
            container_image.forget_blobs(touched)
            raise

    def _build(self, fetched: FetchedImage, progress: Progress, started: float) -> Imported:
        """The guest image of ``fetched``; :class:`_LayerRefused` when a layer is refused
        while flattened."""
        settings = self.settings
        with image_sharing.building(container_image.image_name(fetched.config_digest)):
            try:
                # tar2sqfs parses the image's names in C: as a uid of its own (the registry
                # the QEMUs drop into), not as root, when the daemon has one to give.
                lease = qemu_user.reserve()
                try:
                    run_as = (lease.uid, lease.gid) if lease is not None else None
                    img = container_image.build(
                        fetched,
                        progress,
                        settings.max_image_bytes,
                        run_as=run_as,
                        reserve=self._reserve(),
                        max_entries=settings.max_image_entries,
                        # the uid stays leased while the worker (and its tar2sqfs) runs
                        worker_started=lease.bind if lease is not None else None,
                    )
                finally:
                    if lease is not None:
                        lease.release()
            except ArchiveError as exc:
                raise _LayerRefused(
                    f"image {fetched.reference}: a layer cannot be used: {exc}"
                ) from exc
            name = container_image.local_names_of(fetched.reference)
            if name is not None:  # the name moves to this image, as a docker tag does
                image_catalog.untag(name, keep=img)
        return Imported(img, fetched, time.monotonic() - started)

    # ------------------------------------------------------------ read

    def list(self) -> builtins.list[ImageInfo]:
        built = images.list_images()
        catalog = self._catalog(built)
        return [self._info(img, catalog) for img in built]

    def get(self, name: str) -> ImageInfo:
        return self._info_of(self._find(name))

    def _info_of(self, img: images.Image) -> ImageInfo:
        return self._info(img, self._catalog(images.list_images()))

    def _catalog(self, built: builtins.list[images.Image]) -> image_catalog.Catalog:
        """What each image's info is read against, read once for a listing."""
        return image_catalog.Catalog(
            image_catalog.layer_users(built), image_catalog.name_holders(built), self._roots()
        )

    def _find(self, name: str) -> images.Image:
        """The build ``NAME-KEY`` names, or NAME's current build (the one snapshots made
        from NAME now boot), else its newest: a name has a build for each forkd that
        made it; else the local image a tag (``myapp:1``) names."""
        builds = [i for i in images.list_images() if name in (i.name, f"{i.name}-{i.key}")]
        if not builds:
            local = image_catalog.local(name, registry_too=True)
            if local is not None:
                return local
            raise NotFound(image_catalog.no_local_image(name, "no image") + " (see GET /v1/images)")
        with contextlib.suppress(ImageError):
            current = images.find_image(name)
            if any(b.dir == current.dir for b in builds):
                return current
        return max(builds, key=lambda i: i.meta.get("built_at_unix", 0))

    def _info(self, img: images.Image, catalog: image_catalog.Catalog) -> ImageInfo:
        meta = img.meta
        container = container_image.is_container(img)
        own = sum(  # files hard-linked from elsewhere (runtime disk, kernel) are shared
            st.st_size
            for st in (p.stat() for p in img.dir.iterdir() if p.is_file())
            if st.st_nlink == 1
        )
        info: dict[str, Any] = {
            "name": img.name,
            "key": img.key,
            "kind": "container" if container else "recipe",
            "size_bytes": own,
            "created_at_unix": int(meta.get("built_at_unix", 0)),
            "used_by": images.users_of(img, catalog.roots),
        }
        if container:
            config = container_image.config_of(img)
            layers = list(meta.get("layers") or [])
            sizes = image_catalog.blob_sizes(layers)
            users = catalog.layer_users
            info |= {
                "names": image_catalog.names_held(img, catalog.holders),
                "references": list(meta.get("references") or []),
                "id": meta.get("config_digest"),
                "digest": meta.get("manifest_digest"),
                "layers": len(layers),
                "layer_bytes": sum(sizes.values()),
                "shared_layer_bytes": sum(n for d, n in sizes.items() if users.get(d, 0) > 1),
                "config": ImageConfigInfo(**config.to_json()),
            }
        return ImageInfo(**info)

    def _roots(self) -> builtins.list[Path]:
        """Where snapshots and VMs that may use an image live: this daemon's directories
        and those of every other daemon sharing the cache."""
        own = [self.settings.snapshot_root, self.settings.run_dir]
        return images.with_other_daemons(own)

    # ------------------------------------------------------------ remove

    async def remove(self, name: str) -> None:
        """Delete an image (every build of a name, NAME-KEY, or the image a local name
        such as ``myapp:1`` names) and the layers nothing else needs; 409 while a snapshot
        or VM uses it, deleting nothing. A local name of an image that has others is
        only taken off it (as ``docker rmi`` untags)."""
        found = await asyncio.to_thread(self._find, name)
        by_tag = name not in (found.name, f"{found.name}-{found.key}")
        await asyncio.to_thread(self._remove_sync, found, name, by_tag)
        await asyncio.to_thread(container_image.collect_unused_layers)

    def _remove_sync(self, found: images.Image, name: str, by_tag: bool) -> None:
        with image_sharing.removing(found.name):
            if by_tag:
                tag = container_image.with_tag(name)
                held = image_catalog.names_held(
                    found, image_catalog.name_holders(images.list_images())
                )
                if set(held) - {tag}:  # it keeps a name: only untag it
                    image_catalog.untag(tag)
                    return
                name = f"{found.name}-{found.key}"  # its last name: the build goes
            try:
                images.remove(name, self._roots())  # refused, changing nothing, when in use
            except ImageError as exc:
                raise Conflict(str(exc)) from exc
            if by_tag:
                image_catalog.untag(tag)  # from older builds that still carry it


class _LayerRefused(Invalid):
    """A layer of the image was refused while flattened (hostile, or past the caps)."""


async def _as_events(
    start: Callable[[Progress], Awaitable[ImageInfo]],
) -> AsyncIterator[OutputEvent]:
    """``start(progress)``'s steps as ``progress`` events (a keep-alive when quiet), then
    its answer as ``image``; its failure is raised (the stream's last event says it)."""
    loop = asyncio.get_running_loop()
    steps: asyncio.Queue[str] = asyncio.Queue()

    def progress(msg: str) -> None:  # may be called from another thread
        loop.call_soon_threadsafe(steps.put_nowait, msg)

    work = asyncio.ensure_future(start(progress))
    try:
        while not work.done():
            step = asyncio.ensure_future(steps.get())
            await asyncio.wait(
                {work, step}, timeout=KEEPALIVE_SECS, return_when=asyncio.FIRST_COMPLETED
            )
            if step.done():
                yield OutputEvent("progress", ImportProgress(message=step.result()))
            else:
                step.cancel()
                if not work.done():
                    yield OutputEvent("keepalive")
        while not steps.empty():
            yield OutputEvent("progress", ImportProgress(message=steps.get_nowait()))
        yield OutputEvent("image", work.result())
    finally:
        work.cancel()  # a client gone: the import thread still finishes on its own
