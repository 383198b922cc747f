"""Checkpoint replicas: placement and restore plans (pure), and the service that moves the
bytes between nodes' shared memory (real ZeroMQ sockets over loopback, real shm files)."""

from __future__ import annotations

import os
import subprocess
import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from ftlaunch_contract.messages import Held, HeldRun, Peer
from ftlaunch_contract.staging import Slot
from launcher.replica_plan import Seat, fetch_plan, holders, newest_in_memory, runs
from launcher.replica_service import (
    FetchDone,
    NotTransferred,
    ReplicaService,
    Transferred,
    Wire,
)

SECRET = b"k" * 32

# --- placement ----------------------------------------------------------------------------


def test_holders_are_the_next_nodes_around_the_ring():
    ring = [("a", "h1"), ("b", "h2"), ("c", "h3")]
    assert holders(ring, "a", 1) == ["b"]
    assert holders(ring, "c", 1) == ["a"]
    assert holders(ring, "b", 2) == ["c", "a"]
    assert holders(ring, "a", 5) == ["b", "c"]  # no more than there are peers
    assert holders(ring, "a", 0) == [] and holders([("a", "h1")], "a", 1) == []


def test_holders_avoid_the_nodes_own_failure_domain():
    ring = [("a0", "host-a"), ("a1", "host-a"), ("b0", "host-b"), ("b1", "host-b")]
    assert holders(ring, "a0", 1) == ["b0"]  # not a1: the same host dies with it
    assert holders(ring, "b1", 1) == ["a0"]
    assert holders(ring, "a0", 3) == ["b0", "b1", "a1"]  # same domain only as a last resort


def test_nothing_is_pulled_when_storage_has_a_newer_step_than_memory():
    """Replicas lag a save while it streams: with step 50 committed to storage and only 40
    whole in memory, the ranks restore 50 from storage; pulling 40 would delay them."""
    inventories = {"a": held(2, [0], 50) + held(2, [0, 1], 40)}
    seats = [Seat("a", 0, 1, 2), Seat("spare", 1, 1, 2)]
    assert fetch_plan(as_runs(inventories), seats, committed=50) == {}
    assert fetch_plan(as_runs(inventories), seats, committed=40) == {"spare": [(Held(2, 1, 40), "a")]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from("xyz"), min_size=1, max_size=8), st.integers(0, 4))
def test_holders_property(domains, k):
    ring = [(f"n{i}", d) for i, d in enumerate(domains)]
    for node, domain in ring:
        chosen = holders(ring, node, k)
        assert node not in chosen and len(set(chosen)) == len(chosen)
        assert len(chosen) == min(k, len(ring) - 1)
        others = [n for n, d in ring if d != domain and n != node]
        assert all(dict(ring)[n] != domain for n in chosen[:len(others)])


# --- where a round restores from ----------------------------------------------------------

def held(world, ranks, step):
    return [Held(world, r, step) for r in ranks]


def as_runs(inventories):
    """What the nodes' joins say they hold."""
    return {node: runs(shards) for node, shards in inventories.items()}


def test_a_join_says_what_its_node_holds_in_runs_of_consecutive_ranks():
    shards = held(16, [8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7], 40) \
        + held(16, [2, 3, 5], 39) + held(8, [0, 1], 40) + held(16, [3], 39)  # (twice: once)
    assert runs(shards) == (HeldRun(8, 40, 0, 2), HeldRun(16, 39, 2, 2), HeldRun(16, 39, 5, 1),
                            HeldRun(16, 40, 0, 16))
    assert runs([]) == ()


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from("abcd"), st.lists(st.tuples(
    st.integers(1, 5), st.integers(-1, 5), st.integers(1, 3)), max_size=12), max_size=4))
def test_the_newest_step_in_memory_from_runs_is_the_one_its_shards_make_whole(copies):
    """Runs say no more and no less than the shards they stand for (a rank outside its
    world counts for nothing)."""
    inventories = {node: [Held(*c) for c in shards] for node, shards in copies.items()}
    whole = [(step, world) for world in range(1, 6) for step in range(1, 4)
             if all(any(Held(world, r, step) in shards for shards in inventories.values())
                    for r in range(world))]
    expected = (max(whole)[1], max(whole)[0]) if whole else None
    assert newest_in_memory(as_runs(inventories)) == expected


