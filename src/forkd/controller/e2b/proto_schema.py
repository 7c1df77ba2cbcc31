"""Protocol Buffers files written as Python tables, for the messages forkd speaks with
E2B's SDKs (:mod:`.process_messages`, :mod:`.filesystem_messages`).

A file is a tree of :class:`Msg` and :class:`EnumDef`; :func:`build` turns it into the
``FileDescriptorProto`` that protobuf-py's messages run on (their binary and JSON
encodings come from it) and ties each stub class to its descriptor. The stubs are
ordinary classes deriving from protobuf-py's ``Message`` and ``Enum``, with their
fields annotated for mypy; ``tests/unit/test_e2b_proto.py`` checks each stub against
its table, and each table against the descriptors E2B's own SDK carries.

protobuf-py builds a file from a serialized descriptor with ``protobuf._codegen``, the
function its generated modules call; ``pyproject.toml`` pins protobuf-py below 0.7 for
it, as those modules are.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protobuf import DescFile, Enum, Message
from protobuf._codegen import file_desc
from protobuf.wkt.google.protobuf.descriptor_pb import (
    DescriptorProto,
    EnumDescriptorProto,
    EnumValueDescriptorProto,
    FieldDescriptorProto,
    FileDescriptorProto,
    MessageOptions,
    OneofDescriptorProto,
)

Type = FieldDescriptorProto.Type
Label = FieldDescriptorProto.Label

SCALARS = {
    "string": Type.STRING,
    "bytes": Type.BYTES,
    "bool": Type.BOOL,
    "uint32": Type.UINT32,
    "sint32": Type.SINT32,
    "int64": Type.INT64,
}


@dataclass(frozen=True)
class Field:
    """One field: ``kind`` is a scalar's name (:data:`SCALARS`) or a message's or enum's
    full name (``.package.Name``); ``optional`` is proto3's ``optional`` (presence);
    ``oneof`` names the oneof it is a member of; ``map_value`` makes it a
    ``map<string, map_value>``."""

    name: str
    number: int
    kind: str
    repeated: bool = False
    optional: bool = False
    oneof: str | None = None
    map_value: str | None = None


@dataclass(frozen=True)
class Msg:
    name: str
    stub: type[Message]
    fields: tuple[Field, ...] = ()
    nested: tuple[Msg, ...] = ()


@dataclass(frozen=True)
class EnumDef:
    name: str
    stub: type[Enum]
    values: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ProtoFile:
    path: str
    package: str
    messages: tuple[Msg, ...]
    enums: tuple[EnumDef, ...] = ()
    imports: tuple[DescFile, ...] = field(default=())


def json_name(name: str) -> str:
    """proto3's JSON name of a field: ``exit_code`` is ``exitCode``."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def build(spec: ProtoFile) -> DescFile:
    """The file described by ``spec``, its stubs bound to their descriptors."""
    enum_names = {f".{spec.package}.{e.name}" for e in spec.enums}
    enum_names |= {f".{e.type_name}" for dep in spec.imports for e in dep.enums}
    proto = FileDescriptorProto(
        name=spec.path,
        package=spec.package,
        dependency=[dep.name for dep in spec.imports],
        message_type=[_message(m, f".{spec.package}", enum_names) for m in spec.messages],
        enum_type=[_enum(e) for e in spec.enums],
        syntax="proto3",
    )
    stubs: dict[str, type[Message] | type[Enum]] = {e.name: e.stub for e in spec.enums}
    for msg in spec.messages:
        _collect_stubs(msg, "", stubs)
    return file_desc(proto.to_binary(), list(spec.imports), stubs)


def _collect_stubs(msg: Msg, prefix: str, into: dict[str, type[Message] | type[Enum]]) -> None:
    into[prefix + msg.name] = msg.stub
    for nested in msg.nested:
        _collect_stubs(nested, f"{prefix}{msg.name}.", into)


def _message(msg: Msg, scope: str, enum_names: set[str]) -> DescriptorProto:
    """``msg``, declared in ``scope`` (``.package`` or ``.package.Outer``)."""
    here = f"{scope}.{msg.name}"
    oneofs = list(dict.fromkeys(f.oneof for f in msg.fields if f.oneof))
    fields: list[FieldDescriptorProto] = []
    entries: list[DescriptorProto] = []
    for f in msg.fields:
        made = _field(f, enum_names)
        if f.oneof:
            made.oneof_index = oneofs.index(f.oneof)
        if f.map_value:
            entry = f"{f.name[:1].upper()}{json_name(f.name)[1:]}Entry"
            made.type_name = f"{here}.{entry}"
            entries.append(_map_entry(entry, f.map_value, enum_names))
        fields.append(made)
    # proto3 optional fields each get a synthetic oneof, after the real ones.
    for made, f in zip(fields, msg.fields, strict=True):
        if f.optional:
            made.oneof_index = len(oneofs)
            made.proto3_optional = True
            oneofs.append(f"_{f.name}")
    return DescriptorProto(
        name=msg.name,
        field=fields,
        nested_type=[*(_message(n, here, enum_names) for n in msg.nested), *entries],
        oneof_decl=[OneofDescriptorProto(name=name) for name in oneofs],
    )


def _field(f: Field, enum_names: set[str]) -> FieldDescriptorProto:
    made = FieldDescriptorProto(
        name=f.name,
        number=f.number,
        label=Label.REPEATED if f.repeated or f.map_value else Label.OPTIONAL,
        json_name=json_name(f.name),
    )
    if f.map_value:
        made.type = Type.MESSAGE
    elif f.kind in SCALARS:
        made.type = SCALARS[f.kind]
    else:
        made.type = Type.ENUM if f.kind in enum_names else Type.MESSAGE
        made.type_name = f.kind
    return made


def _map_entry(name: str, value_kind: str, enum_names: set[str]) -> DescriptorProto:
    return DescriptorProto(
        name=name,
        field=[
            _field(Field("key", 1, "string"), enum_names),
            _field(Field("value", 2, value_kind), enum_names),
        ],
        options=MessageOptions(map_entry=True),
    )


def _enum(spec: EnumDef) -> EnumDescriptorProto:
    return EnumDescriptorProto(
        name=spec.name,
        value=[EnumValueDescriptorProto(name=n, number=v) for n, v in spec.values],
    )
