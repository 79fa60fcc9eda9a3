"""A record read from etcd is untrusted input: anyone who can write the job's keys
may have written it. Before a record is made, each field's JSON value is checked
against the field's annotation, so a malformed value fails here, by name, rather
than as a TypeError deep in a reader (a dashboard's 500, a worker's traceback)."""
from __future__ import annotations

import functools
import types
import typing
from dataclasses import fields


class BadRecord(ValueError):
    """A stored value whose shape is not its record's: one line naming the field."""


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def fits(value, hint) -> bool:
    """Whether a JSON `value` can stand for a field annotated `hint` (the kinds
    records use: scalars, dict, list, tuple[int, ...], and unions with None)."""
    hint = getattr(hint, "__supertype__", hint)  # NewType: its base
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, h) for h in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        kinds = (int,) if hint is int else (int, float)
        return isinstance(value, kinds) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if (origin or hint) in (tuple, list):
        items = args[0] if args and (origin is list or args[-1] is Ellipsis) else None
        return isinstance(value, (list, tuple)) and (items is None or all(fits(v, items) for v in value))
    if (origin or hint) is dict:
        return isinstance(value, dict)
    return True  # a kind no record uses: not checked here


def checked(cls, d) -> dict:
    """The keyword arguments of `cls` from its stored JSON object `d`; BadRecord
    when `d` is no object or a field's value does not fit its annotation."""
    if not isinstance(d, dict):
        raise BadRecord(f"a {cls.__name__} record is {type(d).__name__}, not a JSON object")
    hints, out = _hints(cls), {}
    for f in fields(cls):
        if f.name not in d:
            continue
        if not fits(d[f.name], hints[f.name]):
            raise BadRecord(f"a {cls.__name__} record's {f.name} is {type(d[f.name]).__name__} "
                            f"{str(d[f.name])[:40]!r}, which does not fit {hints[f.name]}")
        out[f.name] = d[f.name]
    return out