def test_a_replacement_node_pulls_its_ranks_shards_from_their_holders():
    # 3 nodes x 2 ranks, ring a->b->c->a: node c (ranks 4, 5) was lost, its copies live on a.
    inventories = {"a": held(6, [0, 1], 40) + held(6, [4, 5], 40) + held(6, [0, 1], 39),
                   "b": held(6, [2, 3], 40) + held(6, [0, 1], 40)}
    seats = [Seat("a", 0, 2, 6), Seat("b", 2, 2, 6), Seat("spare", 4, 2, 6)]
    assert newest_in_memory(as_runs(inventories)) == (6, 40)
    assert fetch_plan(as_runs(inventories), seats) == {
        "spare": [(Held(6, 4, 40), "a"), (Held(6, 5, 40), "a")]}


def test_a_resized_world_pulls_every_saved_shard_it_lacks():
    inventories = {"a": held(6, [0, 1, 4, 5], 40), "b": held(6, [2, 3, 0, 1], 40)}
    plan = fetch_plan(as_runs(inventories), [Seat("a", 0, 2, 4), Seat("b", 2, 2, 4)])
    assert plan == {"a": [(Held(6, 2, 40), "b"), (Held(6, 3, 40), "b")],
                    "b": [(Held(6, 4, 40), "a"), (Held(6, 5, 40), "a")]}


def test_a_world_resized_past_a_few_nodes_restores_from_storage_not_every_peer():
    """Resized, every node would pull every saved shard: the whole saved state in each
    node's memory and an assign naming each shard (at 512 nodes of 8, 2 M pulls planned in
    6-13 s; at 4,096 the coordinator was killed for its memory). Up to
    RESHARD_FROM_MEMORY_NODES nodes it still does; past them, nothing is pulled."""
    from launcher.replica_plan import RESHARD_FROM_MEMORY_NODES, too_wide_to_reshard

    def shrunk_to(nodes: int) -> dict:
        saved = nodes + 1  # one node of 2 ranks lost, its shards kept by the next
        inventories = {f"n{i}": held(2 * saved, [2 * i, 2 * i + 1, (2 * i - 2) % (2 * saved),
                                                 (2 * i - 1) % (2 * saved)], 40)
                       for i in range(saved)}
        seats = [Seat(f"n{i}", 2 * i, 2, 2 * nodes) for i in range(nodes)]
        assert too_wide_to_reshard(2 * saved, seats) == (nodes > RESHARD_FROM_MEMORY_NODES)
        assert not too_wide_to_reshard(2 * nodes, seats), "the same world is never too wide"
        return fetch_plan(as_runs(inventories), seats)

    fits = shrunk_to(RESHARD_FROM_MEMORY_NODES)
    assert len(fits) == RESHARD_FROM_MEMORY_NODES and all(
        len(pulls) == 2 * (RESHARD_FROM_MEMORY_NODES + 1) - 4 for pulls in fits.values())
    assert shrunk_to(RESHARD_FROM_MEMORY_NODES + 1) == {}


def test_no_plan_when_some_rank_of_every_step_is_gone_from_memory():
    inventories = {"a": held(6, [0, 1], 40), "b": held(6, [2, 3], 40)}  # 4, 5: both copies lost
    assert newest_in_memory(as_runs(inventories)) is None
    assert fetch_plan(as_runs(inventories), [Seat("a", 0, 2, 6), Seat("b", 2, 2, 6),
                                    Seat("c", 4, 2, 6)]) == {}


def test_the_newest_whole_step_wins_even_if_an_older_one_is_held_more_widely():
    inventories = {"a": held(2, [0], 41) + held(2, [0, 1], 40), "b": held(2, [1], 41)}
    assert newest_in_memory(as_runs(inventories)) == (2, 41)
    assert fetch_plan(as_runs(inventories), [Seat("a", 0, 1, 2), Seat("c", 1, 1, 2)]) == {
        "c": [(Held(2, 1, 41), "b")]}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 3), st.integers(1, 3)),
                max_size=30), st.integers(1, 4))
