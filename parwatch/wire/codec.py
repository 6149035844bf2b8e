"""Decoding and encoding the wire's records: raw JSON (or a decoded line) into its record in one call that
checks every field and bound, a BadRecord naming the field as the sidecar's 422 says it otherwise; and the
records' JSON schemas for the OpenAPI document."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec
from msgspec import Struct

from parwatch.vocabulary import Action, CollectiveOp, GroupRole, Outcome, TimeCategory
from parwatch.wire.activity import ROW_FIELDS, STATES, Activity
from parwatch.wire.bounds import ECMA_END, PRINTABLE, PYTHON_END


class BadRecord(ValueError):
    """A body that does not decode into its record; the message names the field and the bound."""


T = TypeVar("T")
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


TOO_DEEP = "body nests arrays or objects deeper than any record does (hundreds of levels): refused"


def decode(raw: bytes, record: type[T], root: str = "", *, dotted: bool = False) -> T:
    """Raw JSON -> `record`, every field checked; BadRecord names the field as `root`.field[.field...]
    (`dotted`: list items as .N, not [N])."""
    decoder = _decoders.get(record) or _decoders.setdefault(record, msgspec.json.Decoder(record))
    try:
        decoded: T = decoder.decode(raw)
        return decoded
    except msgspec.ValidationError as err:
        try:  # the decoder stops at the first wrong field: broken JSON after it is the first thing to fix
            msgspec.json.decode(raw)
        except msgspec.DecodeError as broken:
            if not str(broken).startswith("Number out of range"):  # JSON, but past a float: the field's error says it
                raise BadRecord(f"body is not valid JSON: {broken}") from None
        except RecursionError:
            raise BadRecord(TOO_DEEP) from None
        raise BadRecord(where(str(err), root, dotted=dotted)) from None
    except msgspec.DecodeError as err:
        raise BadRecord(f"body is not valid JSON: {err}") from None
    except RecursionError:  # no record nests deeply; msgspec's decoder would stack past Python's limit
        raise BadRecord(TOO_DEEP) from None


def parse(value: Any, record: type[T], root: str = "", *, dotted: bool = False) -> T:
    """Python values (a decoded JSON line, a test's dict) -> `record`, checked as `decode` checks raw JSON."""
    try:
        return msgspec.convert(value, record)
    except msgspec.ValidationError as err:
        raise BadRecord(where(str(err), root, dotted=dotted)) from None
    except RecursionError:
        raise BadRecord(TOO_DEEP) from None


_ROW_FIELD = re.compile(r"(\.rows\[\d+\])\[(\d+)\]")
_ROW = re.compile(r"\.rows\[\d+\]")


def where(message: str, root: str, *, dotted: bool = False) -> str:
    """msgspec's 'Expected ... - at `$.rows[0][10]`' -> 'digest.rows[0].pid: Expected ...' (a row's array
    index read as its field name). A check of several fields (__post_init__) names its field first."""
    text, at, path = message.rpartition(" - at `")
    if not at:
        text, path = message, ""
    key = path.startswith(_KEY_IN)  # a dict's key, not a value: "... - at `key` in `$.a.b`"
    path = path.removeprefix(_KEY_IN).rstrip("`").removeprefix("$")
    if key:
        text = f"a key: {text}"
    if m := _ROW_FIELD.fullmatch(path):
        path = f"{m[1]}.{ROW_FIELDS[int(m[2])]}"
    elif _ROW.fullmatch(path):
        text += f" (a row is [{', '.join(ROW_FIELDS)}], the last {len(Activity.__struct_defaults__)} optional)"
    if m := _FIELD_FIRST.match(text):
        path, text = f"{path}.{m[1]}", text[m.end() :]
    elif m := _MISSING.fullmatch(text):
        path, text = f"{path}.{m[1]}", "required, but missing"
    elif m := _UNKNOWN.fullmatch(text):
        path, text = f"{path}.{m[1]}", "not a field of this body (a typo?)"
    if dotted:
        path = _INDEX.sub(r".\1", path)
    text = text.replace(f"matching regex {PRINTABLE + PYTHON_END!r}", "without control characters")
    name = path.rpartition(".")[2]
    choices = STATES[root or "activity"] if name == "state" else _CHOICES.get(name)
    if "Invalid enum value" in text and choices:
        text += f" (one of {', '.join(choices)})"
    return f"{(root + path).lstrip('.') or 'body'}: {text}"


_FIELD_FIRST = re.compile(r"([a-z_]+): ")
_MISSING = re.compile(r"Object missing required field `(\w+)`")
_UNKNOWN = re.compile(r"Object contains unknown field `(\w+)`")
_INDEX = re.compile(r"\[(\d+)\]")
_KEY_IN = "key` in `"
_CHOICES: dict[str, tuple[str, ...]] = {
    "action": tuple(Action),
    "op": tuple(CollectiveOp),
    "group": tuple(GroupRole),
    "groups": tuple(GroupRole),
    "outcome": tuple(Outcome),
    "counts": tuple(Outcome),
    "time_seconds": tuple(TimeCategory),
}
"""Closed sets whose members an error lists (a state's depend on the record: STATES)."""


def encode(record: Struct) -> bytes:
    return msgspec.json.encode(record)


def openapi_schemas(types: tuple[type, ...]) -> dict[str, Any]:
    """The JSON schemas of `types` and the records they hold, named as their classes, for the OpenAPI document."""
    _, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    return {name: _ecma(schema) for name, schema in components.items()}


def _ecma(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            k: v.removesuffix(PYTHON_END) + ECMA_END if k == "pattern" and v.endswith(PYTHON_END) else _ecma(v)
            for k, v in schema.items()
        }
    return [_ecma(v) for v in schema] if isinstance(schema, list) else schema
