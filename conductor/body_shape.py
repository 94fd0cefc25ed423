"""What a query body holds, read before it is decoded: how many items its array field has,
whether they are plain numbers, and how many bytes the rest takes.

A route's byte cap is sized for its largest request in JSON (12 bytes per token id), but a
small int is one msgpack byte, and decoding (msgpack, or pydantic for a JSON body the C
token reader declines) builds a Python object per value: ~12x the token limit fit the cap,
and a cap's worth of nested empty arrays held the event loop while it was decoded, only to
be refused (tests/conductor/test_http_hardening.py holds both cases). Reading
the shape costs a pass in C over the body (msgspec reads each field's value as ``Raw``
bytes) and builds no object per item, so a body that breaks a limit is refused at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

_MSGPACK_ARRAYS = {0xDC: 2, 0xDD: 4}  # header byte -> bytes of its length
_MSGPACK_BINS = {0xC4: 1, 0xC5: 2, 0xC6: 4}
_json_fields = msgspec.json.Decoder(dict[str, msgspec.Raw])
_msgpack_fields = msgspec.msgpack.Decoder(dict[Any, msgspec.Raw])


class NotAnObject(Exception):
    """The body is well-formed but no map / object (the route answers as pydantic would)."""


class Malformed(Exception):
    """The body is no well-formed msgpack."""


@dataclass(frozen=True, slots=True)
class BodyShape:
    """The array field's items (None: absent or no array), whether it is plain (numbers:
    decoding it builds one object per item, whatever its size) and the bytes of its
    value."""

    items: int | None = None
    plain: bool = True
    value_bytes: int = 0


def _largest(shapes: list[BodyShape]) -> BodyShape:
    """A field given under two aliases counts by its largest value (both are decoded)."""
    return max(shapes, key=lambda shape: (shape.value_bytes, shape.items or 0), default=BodyShape())


def json_shape(body: bytes, names: tuple[str, ...]) -> BodyShape | None:
    """The shape of a JSON object's field ``names``; None when the body is no valid JSON
    (the decoder reports where)."""
    try:
        fields = _json_fields.decode(body)
    except msgspec.ValidationError:
        raise NotAnObject from None
    except msgspec.DecodeError:
        return None
    shapes = []
    for name in names:
        if name in fields:
            value = bytes(fields[name])
            items = _json_plain_array_length(value)
            shapes.append(BodyShape(items, items is not None, len(value)))
    return _largest(shapes)


def _json_plain_array_length(value: bytes) -> int | None:
    """The length of an array of numbers (or literals); None for anything else."""
    if not value.startswith(b"[") or b'"' in value or b"{" in value or value.count(b"[") != 1:
        return None
    inner = value[1:-1].strip()
    return inner.count(b",") + 1 if inner else 0


def msgpack_fields(body: bytes) -> dict[Any, msgspec.Raw]:
    """The body's map, its values still encoded; raises ``NotAnObject`` or ``Malformed``."""
    try:
        return _msgpack_fields.decode(body)
    except msgspec.ValidationError:
        raise NotAnObject from None
    except msgspec.DecodeError:
        raise Malformed from None


def msgpack_shape(
    fields: dict[Any, msgspec.Raw], names: tuple[str, ...], bytes_per_item: int
) -> BodyShape:
    """The shape of the field ``names`` of a map read by ``msgpack_fields``: an array's
    length from its header, a bin's (items packed ``bytes_per_item`` each) from its size.
    An array counts as plain: its elements are checked as it is decoded."""
    return _largest(
        [_msgpack_value(bytes(fields[name]), bytes_per_item) for name in names if name in fields]
    )


def is_msgpack_bin(value: memoryview) -> bool:
    """Whether an encoded msgpack value (one of ``msgpack_fields``'s) is a bin."""
    return len(value) > 0 and value[0] in _MSGPACK_BINS


def _msgpack_value(value: bytes, bytes_per_item: int) -> BodyShape:
    head = value[0]
    if head in _MSGPACK_BINS:
        return BodyShape((len(value) - 1 - _MSGPACK_BINS[head]) // bytes_per_item, True, len(value))
    if 0x90 <= head <= 0x9F:
        return BodyShape(head & 0x0F, True, len(value))
    if head in _MSGPACK_ARRAYS:
        items = int.from_bytes(value[1 : 1 + _MSGPACK_ARRAYS[head]], "big")
        return BodyShape(items, True, len(value))
    return BodyShape(None, False, len(value))