def test_fetch_plan_property(copies, new_world):
    inventories: dict[str, list[Held]] = {}
    for node, rank, step in copies:
        inventories.setdefault(node, []).append(Held(4, rank, step))
    seats = [Seat(n, i, 1, new_world) for i, n in enumerate("abcd"[:new_world])]
    plan = fetch_plan(as_runs(inventories), seats)
    newest = newest_in_memory(as_runs(inventories))
    for node, pulls in plan.items():
        for h, source in pulls:
            assert (h.world_size, h.step) == newest
            assert source != node and h in inventories[source]
            assert h not in inventories.get(node, [])
    if newest is not None:  # afterwards every seat holds what its ranks restore from
        for seat in seats:
            have = set(inventories.get(seat.node_id, [])) | {h for h, _ in plan.get(seat.node_id, [])}
            need = [seat.rank_offset] if new_world == 4 else range(4)
            assert {Held(4, r, newest[1]) for r in need} <= have


# --- the service --------------------------------------------------------------------------

def stage(directory, rank, step, data: bytes, world=6, index=0, save_id=None):
    """What a rank's save leaves in staging: the bytes, then the meta sealing them."""
    slot = Slot(str(directory), rank, index)
    slot.invalidate()
    slot.ensure(len(data))
    slot.buffer[:len(data)] = data
    meta = {"step": step, "rank": rank, "world_size": world, "save_id": save_id or os.urandom(8).hex(),
            "history": "round 1", "dest": "/ckpt", "tree": {}, "tensors": [], "nbytes": len(data)}
    slot.seal(meta)
    slot.close()
    return meta


def wait_for_file(path, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)  # a file another thread creates: no event to wait on


def wait_news(service, want=1, timeout=30.0):
    got, end = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < end:
        zmq.select([service.fd], [], [], 0.05)
        got += service.news()
    return got


@pytest.fixture
def nodes(tmp_path):
    context = zmq.Context()
    made = []

    def make(name, bandwidth=0.0, secret=SECRET):
        d = tmp_path / name
        d.mkdir()
        service = ReplicaService(context, secret, name, "127.0.0.1", d, bandwidth,
                                 reply_timeout=2.0)
        made.append(service)
        return service, d
    yield make
    for service in made:
        service.close()
    context.term()


def as_peer(service):
    return Peer(service.node_id, "127.0.0.1", service.port)


def test_an_offered_shard_is_pulled_whole_into_the_holders_memory(nodes):
    (a, a_dir), (b, b_dir) = nodes("a"), nodes("b")
    payload = os.urandom(9 << 20 | 123)  # several chunks and a ragged tail
    meta = stage(a_dir, 4, 40, payload)
    a.offer(Held(6, 4, 40), (as_peer(b),))
    news = wait_news(b)
    assert news and isinstance(news[0], Transferred), news
    assert news[0].held == Held(6, 4, 40) and news[0].source == "a"
    assert b.inventory() == (Held(6, 4, 40),)
    copy = msgpack.unpackb((b_dir / "replicas" / "rank_4.0.meta").read_bytes())
    assert copy["save_id"] == meta["save_id"] and copy["replica_from"] == "a"
    assert (b_dir / "replicas" / "rank_4.0.data").read_bytes()[:len(payload)] == payload


def test_a_restore_fetch_pulls_from_a_holders_replicas_and_reports_once_done(nodes):
    (a, a_dir), (b, _), (c, c_dir) = nodes("a"), nodes("b"), nodes("c")
    payloads = {r: os.urandom(1 << 20) for r in (4, 5)}
    for r, data in payloads.items():
        stage(a_dir / "replicas", r, 40, data)  # a keeps the lost node's copies
    c.fetch([(Held(6, 4, 40), as_peer(a)), (Held(6, 5, 40), as_peer(a)),
             (Held(6, 3, 40), as_peer(b))])  # b holds no rank 3: that one fails
    news = wait_news(c, want=4)
    done = [n for n in news if isinstance(n, FetchDone)]
    assert done and (done[0].pulled, done[0].failed) == (2, 1)
    failed = [n for n in news if isinstance(n, NotTransferred)]
    assert "not held" in failed[0].reason
    for r, data in payloads.items():
        slot = next(p for p in (c_dir / "replicas").glob(f"rank_{r}.*.data"))
        assert slot.read_bytes()[:len(data)] == data


