"""Control-plane codec: round trips, and everything forged, replayed or malformed is refused."""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import replace
from typing import get_type_hints

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ftlaunch_contract import messages as wire
from ftlaunch_contract.messages import (
    CONTROL,
    ROWS,
    Body,
    EarlierVoter,
    Fetch,
    Finished,
    HeldRun,
    NodeRankState,
    NodeState,
    Peer,
    RankState,
    Stop,
    Successor,
)
from ftlaunch_contract.protocol import (
    EPOCHS_CHECK,
    MAC_BYTES,
    MAX_BYTES,
    ROW_CHECKS,
    SCHEMA,
    VERSION,
    Codec,
    Envelope,
    ProtocolError,
)

SECRET = b"s" * 32
OTHER_SECRET = b"o" * 32

SAMPLE = {int: 7, str: "node-a", (int, float): 1.5, (int, type(None)): None,
          ROW_CHECKS[Successor]: [["node-a", "10.0.0.1", 4000], ["node-b", "10.0.0.2", 4001]],
          ROW_CHECKS[EarlierVoter]: [[1, 3, "node-a", False], [1, 3, "node-c", True]],
          ROW_CHECKS[Peer]: [["node-b", "10.0.0.2", 4100]],
          ROW_CHECKS[HeldRun]: [[6, 40, 0, 2], [6, 39, 4, 2]],
          ROW_CHECKS[Fetch]: [[6, 4, 40, "node-a", "10.0.0.1", 4100]],
          ROW_CHECKS[RankState]: [[0, 12, 40], [1, -1, -1]],
          ROW_CHECKS[NodeState]: [["node-a", 0, "running", 120]],
          ROW_CHECKS[NodeRankState]: [["node-a", 0, 12, 40]],
          EPOCHS_CHECK: [2, 3]}
RECORDS = {cls: {name: ROWS[hint] for name, hint in get_type_hints(cls, vars(wire)).items()
                 if hint in ROWS} for cls in CONTROL.values()}
"""Each message's fields that are lists of records -> the record type."""


def valid_fields(kind: str) -> dict:
    return {name: SAMPLE[expected] for name, expected in SCHEMA[kind].items()}


def body(kind: str, fields: dict) -> Body:
    """The typed message of ``kind`` (lists of records as the receiver builds them)."""
    cls = CONTROL[kind]
    fields = {**fields, **{name: tuple(record(*row) for row in fields[name])
                           for name, record in RECORDS[cls].items()},
              **{name: tuple(fields[name]) for name, check in SCHEMA[kind].items()
                 if check is EPOCHS_CHECK}}
    return cls(**fields)


def sign(body: bytes, secret: bytes = SECRET) -> list[bytes]:
    return [body + hmac.new(secret, body, hashlib.sha256).digest()]


def split(frames: list[bytes]) -> tuple[bytes, bytes]:
    """An encoded message's one frame as (body, mac)."""
    (frame,) = frames
    return frame[:-MAC_BYTES], frame[-MAC_BYTES:]


def envelope(**overrides) -> dict:
    return {"v": VERSION, "type": "finished", "epoch": 3, "sid": "abcd", "seq": 1, "ts": 1.0,
            **overrides}


def finished(**overrides) -> dict:
    """A valid ``finished`` body (before signing), with ``overrides`` applied."""
    return {**envelope(), "node_id": "n0", **overrides}


def signed(data) -> list[bytes]:
    return sign(msgpack.packb(data))


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(SCHEMA))
def test_round_trip_every_type(kind):
    sender, receiver = Codec(SECRET), Codec(SECRET)
    fields = valid_fields(kind)
    frames = sender.encode(body(kind, fields), 5)
    assert len(frames) == 1 and isinstance(frames[0], bytes)
    msg = receiver.decode(frames)
    assert (msg, msg.body.TYPE) == (Envelope(5, body(kind, fields)), kind)


def round_of_assigns(n: int) -> list[Body]:
    """A round's assigns: one members list for all, each node its own seat and peers."""
    fields = {**valid_fields("assign"), "group_world_size": n, "world_size": 8 * n}
    shared = body("assign", fields)
    return [replace(shared, group_rank=i, rank_offset=8 * i, fetch=(),
                    replicate_to=(Peer(f"node-{i + 1}", "10.0.0.9", 4100 + i),)) for i in range(n)]


