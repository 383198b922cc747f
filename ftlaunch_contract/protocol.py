"""Control-plane messages: versioned, schema-checked msgpack maps signed with the job's secret.

A message on the wire is one ZeroMQ frame: ``msgpack(body)`` followed by
``HMAC-SHA256(secret, body)`` (one frame, never several: libzmq 4.3 aborts a process whose
closing socket is part-way through a message of several frames when the connection drops,
zeromq/libzmq#3442).
Nothing is ever unpickled; anything forged, replayed, malformed, oversized or of another
version raises ``ProtocolError``, which receivers log and drop.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, get_type_hints

import msgpack

from ftlaunch_contract import messages
from ftlaunch_contract.messages import Body

VERSION = 3
TICK_INTERVAL = 0.5
"""Seconds between a managed rank's ticks to its agent (from the shim's own thread, so the
agent tells a frozen rank from one blocked in a collective)."""
MAX_BYTES = 1 << 20  # assign carries the member list (~40 B a node)
MAC_BYTES = 32  # HMAC-SHA256

_INT = int
_STR = str
_FLOAT = (int, float)
_OPT_INT = (int, type(None))


_SEQUENCES = (list, tuple)


def _rows(record: type[tuple[Any, ...]]) -> Any:
    """A list of ``record``s, each a list of its fields' types (an int is never a bool)."""
    types = list(get_type_hints(record).values())
    width = len(types)

    # An assign's members and spares (both of Successors) go out N times a round, unchanged:
    # the last few checked, held so that `is` cannot meet a new object at a freed address.
    recent: deque[Any] = deque(maxlen=4)

    def check(value: Any) -> bool:
        for seen in recent:
            if value is seen:  # a tuple of tuples of ints and strs: immutable, checked
                return True
        ok = isinstance(value, (list, tuple)) and len(value) <= 100_000 and all(
            isinstance(row, _SEQUENCES) and len(row) == width for row in value) and [
            type(field) for row in value for field in row] == types * len(value)  # exact
        if ok and value and type(value) is tuple and all(type(row) is not list for row in value):
            recent.append(value)
        return ok
    return check


def _bool(value: Any) -> bool:
    return type(value) is bool


def EPOCHS_CHECK(value: Any) -> bool:  # noqa: N802 (a constant, as ROW_CHECKS' are)
    """A list of epochs (ints, never bools)."""
    return isinstance(value, (list, tuple)) and len(value) <= 10_000 and all(
        type(v) is int for v in value)


def _env(value: Any) -> bool:
    return isinstance(value, dict) and len(value) <= 10_000 and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


ROW_CHECKS = {record: _rows(record) for record in messages.ROWS.values()}
_CHECKS: dict[Any, Any] = {int: _INT, str: _STR, float: _FLOAT, int | None: _OPT_INT,
                           bool: _bool, messages.Env: _env, messages.Epochs: EPOCHS_CHECK,
                           **{rows: ROW_CHECKS[record] for rows, record in messages.ROWS.items()}}
"""What a field's annotation demands of its value on the wire (an int is never a bool)."""


def _schema(types: dict[str, type[Body]]) -> dict[str, dict[str, Any]]:
    schema = {}
    for kind, cls in types.items():
        hints = get_type_hints(cls, vars(messages))
        schema[kind] = {f.name: _CHECKS[hints[f.name]] for f in dataclasses.fields(cls)}
    return schema


SCHEMA = _schema(messages.CONTROL)
"""Fields of each control-plane message type beyond the envelope (v, type, epoch, sid, seq)."""
LOCAL_SCHEMA = _schema(messages.LOCAL)
"""Messages between the agent and its own ranks. The ipc:// socket lives in a 0700 directory,
so the file system is the authentication; they are schema-checked msgpack all the same."""


def pack_local(msg: Body) -> bytes:
    payload = msg.payload()
    _check_fields(msg.TYPE, payload, LOCAL_SCHEMA)
    packed: bytes = msgpack.packb({"type": msg.TYPE, **payload})
    return packed


def unpack_local(data: bytes) -> Body:
    """Decode a node-local message; anything malformed raises ProtocolError."""
    if len(data) > MAX_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_BYTES}")
    fields = unpack_map(data)
    kind = fields.pop("type", None)
    _check_fields(kind, fields, LOCAL_SCHEMA)
    return _build(messages.LOCAL[kind], fields)


