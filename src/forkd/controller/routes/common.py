"""What the routes of API v1 share: the services, parameters, shared answers."""

from __future__ import annotations

from typing import Annotated, Any, TypedDict

from fastapi import Depends, Request, Response

from forkd.controller.models import SnapshotInfo
from forkd.controller.services import Services
from forkd.errors import Invalid


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services  # Starlette's state holds Any
    return services


Svc = Annotated[Services, Depends(services_of)]


TAR_MEDIA_TYPE = "application/x-tar"


# Keyword arguments shared by route decorators, typed so that each splat is checked.
class AnswerModel(TypedDict, total=False):
    response_model: Any
    response_model_exclude_unset: bool
    response_model_exclude_none: bool


class NoContent(TypedDict):
    status_code: int
    response_class: type[Response]


NO_CONTENT: NoContent = {"status_code": 204, "response_class": Response}


SNAPSHOT: AnswerModel = {"response_model": SnapshotInfo, "response_model_exclude_unset": True}


# The list routes filter on labels with any number of ``metadata.KEY=VALUE`` parameters.
LABEL_FILTERS = {"description": "any number of metadata.KEY=VALUE parameters filter on labels"}


def metadata_filter(request: Request, *named: str) -> dict[str, str]:
    """The ``metadata.KEY=VALUE`` filters; any parameter but those and ``named`` is a
    400, and so is one given twice: a filter ignored would list (and maybe have the
    caller act on) everything."""
    prefix = "metadata."
    labels: dict[str, str] = {}
    for key in request.query_params:
        if len(request.query_params.getlist(key)) > 1:
            raise Invalid(f"query parameter {key!r} is given more than once")
        if key.startswith(prefix) and len(key) > len(prefix):
            labels[key[len(prefix) :]] = request.query_params[key]
        elif key not in named:
            raise Invalid(f"unknown query parameter {key!r}: filter with metadata.KEY=VALUE")
    return labels


def only_named(request: Request, *named: str) -> None:
    """Any query parameter but ``named``, or one given twice, is a 400: a filter
    ignored would stream everything."""
    for key in request.query_params:
        if len(request.query_params.getlist(key)) > 1:
            raise Invalid(f"query parameter {key!r} is given more than once")
        if key not in named:
            raise Invalid(f"unknown query parameter {key!r}: one of {', '.join(named)}")