def encoded_together(assigns: list[Body], codec: Codec | None = None) -> list[list[bytes]]:
    """A round's assigns as the coordinator encodes them: the first one's shared part once
    (Codec.reserve), then each seat signed (Codec.sign), as an intake process would."""
    codec = codec or Codec(SECRET)
    seat = wire.Assign.SEAT
    head, first = codec.reserve(assigns[0], seat, 4, len(assigns))
    return [codec.sign(head, "assign", seat, [getattr(a, f) for f in seat], seq)
            for seq, a in enumerate(assigns, first)]


@pytest.mark.parametrize("n", [1, 3, 20])
def test_a_rounds_assigns_encoded_together_decode_as_each_alone(n):
    assigns, receiver = round_of_assigns(n), Codec(SECRET)
    frames = encoded_together(assigns)
    assert [receiver.decode(f) for f in frames] == [Envelope(4, a) for a in assigns]
    alone = msgpack.unpackb(split(Codec(SECRET).encode(assigns[-1], 4))[0])
    together = msgpack.unpackb(split(frames[-1])[0])
    for envelope_only in ("sid", "seq", "ts"):
        del alone[envelope_only], together[envelope_only]
    assert together == alone


def test_a_seat_signed_elsewhere_is_the_senders_and_its_sequence_numbers_follow_on():
    """An intake signs with its own Codec of the job's secret: the receiver sees one sender,
    whose next message (an ack, encoded by the coordinator) is no replay."""
    coordinator, intake, receiver = Codec(SECRET), Codec(SECRET), Codec(SECRET)
    assigns = round_of_assigns(2)
    head, first = coordinator.reserve(assigns[0], wire.Assign.SEAT, 4, 2)
    seat = [getattr(assigns[1], f) for f in wire.Assign.SEAT]
    assert receiver.decode(intake.sign(head, "assign", wire.Assign.SEAT, seat, first + 1)).body \
        == assigns[1]
    ack = coordinator.encode(wire.HeartbeatAck(settled_below=-1), 4)
    assert isinstance(receiver.decode(ack).body, wire.HeartbeatAck)
    with pytest.raises(ProtocolError, match="replayed"):  # the one before, signed late
        receiver.decode(intake.sign(head, "assign", wire.Assign.SEAT, seat, first))


@pytest.mark.parametrize("name, value", [("group_rank", "1"), ("replicate_to", [["a", "b"]]),
                                         ("members", "node-a")])
def test_assigns_encoded_together_are_checked_as_each_alone(name, value):
    """A seat's field as it is signed; a shared one in the part they share."""
    assigns = round_of_assigns(3)
    at = 0 if name == "members" else 2
    assigns[at] = replace(assigns[at], **{name: value})
    with pytest.raises(ProtocolError, match=f"assign.{name}"):
        encoded_together(assigns)


@pytest.mark.parametrize("value", [None, 0, -15, 137])
def test_failure_exit_code_is_optional_int(value):
    fields = {**valid_fields("failure"), "exit_code": value}
    msg = Codec(SECRET).decode(Codec(SECRET).encode(body("failure", fields), 0))
    assert msg.body.exit_code == value


@pytest.mark.parametrize("delay", [0, 2, 0.25])
def test_recover_delay_accepts_int_and_float(delay):
    fields = {**valid_fields("recover"), "delay": delay}
    assert Codec(SECRET).decode(Codec(SECRET).encode(body("recover", fields), 1)).body.delay == delay


def test_hand_built_signed_message_decodes():
    msg = Codec(SECRET).decode(signed(finished()))
    assert msg == Envelope(3, Finished(node_id="n0"))


def test_envelope_keys_are_not_fields():
    msg = Codec(SECRET).decode(Codec(SECRET).encode(Finished(node_id="x"), 2))
    assert msg.body.payload() == {"node_id": "x"}


def test_many_messages_in_order_from_one_sender():
    sender, receiver = Codec(SECRET), Codec(SECRET)
    for i in range(5):
        assert receiver.decode(sender.encode(Finished(node_id=str(i)), i)).epoch == i


