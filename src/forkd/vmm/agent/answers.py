"""A guest agent's answers as the daemon takes them: of the shape of their op's answer
(:func:`checked`), within the bounds the agent keeps (:func:`listed`, :func:`bounded`),
and a read's bytes no more than were asked for (:func:`data_of`). The guest is
untrusted: an answer that is not so is :data:`MALFORMED`, never used."""

from __future__ import annotations

import base64
from typing import Any, TypeVar, cast

from forkd import agent_wire as wire
from forkd import wire_shape
from forkd.errors import AgentError

MALFORMED = "MalformedAnswer"
A = TypeVar("A")  # an op's answer


def checked(op: wire.Op[Any, A], answer: dict[str, Any]) -> A:
    """``answer`` as ``op``'s answer; :class:`AgentError` of kind :data:`MALFORMED` if it
    does not have that shape."""
    try:
        wire_shape.check(op.answer, answer)
    except wire_shape.Malformed as exc:
        raise AgentError(
            f"the agent's answer to {op.name} is malformed: {exc}", MALFORMED
        ) from None
    return cast(A, answer)


def bounded(op: str, count: int, most: int) -> None:
    if count > most:
        raise AgentError(
            f"the agent's answer to {op} is malformed: {count} items, more than {most}",
            MALFORMED,
        )


def listed(answer: wire.FileListAnswer) -> list[wire.FileListEntry]:
    """A listing's entries, within the agent's own bound (:data:`wire.MAX_LIST_ENTRIES`):
    an answer with more is :data:`MALFORMED`, not a list the daemon goes on to build."""
    entries = answer["entries"]
    if len(entries) > wire.MAX_LIST_ENTRIES:
        raise AgentError(
            f"the agent's answer to file_list is malformed: {len(entries)} entries, more "
            f"than the {wire.MAX_LIST_ENTRIES} it lists at most",
            MALFORMED,
        )
    return entries


def data_of(result: wire.ReadAnswer, length: int) -> bytes:
    """A read's bytes: raw after the answer, or as base64 from an agent older than that;
    :class:`AgentError` for more than the ``length`` asked for."""
    raw = result.get("raw")
    if isinstance(raw, bytes):
        data = raw
    elif "data" in result:
        data = base64.b64decode(result["data"])
    else:
        data = b""  # raw, of length 0: no bytes followed the line
    if len(data) > length:
        raise AgentError(f"the agent sent {len(data)} bytes for a read of at most {length}")
    return data