def test_a_peer_with_another_secret_gets_nothing(nodes):
    (a, a_dir), (b, _) = nodes("a"), nodes("b", secret=b"x" * 32)
    stage(a_dir, 0, 7, b"secret weights" * 100)
    b.fetch([(Held(6, 0, 7), as_peer(a))])
    news = wait_news(b, want=2)
    assert any(isinstance(n, NotTransferred) and "no reply" in n.reason for n in news), news
    assert b.inventory() == ()


def test_a_forged_or_corrupted_chunk_is_rejected():
    wire = Wire(SECRET)
    message = wire.pack({"nonce": "n", "error": ""}, b"\x00" * 1000)
    header, data = wire.unpack(message)
    assert header == {"nonce": "n", "error": ""} and bytes(data) == b"\x00" * 1000
    corrupted = bytearray(message)
    corrupted[-40] ^= 1  # in the data
    with pytest.raises(Exception, match="bad signature"):
        wire.unpack(corrupted)
    with pytest.raises(Exception, match="bad signature"):
        Wire(b"y" * 32).unpack(message)
    with pytest.raises(Exception, match="bad header length"):
        wire.unpack(b"\xff\xff\xff\x00" + bytes(message[4:]))
    with pytest.raises(Exception, match="too short"):
        wire.unpack(message[:10])


def test_every_message_is_one_frame(nodes):
    """libzmq 4.3 aborts the process when a connection drops while its socket, closing, is
    part-way through sending a message of several frames (zeromq/libzmq#3442): a service
    closed while it streamed a chunk to a peer that had given up killed the agent (and the
    test process: ``Resource temporarily unavailable (src/session_base.cpp:233)``). A
    message of one frame is never part-way through in that sense."""
    a, a_dir = nodes("a")
    payload = os.urandom(3 << 20)
    meta = stage(a_dir, 2, 9, payload)
    context = zmq.Context()
    peer = context.socket(zmq.ROUTER)
    peer.linger = 0
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    asker = context.socket(zmq.DEALER)
    asker.linger = 0
    asker.connect(f"tcp://127.0.0.1:{a.port}")
    try:
        a.offer(Held(6, 2, 9), (Peer("peer", "127.0.0.1", port),))
        assert peer.poll(10_000), "no offer"
        offer = peer.recv_multipart()
        assert len(offer) == 2, "an identity and one frame"
        assert a._wire.unpack(offer[1])[0]["type"] == "offer"
        asker.send(a._wire.pack({"type": "get", "world": 6, "rank": 2, "step": 9, "nonce": "c",
                                 "save_id": meta["save_id"], "offset": 1 << 20,
                                 "nbytes": 1 << 20}))
        assert asker.poll(10_000), "no reply"
        reply = asker.recv_multipart()
        assert len(reply) == 1
        header, data = a._wire.unpack(reply[0])
        assert header == {"nonce": "c", "error": ""}
        assert bytes(data) == payload[1 << 20:2 << 20]
    finally:
        context.destroy(linger=0)


def test_a_save_overwritten_mid_transfer_is_never_sealed_as_a_replica(nodes):
    (a, a_dir), (b, _) = nodes("a"), nodes("b", bandwidth=2 << 20)  # 2nd chunk after 2 s
    stage(a_dir, 1, 10, os.urandom(8 << 20), save_id="first")
    a.offer(Held(6, 1, 10), (as_peer(b),))
    wait_for_file(b.shards.replicas_dir / "rank_1.0.data")  # the transfer is under way
    stage(a_dir, 1, 12, os.urandom(8 << 20), save_id="second")  # the rank saved again
    news = wait_news(b)
    assert isinstance(news[0], NotTransferred), news  # between chunks, or within one:
    assert "no longer held" in news[0].reason or "overwritten" in news[0].reason
    assert Held(6, 1, 10) not in b.inventory()