def test_independent_senders_do_not_collide():
    a, b, receiver = Codec(SECRET), Codec(SECRET), Codec(SECRET)
    receiver.decode(a.encode(Finished(node_id="a"), 0))
    receiver.decode(b.encode(Finished(node_id="b"), 0))  # b's seq 1 is not a replay of a's
    receiver.decode(a.encode(Finished(node_id="a"), 0))


def test_short_secret_refused():
    with pytest.raises(ValueError):
        Codec(b"x" * 15)
    Codec(b"x" * 16)


# --- refusals --------------------------------------------------------------------------------


def test_wrong_secret():
    frames = Codec(OTHER_SECRET).encode(Finished(node_id="n"), 0)
    with pytest.raises(ProtocolError, match="signature"):
        Codec(SECRET).decode(frames)


def test_tampered_body():
    body, mac = split(Codec(SECRET).encode(Stop(exit_code=0, reason="done"), 0))
    tampered = body.replace(b"done", b"dona")
    assert tampered != body
    with pytest.raises(ProtocolError, match="signature"):
        Codec(SECRET).decode([tampered + mac])


def test_tampered_mac():
    body, mac = split(Codec(SECRET).encode(Stop(exit_code=0, reason="done"), 0))
    for bad in (mac[:-1] + bytes([mac[-1] ^ 1]), mac[:-1], b"", mac + b"\0"):
        with pytest.raises(ProtocolError, match="signature"):
            Codec(SECRET).decode([body + bad])


def test_replayed_frames():
    sender, receiver = Codec(SECRET), Codec(SECRET)
    frames = sender.encode(Finished(node_id="n"), 0)
    receiver.decode(frames)
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.decode(frames)
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.decode(list(frames))


def test_out_of_order_older_message_is_a_replay():
    sender, receiver = Codec(SECRET), Codec(SECRET)
    first = sender.encode(Finished(node_id="n"), 0)
    second = sender.encode(Finished(node_id="n"), 0)
    receiver.decode(second)
    with pytest.raises(ProtocolError, match="replayed"):
        receiver.decode(first)


def test_rejected_message_does_not_advance_sequence():
    receiver = Codec(SECRET)
    with pytest.raises(ProtocolError):
        receiver.decode(signed(finished(seq=5, node_id=1)))  # wrong field type
    assert isinstance(receiver.decode(signed(finished(seq=5))).body, Finished)


@pytest.mark.parametrize("version", [0, 1, VERSION + 1, None, str(VERSION)])
def test_wrong_version(version):
    with pytest.raises(ProtocolError, match="version"):
        Codec(SECRET).decode(signed(finished(v=version)))


def test_missing_version():
    data = finished()
    del data["v"]
    with pytest.raises(ProtocolError, match="version"):
        Codec(SECRET).decode(signed(data))


@pytest.mark.parametrize("kind", ["shutdown", "", None, 3, ["join"]])
def test_unknown_type(kind):
    with pytest.raises(ProtocolError, match="unknown message type"):
        Codec(SECRET).decode(signed(finished(type=kind)))


def test_encode_refuses_unknown_type():
    class Shutdown(Body):
        TYPE = "shutdown"

    with pytest.raises(ProtocolError, match="unknown message type"):
        Codec(SECRET).encode(Shutdown(), 0)


@pytest.mark.parametrize("kind", [k for k in SCHEMA if SCHEMA[k]])
def test_missing_field(kind):
    fields = valid_fields(kind)
    fields.pop(next(iter(fields)))
    with pytest.raises(TypeError):  # a message cannot even be built without it
        body(kind, fields)
    with pytest.raises(ProtocolError, match="fields"):
        Codec(SECRET).decode(signed({**envelope(type=kind), **fields}))


@pytest.mark.parametrize("kind", list(SCHEMA))
def test_extra_field(kind):
    fields = {**valid_fields(kind), "extra": 1}
    with pytest.raises(TypeError):
        body(kind, fields)
    with pytest.raises(ProtocolError, match="fields"):
        Codec(SECRET).decode(signed({**envelope(type=kind), **fields}))


WRONG_TYPES = [
    ("join", "local_world_size", True),
    ("join", "local_world_size", False),
    ("join", "local_world_size", "4"),
    ("join", "local_world_size", 4.0),
    ("join", "node_id", 5),
    ("join", "addr", None),
    ("join", "addr", b"bytes"),
    ("assign", "world_size", True),
    ("assign", "group_rank", [0]),
    ("failure", "exit_code", True),
    ("failure", "exit_code", 1.5),
    ("failure", "exit_code", "1"),
    ("recover", "delay", True),
    ("recover", "delay", "1.0"),
    ("recover", "delay", None),
    ("stop", "reason", {"a": 1}),
    ("store_ready", "master_port", 29500.0),
]


