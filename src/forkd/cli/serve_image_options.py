"""The options of ``forkd serve`` about images and registries: where a reference without
a host points, which registries speak plain HTTP, the credentials, the Docker Engine,
the directories image archives may be read from, and an import's caps."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

InsecureRegistryOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--insecure-registry",
        envvar="FORKD_INSECURE_REGISTRIES",
        metavar="HOST[:PORT]",
        help="An OCI registry spoken to over plain HTTP; repeatable. The only registries "
        "plain HTTP goes to, and the only ones on this host (loopback) a push or pull may "
        "reach: list a local registry here.",
    ),
]

DefaultRegistryOpt = Annotated[
    str | None,
    typer.Option(
        "--default-registry",
        envvar="FORKD_DEFAULT_REGISTRY",
        metavar="HOST[:PORT]",
        help="Where a reference without a registry host (python:3.12) points; docker.io "
        "adds Docker Hub's library/. Default: none, such references are refused.",
    ),
]

RegistryAuthOpt = Annotated[
    Path | None,
    typer.Option(
        envvar="FORKD_REGISTRY_AUTH",
        help="docker's config.json with registry credentials (auths). Default: "
        "$DOCKER_CONFIG/config.json, else ~/.docker/config.json.",
    ),
]

DockerHostOpt = Annotated[
    str | None,
    typer.Option(
        "--docker-host",
        envvar="FORKD_DOCKER_HOST",
        metavar="unix://PATH",
        help="The Docker Engine docker-daemon: image references are exported from; "
        "'none': such references are refused. Default: $DOCKER_HOST (unix:// only), "
        "else /var/run/docker.sock.",
    ),
]

RegistryPolicyOpt = Annotated[
    Path | None,
    typer.Option(
        "--registry-policy",
        envvar="FORKD_REGISTRY_POLICY",
        metavar="FILE",
        help="A TOML file of more insecure_registries, a default_registry and "
        "image_archive_dirs, read again whenever it changes (and on SIGHUP): open or close "
        "a registry without a restart. See RUNBOOK.",
    ),
]

ImageArchiveDirOpt = Annotated[
    list[Path] | None,
    typer.Option(
        "--image-archive-dir",
        envvar="FORKD_IMAGE_ARCHIVE_DIRS",
        metavar="DIR",
        help="A directory whose image archives and OCI layouts clients may import "
        "(docker-archive:, oci-archive:, oci: references); repeatable. The daemon reads "
        "them with its own rights, so none is allowed unless listed.",
    ),
]

MaxImageOpt = Annotated[
    int,
    typer.Option(
        "--max-image-mib",
        envvar="FORKD_MAX_IMAGE_MIB",
        min=1,
        help="What an imported container image's files may expand to, in MiB (one layer, "
        "and all merged); an import past it is refused (400), however small its layers.",
    ),
]

MaxImageEntriesOpt = Annotated[
    int,
    typer.Option(
        "--max-image-entries",
        envvar="FORKD_MAX_IMAGE_ENTRIES",
        min=1,
        help="Entries (files, directories, links) an imported image may hold, in one layer "
        "and all merged; past it the import is refused (400). Merging costs CPU by the entry.",
    ),
]

ImportTimeoutOpt = Annotated[
    float,
    typer.Option(
        "--import-timeout",
        envvar="FORKD_IMPORT_TIMEOUT",
        min=1,
        help="Seconds one image import may take in all, fetching and flattening; past it "
        "the import is stopped (504) and keeps nothing half-made.",
    ),
]
