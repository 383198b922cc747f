"""Control-plane messages: versioned, schema-checked msgpack maps signed with the job's secret.

A message on the wire is two ZeroMQ frames: ``msgpack(body)`` and ``HMAC-SHA256(secret, body)``.
Nothing is ever unpickled; anything forged, replayed, malformed, oversized or of another
version raises ``ProtocolError``, which receivers log and drop.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any

import msgpack

VERSION = 1
TICK_INTERVAL = 0.5
"""Seconds between a managed rank's ticks to its agent (from the shim's own thread, so the
agent tells a frozen rank from one blocked in a collective)."""
MAX_BYTES = 1 << 20  # assign carries the member list (~40 B a node)

_INT = int
_STR = str
_FLOAT = (int, float)
_OPT_INT = (int, type(None))


def _members(value: Any) -> bool:
    """[[node_id, addr, standby_port], ...] in group-rank order."""
    return isinstance(value, list) and len(value) <= 100_000 and all(
        isinstance(m, list) and len(m) == 3 and isinstance(m[0], str) and isinstance(m[1], str)
        and type(m[2]) is int for m in value)


SCHEMA: dict[str, dict[str, Any]] = {
    # agent -> coordinator
    "join": {"node_id": _STR, "local_world_size": _INT, "addr": _STR, "standby_port": _INT,
             "rank_hint": _INT},
    "heartbeat": {"node_id": _STR},
    "store_ready": {"master_addr": _STR, "master_port": _INT},
    "failure": {"node_id": _STR, "rank": _INT, "local_rank": _INT, "exit_code": _OPT_INT,
                "signal": _STR, "cause": _STR, "step": _INT},
    "finished": {"node_id": _STR},
    "durable": {"node_id": _STR, "rank": _INT, "step": _INT},  # a checkpoint shard, relayed
    "leave": {"node_id": _STR, "exit_code": _INT, "reason": _STR},
    "unhealthy": {"node_id": _STR, "reason": _STR},  # exclude this node, go on without it
    # coordinator -> agent
    "heartbeat_ack": {},
    "assign": {"group_rank": _INT, "group_world_size": _INT, "rank_offset": _INT,
               "world_size": _INT, "restart_count": _INT, "max_restarts": _INT,
               "members": _members, "coordinator_node": _STR},
    "start": {"master_addr": _STR, "master_port": _INT, "restart_count": _INT},
    "recover": {"policy": _STR, "restart_count": _INT, "delay": _FLOAT, "cause": _STR},
    "stop": {"exit_code": _INT, "reason": _STR},
    "committed": {"step": _INT},  # every rank's shard of this checkpoint step is durable
}
"""Fields of each message type beyond the envelope (v, type, epoch, sid, seq)."""


def _bool(value: Any) -> bool:
    return type(value) is bool


def _env(value: Any) -> bool:
    return isinstance(value, dict) and len(value) <= 10_000 and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items())


LOCAL_SCHEMA: dict[str, dict[str, Any]] = {
    # rank (trainer_shim) -> agent, over the node-local ipc:// socket
    "hello": {"pid": _INT, "stacks": _bool},  # from the shim's command socket
    "restartable": {"pid": _INT},  # the rank runs inside trainer_shim.restartable
    "beat": {"pid": _INT, "step": _INT},
    "tick": {"pid": _INT, "sent": _FLOAT},  # time.monotonic() when sent (one clock per host)
    "learned": {"pid": _INT, "interval": _FLOAT},  # longest heartbeat interval, restored  # from the shim's own thread: the process runs, whatever training does
    "section": {"pid": _INT, "name": _STR, "open": _bool},
    "parked": {"pid": _INT, "error": _STR},
    "durable": {"pid": _INT, "rank": _INT, "step": _INT},  # its shard of a checkpoint step
    # agent -> rank
    "abort": {},
    "resume": {"env": _env},
    "committed": {"step": _INT},  # every rank's shard of this step is durable
}
"""Messages between the agent and its own ranks. The ipc:// socket lives in a 0700 directory,
so the file system is the authentication; they are schema-checked msgpack all the same."""


def pack_local(kind: str, **fields: Any) -> bytes:
    _check_fields(kind, fields, LOCAL_SCHEMA)
    return msgpack.packb({"type": kind, **fields})


def unpack_local(data: bytes) -> Message:
    """Decode a node-local message; anything malformed raises ProtocolError."""
    if len(data) > MAX_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_BYTES}")
    fields = _unpack_map(data)
    kind = fields.pop("type", None)
    _check_fields(kind, fields, LOCAL_SCHEMA)
    return Message(kind, 0, fields)


class ProtocolError(ValueError):
    """A message that must be dropped; the text says why."""


@dataclass(frozen=True)
class Message:
    type: str
    epoch: int
    fields: dict[str, Any]

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]


class Codec:
    """Signs outgoing and verifies incoming messages for one endpoint (one per socket/thread)."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError("the job secret must be at least 16 bytes")
        self._secret = secret
        self._sid = os.urandom(8).hex()
        self._seq = itertools.count(1)
        self._last_seq: dict[str, int] = {}

    def encode(self, type: str, epoch: int, **fields: Any) -> list[bytes]:
        _check_fields(type, fields)
        body = msgpack.packb({"v": VERSION, "type": type, "epoch": epoch, "sid": self._sid,
                              "seq": next(self._seq), "ts": time.time(), **fields})
        return [body, hmac.new(self._secret, body, hashlib.sha256).digest()]

    def decode(self, frames: list[bytes]) -> Message:
        if len(frames) != 2:
            raise ProtocolError(f"expected 2 frames, got {len(frames)}")
        body, mac = frames
        if len(body) > MAX_BYTES:
            raise ProtocolError(f"message of {len(body)} bytes exceeds {MAX_BYTES}")
        expected = hmac.new(self._secret, body, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, mac):
            raise ProtocolError("bad signature (wrong job secret or forged message)")
        data = _unpack_map(body)
        version = data.pop("v", None)
        if type(version) is not int or version != VERSION:
            raise ProtocolError(f"unsupported protocol version (this side speaks {VERSION})")
        kind, epoch = data.pop("type", None), data.pop("epoch", None)
        sid, seq = data.pop("sid", None), data.pop("seq", None)
        data.pop("ts", None)
        if type(epoch) is not int or type(seq) is not int or not isinstance(sid, str):
            raise ProtocolError("bad envelope")
        _check_fields(kind, data)
        if seq <= self._last_seq.get(sid, 0):
            raise ProtocolError(f"replayed message (seq {seq} from {sid})")
        self._last_seq[sid] = seq
        return Message(kind, epoch, data)


def _unpack_map(body: bytes) -> dict[str, Any]:
    """msgpack that must decode to a map (never anything executable)."""
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:
        raise ProtocolError(f"undecodable body: {type(e).__name__}") from None
    if not isinstance(data, dict):
        raise ProtocolError("body is not a map")
    return data


def _check_fields(kind: Any, fields: dict[str, Any],
                  schemas: dict[str, dict[str, Any]] = SCHEMA) -> None:
    schema = schemas.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    if set(fields) != set(schema):
        raise ProtocolError(f"{kind}: fields {sorted(map(repr, fields))} != {sorted(schema)}")
    for name, expected in schema.items():
        value = fields[name]
        if callable(expected) and not isinstance(expected, (type, tuple)):
            if not expected(value):
                raise ProtocolError(f"{kind}.{name}: malformed")
        elif isinstance(value, bool) or not isinstance(value, expected):
            raise ProtocolError(f"{kind}.{name}: wrong type {type(value).__name__}")