def _row_fields(types: dict[str, type[Body]]) -> dict[type[Body], tuple[tuple[str, Any], ...]]:
    """Per message class: its fields that hold lists, with the record each row becomes (None:
    a list of ints, which becomes a tuple as it is)."""
    out = {}
    for cls in types.values():
        hints = get_type_hints(cls, vars(messages))
        out[cls] = tuple((name, messages.ROWS.get(hint)) for name, hint in hints.items()
                         if hint in messages.ROWS or hint == messages.Epochs)
    return out


_ROW_FIELDS = {**_row_fields(messages.CONTROL), **_row_fields(messages.LOCAL)}
"""Computed once: resolving a class's annotations costs more than all the rest of a decode."""


def _build(cls: type[Body], fields: dict[str, Any]) -> Body:
    for name, record in _ROW_FIELDS[cls]:
        fields[name] = tuple(fields[name]) if record is None else \
            tuple(map(partial(tuple.__new__, record), fields[name]))  # rows checked: _make's
        # work but its length check, without a Python call a row
    return cls(**fields)


Verified = tuple[str, int, str, int, dict[str, Any]]
"""A message checked by Codec.verify: its type, epoch, sender, sequence number and fields."""


class ProtocolError(ValueError):
    """A message that must be dropped; the text says why."""


@dataclass(frozen=True)
class Envelope:
    """A control-plane message as received: its job epoch, and the message."""

    epoch: int
    body: Body


class Codec:
    """Signs outgoing and verifies incoming messages for one endpoint (one per socket/thread)."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError("the job secret must be at least 16 bytes")
        self._secret = secret
        self._sid = os.urandom(8).hex()
        self._seq = 0
        self._last_seq: dict[str, int] = {}

    @property
    def sent(self) -> int:
        """How many messages this codec encoded: the last one's sequence number."""
        return self._seq

    def encode(self, msg: Body, epoch: int) -> list[bytes]:
        payload = msg.payload()
        _check_fields(msg.TYPE, payload)
        self._seq += 1
        body = msgpack.packb({"v": VERSION, "type": msg.TYPE, "epoch": epoch, "sid": self._sid,
                              "seq": self._seq, "ts": time.time(), **payload})
        return [body + hmac.digest(self._secret, body, "sha256")]

    def reserve(self, template: Body, own: tuple[str, ...], epoch: int,
                count: int) -> tuple[bytes, int]:
        """For ``count`` messages equal to ``template`` but for the fields ``own`` (a round's
        assigns: each node's seat): the envelope and the fields they share, checked and
        packed once, and the first of the sequence numbers reserved for them. sign() then
        finishes each, here or in an intake process (launcher.intake): an assign ~1 µs of
        the coordinator's thread instead of ~11. On the wire the map encode() would send,
        keys in another order."""
        kind, shared = template.TYPE, template.payload()
        _check_fields(kind, shared)
        for name in own:
            del shared[name]
        head = {"v": VERSION, "type": kind, "epoch": epoch, "sid": self._sid, "ts": time.time(),
                **shared}
        first, self._seq = self._seq + 1, self._seq + count
        return _map_header(len(head) + len(own) + 1) + _map_items(head), first  # + 1: seq

    def sign(self, head: bytes, kind: str, own: Sequence[str], values: Sequence[Any],
             seq: int) -> list[bytes]:
        """One of reserve()'s messages: its ``own`` fields' ``values`` checked as encode()
        checks them, packed after ``head`` with its sequence number, signed."""
        mine = dict(zip(own, values, strict=True))
        _check_values(kind, mine, _tests_of(kind, tuple(own)))
        mine["seq"] = seq
        body = head + _map_items(mine)
        return [body + hmac.digest(self._secret, body, "sha256")]

    def decode(self, frames: list[bytes]) -> Envelope:
        return self.accept(self.verify(frames))

    def verify(self, frames: list[bytes]) -> Verified:
        """A message's signature, size, version, envelope and fields checked: the half of
        decode that needs no memory of what came before (an intake process's share)."""
        if len(frames) != 1:
            raise ProtocolError(f"expected 1 frame, got {len(frames)} (a peer of another "
                                "ftlaunch version? every node must run the same one)")
        body, mac = frames[0][:-MAC_BYTES], frames[0][-MAC_BYTES:]
        if len(body) > MAX_BYTES:
            raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_BYTES}")
        expected = hmac.digest(self._secret, body, "sha256")
        if not hmac.compare_digest(expected, mac):
            raise ProtocolError("bad signature (wrong job secret or forged message)")
        data = unpack_map(body)
        version = data.pop("v", None)
        if type(version) is not int or version != VERSION:
            raise ProtocolError(f"unsupported protocol version (this side speaks {VERSION})")
        kind, epoch = data.pop("type", None), data.pop("epoch", None)
        sid, seq = data.pop("sid", None), data.pop("seq", None)
        data.pop("ts", None)
        if type(epoch) is not int or type(seq) is not int or not isinstance(sid, str):
            raise ProtocolError("bad envelope")
        _check_fields(kind, data)
        return kind, epoch, sid, seq, data

    def accept(self, verified: Verified | list[Any]) -> Envelope:
        """A verified message, unless it is a replay: the half of decode that remembers."""
        kind, epoch, sid, seq, data = verified
        if seq <= self._last_seq.get(sid, 0):
            raise ProtocolError(f"replayed message (seq {seq} from {sid})")
        self._last_seq[sid] = seq
        return Envelope(epoch, _build(messages.CONTROL[kind], data))