@pytest.mark.parametrize("kind, name, value", WRONG_TYPES)
def test_wrong_field_type(kind, name, value):
    fields = {**valid_fields(kind), name: value}
    with pytest.raises(ProtocolError, match="wrong type"):
        Codec(SECRET).encode(CONTROL[kind](**fields), 0)
    with pytest.raises(ProtocolError, match="wrong type"):
        Codec(SECRET).decode(signed({**envelope(type=kind), **fields}))


@pytest.mark.parametrize("key, value", [("epoch", "1"), ("epoch", None), ("seq", 1.0),
                                        ("seq", None), ("sid", 5), ("sid", None)])
def test_bad_envelope(key, value):
    with pytest.raises(ProtocolError, match="envelope"):
        Codec(SECRET).decode(signed(finished(**{key: value})))


@pytest.mark.parametrize("key", ["v", "epoch", "seq"])
def test_bool_in_envelope_rejected(key):
    with pytest.raises(ProtocolError):
        Codec(SECRET).decode(signed(finished(**{key: True})))


def test_oversize_body():
    frames = signed(finished(node_id="x" * MAX_BYTES))
    assert len(split(frames)[0]) > MAX_BYTES
    with pytest.raises(ProtocolError, match="exceeds"):
        Codec(SECRET).decode(frames)


def test_body_at_limit_accepted():
    base = len(msgpack.packb(finished(node_id="")))
    pad = MAX_BYTES - base - 5  # str32 header may replace a fixstr header
    frames = signed(finished(node_id="x" * pad))
    assert len(split(frames)[0]) <= MAX_BYTES
    assert isinstance(Codec(SECRET).decode(frames).body, Finished)


@pytest.mark.parametrize("count", [0, 2, 3])
def test_wrong_frame_count(count):
    frames = (Codec(SECRET).encode(Finished(node_id="n"), 0) + [b""] * 4)[:count]
    with pytest.raises(ProtocolError, match="expected 1 frame"):
        Codec(SECRET).decode(frames)


def test_a_message_split_as_version_2_sent_it_is_refused():
    """Version 2 sent body and mac as two frames: a node left on it is told, not misread."""
    body, mac = split(Codec(SECRET).encode(Finished(node_id="n"), 0))
    with pytest.raises(ProtocolError, match="another ftlaunch version"):
        Codec(SECRET).decode([body, mac])


@pytest.mark.parametrize("data", [[1, 2], "finished", 1, None, b"raw", True])
def test_non_map_body(data):
    with pytest.raises(ProtocolError, match="not a map"):
        Codec(SECRET).decode(signed(data))


@pytest.mark.parametrize("body", [b"", b"\xc1", b"\x81", b"\xa5ab", b"\x80\x80",
                                  b"\x81\x01\x02", b"\xa2\xff\xfe"])
def test_garbage_signed_body(body):
    with pytest.raises(ProtocolError, match="undecodable"):
        Codec(SECRET).decode(sign(body))


def test_garbage_unsigned():
    with pytest.raises(ProtocolError):
        Codec(SECRET).decode([b"\x00garbage", b"not a mac"])


# --- properties ------------------------------------------------------------------------------

msgpack_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
                   | st.floats() | st.text(max_size=20) | st.binary(max_size=20))
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8,
)
ALL_FIELD_NAMES = sorted({name for fields in SCHEMA.values() for name in fields})
keys = (st.sampled_from(["v", "type", "epoch", "sid", "seq", "ts", *ALL_FIELD_NAMES])
        | st.text(max_size=8) | st.binary(max_size=4) | st.integers(-5, 5))
