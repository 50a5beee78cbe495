"""Payloads: how a history entry's record is read from its stored JSON and written back.

A record (:class:`Record`) is a frozen dataclass whose fields say what its payload holds:
each is written under its name in its JSON form, and read back checked against its type
(by readers made from its annotations once per kind of record, not for every entry of a
long history). The kinds of entries themselves, and the rules that keep every history
readable, are :mod:`entries`.

A payload leaves out an optional field the record does not hold (None), except the ones
its writer has always written as null; a required field is always written. Reading
refuses a payload that is not the entry its action names (a required field missing, a
value of another type than every version wrote) with :class:`MalformedEntry`, naming the
field; what the values mean (whether a cost is what its mechanism costs, a split moves
fewer subjects than its parent holds) is verify's to judge, entry by entry.
"""

from __future__ import annotations

import functools
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import (
    Any,
    ClassVar,
    NamedTuple,
    TypeVar,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

from dp_budget_provider.ledger.accounts.keys import LedgerKey
from dp_budget_provider.ledger.accounts.spend import Spend
from dp_budget_provider.ledger.errors import LedgerCorrupt

R = TypeVar("R", bound="Record")
E = TypeVar("E", bound="Entry")
L = TypeVar("L", bound="ListRecord")

# A field's name in the payload where it is not the attribute's (a Python keyword).
_KEY = "key"
# An optional field its writer writes as null when it has no value (its absence from
# an older entry means the same).
_NULL_WRITTEN = "null written"


class MalformedEntry(LedgerCorrupt):
    """A stored payload that is not the entry its action names: a field every version
    wrote is missing, or a value is of another type. Only an edit of the history makes
    one (verify reports it as that entry's problem)."""


def named(name: str) -> Any:
    """A required field written under ``name`` in the payload (a Python keyword)."""
    return field(metadata={_KEY: name})


def null_written() -> Any:
    """An optional field its writer writes as null when it has no value."""
    return field(default=None, metadata={_NULL_WRITTEN: True})


@dataclass(frozen=True, kw_only=True)
class Record:
    """A JSON object of named, typed fields: an entry's payload, or a part of one.

    Each field is written under its name (:func:`named` names another), in its JSON form:
    a cost as :meth:`Spend.as_payload`, a key as :meth:`LedgerKey.as_dict`, a tuple as a
    list, a record as its payload (or its list).
    """

    def payload(self) -> dict[str, Any]:
        """The record as the history stores it (None as the module says)."""
        written = {}
        for item in _layout(type(self)):
            value = getattr(self, item.attribute)
            if value is not None or item.null_written:
                written[item.name] = _plain(value)
        return written

    @classmethod
    def read(cls: type[R], payload: Any) -> R:
        """The record a stored payload holds, checked; KeyError, TypeError, ValueError or
        LedgerCorrupt where it holds none (:meth:`Entry.from_payload` names which)."""
        found = _object(payload)
        values = {}
        for item in _layout(cls):
            if item.name in found:
                values[item.attribute] = _within(item.name, item.read, found[item.name])
            elif not item.optional:
                raise KeyError(item.name)
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Entry(Record):
    """One kind of history entry: its action, and the payload that action writes."""

    action: ClassVar[str]

    @classmethod
    def from_payload(cls: type[E], payload: Any) -> E:
        """The entry a stored payload holds; :class:`MalformedEntry`, saying what and
        where, if the payload is not one."""
        try:
            return cls.read(payload)
        except _FAILURES as error:
            raise MalformedEntry(f"a {cls.action} entry's payload: {_said(error)}") from error


class ListRecord(ABC):
    """A part of a payload written as a JSON list, its items in order (compact where a
    charge lists many of them)."""

    @abstractmethod
    def as_list(self) -> list[Any]:
        """The part as the history stores it."""

    @classmethod
    @abstractmethod
    def read(cls: type[L], payload: Any) -> L:
        """The part a stored list holds, checked (as :meth:`Record.read`)."""


def read_value(where: str | int, hint: Any, value: Any) -> Any:
    """``value`` read as a field of type ``hint``; a failure names ``where`` (a field, or
    an item's index) and the path inside it."""
    return _within(where, _reader(hint), value)


def read_object(value: Any) -> dict[str, Any]:
    """A payload's JSON object (a record's own reading starts with it)."""
    return _object(value)


def read_items(value: Any, fewest: int, most: int) -> list[Any]:
    """A list record's items: ``fewest`` to ``most`` of them."""
    items = _list(value)
    if not fewest <= len(items) <= most:
        raise ValueError(f"a list of {len(items)}, not of {fewest} to {most}")
    return items


_FAILURES = (KeyError, TypeError, ValueError, LedgerCorrupt)


class _Unreadable(ValueError):
    """A part of a payload that is not what its field holds, and the path to it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path.lstrip('.')}: {reason}")
        self.path = path
        self.reason = reason


def _said(error: Exception) -> str:
    """What went wrong, in words: a missing field is named, anything else says itself."""
    if type(error) is KeyError:
        return f"no {error.args[0]!r}"
    return str(error)


def _within(where: str | int, read: Callable[[Any], Any], value: Any) -> Any:
    """``read(value)``, a failure naming where it failed: the field ``where`` (or the
    item at that index) and the path inside it."""
    try:
        return read(value)
    except _Unreadable as error:
        step = f"[{where}]" if isinstance(where, int) else f".{where}"
        raise _Unreadable(step + error.path, error.reason) from error.__cause__
    except _FAILURES as error:
        step = f"[{where}]" if isinstance(where, int) else f".{where}"
        raise _Unreadable(step, _said(error)) from error


class _Field(NamedTuple):
    """How one field of a record is read and written."""

    attribute: str
    name: str  # in the payload
    read: Callable[[Any], Any]
    optional: bool
    null_written: bool  # written as null when None (a required field always is)


@functools.cache
def _layout(cls: type[Record]) -> tuple[_Field, ...]:
    """A record's fields, made once per kind from its annotations (strings here)."""
    hints = get_type_hints(cls)
    return tuple(
        _Field(
            attribute=item.name,
            name=item.metadata.get(_KEY, item.name),
            read=_reader(hints[item.name]),
            optional=item.default is not MISSING,
            null_written=item.default is MISSING or bool(item.metadata.get(_NULL_WRITTEN)),
        )
        for item in fields(cls)
    )


# What a field of each plain type accepts (a whole number may be written without a
# fraction), and the JSON names of the types, for refusals.
_ACCEPTS: dict[Any, tuple[type, ...]] = {
    str: (str,),
    int: (int,),
    float: (int, float),
    bool: (bool,),
    list: (list,),
    dict: (dict,),
}
_NAMES = {
    str: "a text",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    list: "a list",
    dict: "an object",
    type(None): "null",
}


@functools.cache
def _reader(hint: Any) -> Callable[[Any], Any]:
    """What reads a field of type ``hint`` from its JSON value, checked: plain values,
    lists into tuples, costs, keys and records (made once per type)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        (inner,) = (arg for arg in args if arg is not type(None))
        read = _reader(inner)
        return lambda value: None if value is None else read(value)
    if origin is tuple and args[-1] is Ellipsis:
        return _texts if args[0] is str else _sequence(_reader(args[0]))
    if origin is tuple:
        return _fixed(tuple(_reader(arg) for arg in args))
    if origin is dict:
        return _object
    if hint is Spend:
        return lambda value: Spend.from_payload(_object(value), None)
    if hint is LedgerKey:
        return _key
    if issubclass(hint, (Record, ListRecord)):
        return hint.read
    return _plain_reader(hint)


def _plain_reader(hint: type) -> Callable[[Any], Any]:
    accepted, wanted = _ACCEPTS[hint], _NAMES[hint]

    def read(value: Any) -> Any:
        if not isinstance(value, accepted) or (isinstance(value, bool) and hint is not bool):
            raise TypeError(f"{_NAMES.get(type(value), type(value).__name__)}, not {wanted}")
        return value

    return read


def _sequence(item: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, ...]]:
    return lambda value: tuple(_within(i, item, each) for i, each in enumerate(_list(value)))


def _fixed(items: tuple[Callable[[Any], Any], ...]) -> Callable[[Any], tuple[Any, ...]]:
    def read(value: Any) -> tuple[Any, ...]:
        found = _list(value)
        if len(found) != len(items):
            raise ValueError(f"a list of {len(found)}, not of {len(items)}")
        return tuple(
            _within(i, item, each) for i, (item, each) in enumerate(zip(items, found, strict=True))
        )

    return read


def _key(value: Any) -> LedgerKey:
    parts = _object(value)
    if not all(isinstance(part, str) for part in parts.values()):
        raise TypeError("a key's parts are texts")
    return LedgerKey.from_canonical(**parts)


_text = _plain_reader(str)
_list = _plain_reader(list)
_object = _plain_reader(dict)


def _texts(value: Any) -> tuple[str, ...]:
    """A list of texts, checked at once (a listing may hold many accounts); item by item
    only to name the one that is not a text."""
    items = _list(value)
    if all(isinstance(item, str) for item in items):
        return tuple(items)
    return tuple(_within(i, _text, item) for i, item in enumerate(items))


def _plain(value: Any) -> Any:
    """A field's value as JSON holds it."""
    if isinstance(value, Record):
        return value.payload()
    if isinstance(value, ListRecord):
        return value.as_list()
    if isinstance(value, Spend):
        return value.as_payload()
    if isinstance(value, LedgerKey):
        return value.as_dict()
    if isinstance(value, tuple):
        return [_plain(item) for item in value]
    return value