def _map_header(count: int) -> bytes:
    """msgpack's header of a map of ``count`` pairs (fixmap, else map 16)."""
    return bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")


def _map_items(fields: dict[str, Any]) -> bytes:
    """``fields``' pairs as msgpack packs them in a map, without the map's header."""
    packed: bytes = msgpack.packb(fields)
    return packed[len(_map_header(len(fields))):]


def unpack_map(body: bytes) -> dict[str, Any]:
    """msgpack that must decode to a map (never anything executable)."""
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"undecodable body: {type(e).__name__}") from None
    if not isinstance(data, dict):
        raise ProtocolError("body is not a map")
    return data


def _predicate(expected: Any) -> tuple[frozenset[type], Any]:
    """``expected`` (a type, a tuple of types or a check) as one test of a value, and the
    exact types that pass it without the test (what msgpack decodes to: a plain int, str...)."""
    if callable(expected) and not isinstance(expected, (type, tuple)):
        return frozenset(), expected
    exact = frozenset(expected if isinstance(expected, tuple) else (expected,)) - {bool}
    return exact, lambda value: isinstance(value, expected) and not isinstance(value, bool)


_COMPILED: dict[int, dict[str, tuple[Any, tuple[tuple[str, frozenset[type], Any], ...]]]] = {}


def _compiled(schemas: dict[str, dict[str, Any]]) -> dict[str, tuple[Any, tuple[tuple[str, frozenset[type], Any], ...]]]:
    """Per kind: its field names and a test for each, built once (a heartbeat is checked
    thousands of times a second at a large job's coordinator)."""
    if id(schemas) not in _COMPILED:
        _COMPILED[id(schemas)] = {kind: (schema.keys(), tuple(
            (name, *_predicate(expected)) for name, expected in schema.items()))
            for kind, schema in schemas.items()}
    return _COMPILED[id(schemas)]


@functools.cache
def _tests_of(kind: str, names: tuple[str, ...]) -> tuple[tuple[str, frozenset[type], Any], ...]:
    return tuple(test for test in _compiled(SCHEMA)[kind][1] if test[0] in names)


def _check_fields(kind: Any, fields: dict[str, Any],
                  schemas: dict[str, dict[str, Any]] = SCHEMA) -> None:
    compiled = _compiled(schemas).get(kind) if isinstance(kind, str) else None
    if compiled is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    names, tests = compiled
    if fields.keys() != names:
        raise ProtocolError(f"{kind}: fields {sorted(map(repr, fields))} != {sorted(names)}")
    _check_values(kind, fields, tests, schemas)


def _check_values(kind: str, fields: dict[str, Any], tests: Sequence[tuple[str, frozenset[type], Any]],
                  schemas: dict[str, dict[str, Any]] = SCHEMA) -> None:
    """The ``fields`` that ``tests`` name (of a known ``kind``) as its schema demands."""
    for name, exact, test in tests:
        value = fields[name]
        if type(value) not in exact and not test(value):  # the set first: most fields pass it
            expected = schemas[kind][name]
            what = "malformed" if test is expected else f"wrong type {type(value).__name__}"
            raise ProtocolError(f"{kind}.{name}: {what}")