envelope_values = {
    "v": st.just(VERSION) | msgpack_values,
    "type": st.sampled_from(list(SCHEMA)) | msgpack_values,
    "epoch": st.integers(-5, 5) | msgpack_values,
    "sid": st.text(max_size=4) | msgpack_values,
    "seq": st.integers(-5, 5) | msgpack_values,
}
PROPERTY_SETTINGS = settings(max_examples=100, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(st.lists(st.binary(max_size=200), max_size=4))
def test_decode_arbitrary_frames_only_raises_protocol_error(frames):
    with pytest.raises(ProtocolError):
        Codec(SECRET).decode(frames)


@PROPERTY_SETTINGS
@given(st.fixed_dictionaries({}, optional=envelope_values),
       st.dictionaries(keys, msgpack_values, max_size=6))
def test_decode_signed_arbitrary_map(env, extra):
    body = msgpack.packb({**extra, **env})
    try:
        msg = Codec(SECRET).decode(sign(body))
    except ProtocolError:
        return
    assert isinstance(msg, Envelope)
    assert msg.body.TYPE in SCHEMA
    assert set(msg.body.payload()) == set(SCHEMA[msg.body.TYPE])


field_values = {
    int: st.integers(-(2**63), 2**63 - 1),
    str: st.text(max_size=50),
    (int, float): st.integers(-(2**31), 2**31) | st.floats(allow_nan=False),
    (int, type(None)): st.none() | st.integers(-255, 255),
    **{ROW_CHECKS[record]: st.lists(st.tuples(*(
        st.text(max_size=20) if t is str else st.booleans() if t is bool else st.integers(0, 2**31)
        for t in get_type_hints(record).values())).map(list), max_size=5)
       for record in ROW_CHECKS},
    EPOCHS_CHECK: st.lists(st.integers(-1, 2**31), max_size=5),
}


@st.composite
def messages(draw):
    kind = draw(st.sampled_from(list(SCHEMA)))
    fields = {name: draw(field_values[expected]) for name, expected in SCHEMA[kind].items()}
    return kind, draw(st.integers(0, 2**31)), fields


@PROPERTY_SETTINGS
@given(messages())
def test_round_trip_property(message):
    kind, epoch, fields = message
    msg = Codec(SECRET).decode(Codec(SECRET).encode(body(kind, fields), epoch))
    assert msg == Envelope(epoch, body(kind, fields))


@PROPERTY_SETTINGS
@given(messages(), st.data())
def test_any_single_byte_flip_is_refused(message, data):
    kind, epoch, fields = message
    frame = bytearray(Codec(SECRET).encode(body(kind, fields), epoch)[0])
    i = data.draw(st.integers(0, len(frame) - 1))  # the body's or the mac's
    frame[i] ^= data.draw(st.integers(1, 255))
    with pytest.raises(ProtocolError, match="signature"):
        Codec(SECRET).decode([bytes(frame)])


@pytest.mark.parametrize("members", [
    "node-a", [["node-a", "10.0.0.1"]], [["node-a", "10.0.0.1", "4000"]],
    [["node-a", "10.0.0.1", True]], [("node-a", 1, 2)], [None],
    [["node-a", "10.0.0.1", 4000, 1]],
])
def test_malformed_member_list_refused(members):
    fields = {**valid_fields("assign"), "members": members}
    with pytest.raises(ProtocolError, match="assign.members"):
        Codec(SECRET).decode(signed({**envelope(type="assign"), **fields}))


@pytest.mark.parametrize("held", [
    [[6, 0, 40]],  # protocol 1's row: a shard, not a run
    [[6, 40, 0, True]], [[6, 40, 0, 2.0]], [[6, 40, 0, 2, 1]], [(6, 40, "0", 2)], [[]], [7],
    [[6, 40, 0, 2, 6], [40, 0, 2]],  # a field too many, one too few: the same count in all
    [[6, 40, 0, 2], {"w": 6, "s": 40, "f": 0, "r": 2}], [[6, 40, 0, 2], "6402"],
])
def test_malformed_held_runs_refused(held):
    fields = {**valid_fields("join"), "held": held}
    with pytest.raises(ProtocolError, match="join.held: malformed"):
        Codec(SECRET).decode(signed({**envelope(type="join"), **fields}))


@pytest.mark.parametrize("epochs", [3, "3", [1, True], [1.0], [None], [[1]], list(range(10_001))])
def test_malformed_epoch_list_refused(epochs):
    fields = {**valid_fields("join"), "seated_earlier": epochs}
    with pytest.raises(ProtocolError, match="join.seated_earlier: malformed"):
        Codec(SECRET).decode(signed({**envelope(type="join"), **fields}))