def test_bandwidth_cap_bounds_replica_transfers(nodes):
    (a, a_dir), (b, _) = nodes("a"), nodes("b", bandwidth=16 << 20)
    stage(a_dir, 0, 3, os.urandom(16 << 20))
    a.offer(Held(6, 0, 3), (as_peer(b),))
    news = wait_news(b)
    assert isinstance(news[0], Transferred) and news[0].seconds >= 0.7  # 16 MiB at 16 MiB/s


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 512 KiB tmpfs: shared memory that fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (as the netns tests do)")
    where = tmp_path / "small"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def test_full_shared_memory_degrades_to_no_replica(nodes, small_tmpfs):
    context = zmq.Context()
    (a, a_dir) = nodes("a")
    b = ReplicaService(context, SECRET, "b", "127.0.0.1", small_tmpfs)
    try:
        stage(a_dir, 0, 3, os.urandom(1 << 20))
        a.offer(Held(6, 0, 3), (as_peer(b),))
        news = wait_news(b)
        assert isinstance(news[0], NotTransferred) and "enlarge /dev/shm" in news[0].reason
        assert b.inventory() == ()
    finally:
        b.close()
        context.term()


def test_closing_a_service_mid_transfer_gives_up_at_once(nodes, tmp_path):
    """An agent that exits while a peer's shard streams in (capped slow) stops the transfer
    and leaves no thread behind and no copy sealed."""
    (a, a_dir), (b, _) = nodes("a"), nodes("b", bandwidth=1 << 20)  # 8 s for this shard
    stage(a_dir, 0, 3, os.urandom(8 << 20))
    a.offer(Held(6, 0, 3), (as_peer(b),))
    wait_for_file(b.shards.replicas_dir / "rank_0.0.data")  # the pull has begun
    started = time.monotonic()
    b.close()
    assert time.monotonic() - started < 5, "close waited for the transfer"  # hang guard
    assert not any(t.is_alive() for t in b._threads)
    assert b.shards.inventory() == ()
    b.close = lambda: None  # closed: the fixture's teardown has nothing left to do


def test_copies_of_another_world_are_freed_once_the_new_world_commits(nodes):
    (a, _), (b, b_dir) = nodes("a"), nodes("b")
    stage(b_dir / "replicas", 4, 40, b"old world" * 100, world=6)  # kept for a lost node
    stage(b_dir / "replicas", 1, 50, b"new world" * 100, world=4)
    b.forget_other_worlds(4)
    a.offer(Held(6, 0, 1), (as_peer(b),))  # a job behind it on the same thread: done after
    wait_news(b)
    assert b.inventory() == (Held(4, 1, 50),)
    assert sorted(p.name for p in (b_dir / "replicas").iterdir()) == ["rank_1.0.data",
                                                                     "rank_1.0.meta"]


def test_a_restore_does_not_wait_behind_a_replica_copy_from_a_node_just_lost(tmp_path):
    """Chaos (seed 1354): a node was lost while this one copied its newest save; the restore
    of the next round queued behind that copy, which waited for the lost node's reply until
    the 10 s timeout. The copy gives way: the restore is done long before that timeout, and
    the copy is taken up again after it."""
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # the lost node: it never answers
    silent.linger = 0
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    offer = context.socket(zmq.DEALER)  # its offer, sent before it was lost
    offer.linger = 0
    services = []
    try:
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            services.append(ReplicaService(context, SECRET, name, "127.0.0.1",
                                           tmp_path / name, reply_timeout=60.0))
        a, b = services
        offer.connect(f"tcp://127.0.0.1:{b.port}")
        offer.send(b._wire.pack({"type": "offer", "world": 6, "rank": 1, "step": 65,
                                           "node_id": "lost", "addr": "127.0.0.1",
                                           "port": silent_port}))
        assert silent.poll(10_000), "b never asked the lost node for its save"
        silent.recv_multipart()
        data = os.urandom(1 << 20)
        stage(tmp_path / "a", 4, 40, data)
        b.fetch([(Held(6, 4, 40), as_peer(a))])
        news = wait_news(b, want=2, timeout=30.0)  # < the copy's 60 s timeout: a hang guard
        assert [type(n).__name__ for n in news] == ["Transferred", "FetchDone"], news
        assert news[0].held == Held(6, 4, 40) and news[1].pulled == 1
        assert silent.poll(10_000), "the copy was not taken up again after the restore"
    finally:
        for service in services:
            service.close()
        context.destroy(linger=0)
