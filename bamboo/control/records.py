"""A record read from etcd is untrusted input: anyone who can write the job's keys
may have written it. Before a record is made, each field's JSON value is checked
against the field's annotation, so a malformed value fails here, by name, rather
than as a TypeError deep in a reader (a dashboard's 500, a worker's traceback)."""
from __future__ import annotations

import copy
import functools
import types
import typing
from dataclasses import fields, is_dataclass


class BadRecord(ValueError):
    """A stored value whose shape is not its record's: one line naming the field."""


def fits(value, hint) -> bool:
    """Whether a JSON `value` can stand for a field annotated `hint` (the kinds
    records use: scalars, dict, list, tuple[int, ...], and unions with None)."""
    return _checker(hint)(value)


@functools.lru_cache(maxsize=None)
def _checker(hint):
    """The test `fits` makes for `hint`, worked out once per annotation: a record is
    read thousands of times a second by a large job's readers."""
    hint = getattr(hint, "__supertype__", hint)  # NewType: its base
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        alternatives = tuple(_checker(h) for h in args)
        return lambda value: any(test(value) for test in alternatives)
    if hint is type(None):
        return lambda value: value is None
    if hint is bool:
        return lambda value: isinstance(value, bool)
    if hint in (int, float):
        kinds = (int,) if hint is int else (int, float)
        return lambda value: isinstance(value, kinds) and not isinstance(value, bool)
    if hint is str:
        return lambda value: isinstance(value, str)
    if (origin or hint) in (tuple, list):
        items = _checker(args[0]) if args and (origin is list or args[-1] is Ellipsis) else None
        return lambda value: isinstance(value, (list, tuple)) and (items is None or all(map(items, value)))
    if (origin or hint) is dict:
        return lambda value: isinstance(value, dict)
    return lambda value: True  # a kind no record uses: not checked here


@functools.lru_cache(maxsize=None)
def _fields(cls) -> tuple:
    """(name, annotation, its test) of each field of `cls`."""
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name], _checker(hints[f.name])) for f in fields(cls))


def checked(cls, d) -> dict:
    """The keyword arguments of `cls` from its stored JSON object `d`; BadRecord
    when `d` is no object or a field's value does not fit its annotation."""
    if not isinstance(d, dict):
        raise BadRecord(f"a {cls.__name__} record is {type(d).__name__}, not a JSON object")
    out = {}
    for name, hint, test in _fields(cls):
        if name not in d:
            continue
        if not test(d[name]):
            raise BadRecord(f"a {cls.__name__} record's {name} is {type(d[name]).__name__} "
                            f"{str(d[name])[:40]!r}, which does not fit {hint}")
        out[name] = d[name]
    return out


def plain(record) -> dict:
    """`record` (a dataclass of JSON-able fields) as a dict, its containers copied:
    what dataclasses.asdict gives, without asdict's deep copy of every leaf (a
    report is encoded a few times per node and iteration)."""
    return {name: _plain(getattr(record, name)) for name, _, _ in _fields(type(record))}


def _plain(value):
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map(_plain, value))
    if is_dataclass(value) and not isinstance(value, type):
        return plain(value)
    return copy.deepcopy(value)
