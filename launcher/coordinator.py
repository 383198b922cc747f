"""The coordinator: holds membership, the job epoch and the restart budget; decides recoveries.

It is a role of an agent (a thread with its own ROUTER socket), never of a trainer, so no
rank's crash can take it down. When its node is lost, the surviving agent with the lowest
group rank starts a new one from the membership every agent holds (see docs/protocol.md).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from ftlaunch_contract.messages import (
    Assign,
    Body,
    Committed,
    Durable,
    EarlierVoter,
    Failure,
    Fetch,
    Fetches,
    Finished,
    Heartbeat,
    HeartbeatAck,
    HeldRuns,
    InMemory,
    JobStatus,
    Join,
    Leave,
    NodeRankState,
    NodeState,
    Peer,
    Peers,
    RankStates,
    Recover,
    Redirect,
    Replicated,
    Spare,
    Start,
    StatusQuery,
    Stop,
    StoreReady,
    Successor,
    Successors,
    Unhealthy,
)
from ftlaunch_contract.protocol import Codec, Envelope, ProtocolError
from launcher import exit_codes, failures, membership, recovery, replica_plan
from launcher.commits import CommitLog
from launcher.peer_probe import Knocks, Probe, Verdict, no_death

if TYPE_CHECKING:
    from launcher.intake import Intakes, Port

log = logging.getLogger("ftlaunch.coordinator")

TICK_SECONDS = 0.05
FOLLOWED_QUIET = 10 * TICK_SECONDS  # a successor announcing itself missed that many: gone
MAX_PACE = 0.02  # see pace()
_NOBLOCK, _SNDMORE, _POLLIN = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.POLLIN)  # as ints:
# each use of zmq's enums costs a Python call (see _send_frames)
PEER_ERROR_GRACE = 0.5  # seconds a peer error waits for the failure that caused it
ACK_WITHIN = 0.25
LARGE_ACK_WITHIN = 0.75
"""An agent takes the coordinator for lost after the liveness timeout without a word from it,
yet an ack per heartbeat would double a large job's load on the coordinator for nothing. A
heartbeat is acked when the node's next one (as far off as its last) would come more than
ACK_WITHIN of the timeout after the last ack: at 0.5 s beats in a 5 s timeout, every third,
and whatever the rate, the agent hears one within a quarter of the timeout: three quarters
are left for a message TCP holds back under packet loss, and a coordinator silent for half
is knocked at (ControlPlane._silent) only when something is wrong. A large job's beats are
a third of its timeout apart: within LARGE_ACK_WITHIN every other one is acked (two thirds of
the timeout, a third to spare)."""
DRAIN_BATCH = 1024
INTAKE_BATCHES = 4  # an intake's batch is up to intake.BATCH messages
SUCCESSORS = 16
"""An assign lists only the first group ranks: the nodes that may take over the coordinator.
Enough for 15 coordinator losses in a row, and keeps each assign O(1) in the job's size."""


class IntakeLost(RuntimeError):
    """An intake process (launcher.intake) died or stopped answering: its share of the
    connections is gone, so the coordinator stops serving (see Coordinator.failure)."""


def pace(max_nodes: int) -> float:
    """Seconds between the coordinator's wake-ups for its socket, at least: a large job's
    stream of heartbeats (up to membership.HEARTBEATS_PER_SECOND) is served ten or twenty at
    a wake-up instead of one by one, which costs several times as much CPU per message (each
    wake-up runs on cold caches, and wakes ZeroMQ's I/O thread too). 10 µs a node, 20 ms at
    most: a message after a quiet spell is served at once, one in a stream waits at most
    this long, and a small job's (8 nodes: 80 µs) is not held back."""
    return min(MAX_PACE, max_nodes * 1e-5)


Seat = tuple[int, int, Peers, Fetches]  # an assign's Assign.SEAT fields


class Seats(Mapping[str, Assign]):
    """A round's assigns by node, held as one assign and the seats they differ in: a
    16,384-node round builds no 16,384 Assigns (~2 µs each), only one asked for again."""

    def __init__(self, template: Assign | None = None, seats: dict[str, Seat] | None = None):
        self.template, self.seats = template, seats or {}

    def __getitem__(self, node: str) -> Assign:
        assert self.template is not None
        group_rank, rank_offset, replicate_to, fetch = self.seats[node]
        return replace(self.template, group_rank=group_rank, rank_offset=rank_offset,
                       replicate_to=replicate_to, fetch=fetch)

    def __iter__(self) -> Iterator[str]:
        return iter(self.seats)

    def __len__(self) -> int:
        return len(self.seats)


class RoundPhase(StrEnum):
    """The coordinator's phase (drawn in docs/protocol.md)."""

    JOINING = "joining"  # a rendezvous round is open
    WAITING_STORE = "waiting_store"  # assigned: waiting for group rank 0's store
    RUNNING = "running"
    DONE = "done"  # the job's exit code is decided


@dataclass(kw_only=True)
class JobState:
    """Everything the coordinator knows; the next round is computed from it."""

    min_nodes: int
    max_nodes: int
    max_restarts: int
    policy: str
    backoff: float
    backoff_max: float
    exit_barrier_timeout: float
    node_timeout: float
    last_call: float
    join_timeout: float
    host_node: str  # the agent running this coordinator: alive by definition
    max_stalled: int = 0
    healthy_after: float = 0.0  # seconds up after which an attempt's failure is a first one
    epoch: int = 0
    restart_count: int = 0
    progress: recovery.Progress = field(default_factory=recovery.Progress)
    current_policy: str = ""  # the rung of the last recovery
    phase: RoundPhase = RoundPhase.JOINING
    running_since: float | None = None  # when the current attempt's ranks were started
    members: dict[str, membership.Member] = field(default_factory=dict)
    standby_ports: dict[str, int] = field(default_factory=dict)
    identities: dict[str, bytes] = field(default_factory=dict)
    last_seen: dict[str, float] = field(default_factory=dict)
    round_joined: set[str] = field(default_factory=set)
    expected: set[str] = field(default_factory=set)  # who the round waits for; empty: MAX/last call
    expected_count: int = 0  # and how many, when not all are known by name (after a takeover)
    joining_since: float = field(default_factory=time.monotonic)
    min_reached_at: float | None = None
    group_ranks: dict[str, int] = field(default_factory=dict)  # nodes in the running round
    successors: Successors = ()  # the running round's nodes that may take over, in order
    spares: Successors = ()  # its idle spares when it closed, up to SUCCESSORS: they vote too
    peer_error: tuple[str, int, float] | None = None  # (cause, step, until): see Failure
    finished: set[str] = field(default_factory=set)
    leaving: set[str] = field(default_factory=set)  # stopped by a signal: out at the next round
    first_finished_at: float | None = None
    final: tuple[int, str] | None = None  # (exit code, reason) once done
    redirect: Redirect | None = None  # the job runs under a successor: send agents there
    redirect_epoch: int = -1  # the epoch it announced itself at
    redirect_heard: float = float("-inf")  # when it last did
    commits: CommitLog = field(default_factory=lambda: CommitLog(0))  # of the current world
    copies: CommitLog = field(default_factory=lambda: CommitLog(0))  # steps copied to peers
    replicas: int = 0  # peers keeping a copy of each node's staged checkpoints
    replica_ports: dict[str, int] = field(default_factory=dict)
    held: dict[str, HeldRuns] = field(default_factory=dict)  # shards in memory, as joined
    # Group ranks the joins of the last round's nodes say they held (a successor knows 16
    # by name: group_ranks); the next round keeps them (membership.assign_ranks).
    seats_held: dict[str, int] = field(default_factory=dict)
    run_id: str = ""
    last_cause: str = ""  # of the latest recovery
    node_status: dict[str, tuple[str, RankStates]] = field(default_factory=dict)  # heartbeats
    assigns: Seats = field(default_factory=lambda: Seats())  # the running round's, by node
    start: Start | None = None  # the running round's, once given
    # The quorum a round needs (see membership.has_quorum):
    electorate: int = 0  # nodes of the last round closed, and its named spares (0: none yet)
    electorate_epoch: int = -1  # its epoch: a join seated in it is one of them
    voters: set[str] = field(default_factory=set)  # of them, those known by name
    back: set[str] = field(default_factory=set)  # of them, heard since the round opened
    gone: set[str] = field(default_factory=set)  # of them, known not to train on anywhere
    wins_tie: bool = True  # half of them suffice: we ran it, or our predecessor died
    # Earlier electorates most of whose voters have not yet said they learnt a later one:
    # a round needs a quorum of each of them too (membership.settled).
    earlier: list[membership.Electorate] = field(default_factory=list)
    learnt: dict[str, int] = field(default_factory=dict)  # node -> its newest electorate epoch
    # An earlier electorate's voters a successor knew not by name, as their joins said (a
    # seat in its round): epoch -> nodes.
    reported: dict[int, set[str]] = field(default_factory=dict)
    heard: set[str] = field(default_factory=set)  # every node heard since the round opened


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a round is decided: a round of thousands
    of nodes allocates as many objects, and each full collection walks the whole heap (a
    16,384-node job's joins hold some 260,000 shard records): 0.4 s of a 0.9 s round. What
    a round builds holds no cycle for it to find."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def probe_interval(node_timeout: float) -> int:
    """Seconds between TCP keepalive probes (the kernel counts whole seconds)."""
    return max(1, int(node_timeout / 5))


def went_silent(quiet: float, node_timeout: float) -> bool:
    """Whether a connection that closed after ``quiet`` seconds without a word was closed by
    the kernel for a silent machine (TCP_USER_TIMEOUT counts from its last packet, at least
    the node timeout less a probe interval), not by a peer process that died."""
    return quiet >= node_timeout - probe_interval(node_timeout)


_monitors = itertools.count()


def connection_monitor(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A PAIR socket receiving ``sock``'s connection ``events``, on an endpoint of its own:
    libzmq frees a stopped monitor's endpoint asynchronously, so a name reused at once
    (pyzmq's default is the socket's) can still be taken."""
    return sock.get_monitor_socket(events, addr=f"inproc://ftlaunch-monitor-{next(_monitors)}")


def keep_alive(sock: zmq.Socket, node_timeout: float, small: bool = False) -> None:
    """A machine that goes silent (powered off, cut off, paused) has its connections closed
    by the kernel once nothing came back for ``node_timeout``, whatever the heartbeat rate:
    TCP keepalive probes an idle connection every second or so and TCP_USER_TIMEOUT
    (ZMQ_TCP_MAXRT) ends it; both ends get a disconnect event. The probes are the kernel's:
    no process wakes for them. A frozen process on a live machine still answers them.
    A ``small`` job's heartbeats and knocks find a silent machine within the node timeout
    (membership.lost_by_silence), so the kernel gets twice that: at heavy packet loss it
    retries a message as long, and a connection it ends must be made again through the same
    loss (30 % for 300 s: 149 connections ended, heartbeats held back 4 s)."""
    probe = probe_interval(node_timeout)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, probe)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, probe)
    sock.setsockopt(zmq.TCP_MAXRT, int(node_timeout * (2 if small else 1) * 1000))


def bind_router(context: zmq.Context, addr: str, port: int, node_timeout: float,
                small: bool = False, shared: bool = False) -> tuple[zmq.Socket, int]:
    """A ROUTER socket bound to addr:port (port 0 = any free port); ``small``: see keep_alive.
    ``shared``: intake processes may bind the same port (launcher.intake)."""
    sock = context.socket(zmq.ROUTER)
    keep_alive(sock, node_timeout, small)
    sock.setsockopt(zmq.LINGER, 1000)  # let the last "stop" reach every agent
    sock.setsockopt(zmq.MAXMSGSIZE, 2 << 20)  # anything larger is cut off by ZeroMQ itself
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    # Every survivor of a lost coordinator connects to its successor at once: with ZeroMQ's
    # default backlog (100) the kernel drops the rest of the SYNs, and TCP retries after 1 s,
    # then 3 s... (the kernel caps it at net.core.somaxconn).
    sock.setsockopt(zmq.BACKLOG, LISTEN_BACKLOG)
    try:
        if shared:
            fd, port = shared_listener(addr, port)
            sock.setsockopt(zmq.USE_FD, fd)  # ZeroMQ closes it with the socket
            sock.bind(f"tcp://{addr}:{port}")
        elif port:
            sock.bind(f"tcp://{addr}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{addr}")
    except (zmq.ZMQError, OSError):
        sock.close(linger=0)
        raise
    return sock, port


LISTEN_BACKLOG = 65535


def bound_to_share(addr: str, port: int) -> socket.socket:
    """A TCP socket bound to addr:port (0: any free port) that other processes of ours may
    bind too (SO_REUSEPORT: the kernel spreads new connections over those that listen)."""
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((addr, port))
    except OSError:
        sock.close()
        raise
    return sock


def shared_listener(addr: str, port: int) -> tuple[int, int]:
    """A listening socket bound_to_share: its file descriptor, for ZeroMQ's ZMQ_USE_FD, and
    its port."""
    listener = bound_to_share(addr, port)
    try:
        listener.listen(LISTEN_BACKLOG)
    except OSError:
        listener.close()
        raise
    port = listener.getsockname()[1]
    return listener.detach(), port


def unroutable(router: zmq.Socket, identities: list[bytes], frames: list[bytes]) -> set[bytes]:
    """Those of ``identities`` whose connection closed: only a mandatory send is told that it
    cannot be routed; each open one gets ``frames``.

    The socket learns of a close from ZeroMQ's I/O thread (the pipe's end, a command that
    follows the monitor's close event) and reads such commands on a send at most once a
    millisecond or so; so they are read first, or a route ended just before still looked
    open (a dead survivor of a takeover seated, found only by silence). A close whose end
    the I/O thread has not passed on yet is not known here either: such a connection counts
    as open, its node found by its silence."""
    closed = set()
    router.getsockopt(zmq.EVENTS)  # reads the socket's pending commands, unthrottled
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    try:
        for identity in identities:
            try:
                router.send_multipart([identity, *frames], _NOBLOCK)
            except zmq.ZMQError as e:  # (EAGAIN: open, its queue full)
                if e.errno == zmq.EHOSTUNREACH:
                    closed.add(identity)
    finally:
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)
    return closed


class Coordinator:
    """Serves one job on a bound ROUTER socket from a background thread."""

    def __init__(self, sock: zmq.Socket | Port, secret: bytes, state: JobState,
                 takeover_cause: str | None = None,
                 announce: tuple[tuple[str, ...], Redirect] | None = None):
        """``sock``: a bound ROUTER, or a Port whose intake processes serve its connections
        (launcher.intake); release() gives it back.
        ``announce``: (endpoints, where we are): a successor tells whatever comes up at the
        rendezvous endpoint (a re-created pod 0, a restarted agent) that the job runs here,
        and a predecessor that went silent (maybe cut off, and holding the tie of a round)."""
        self._codec = Codec(secret)
        self._state = state
        self._port = sock
        self._socket = cast(zmq.Socket, getattr(sock, "router", sock))  # (a Port's)
        self._intakes = cast("Intakes | None", getattr(sock, "intakes", None))
        self._stopping = threading.Event()
        self._handed_over = threading.Event()  # see wait_handed_over()
        self._failure: str | None = None  # see failure
        self._thread = threading.Thread(target=self._serve, name="ftlaunch-coordinator",
                                        daemon=True)
        self._fds: dict[bytes, int] = {}  # a peer's connection (its file descriptor)
        self._closed_unheard: set[int] = set()  # closes no message had named, this drain
        self._heard_after_close: set[bytes] = set()  # connections first heard on those
        self._closes_unconfirmed: dict[bytes, float] = {}  # of those, still routed: until
        self._beats: dict[bytes, tuple[float, float]] = {}  # a connection's last ack and beat
        self._probes: dict[str, Probe] = {}  # a member whose connection closed while heard
        self._knocks: dict[str, Knocks] = {}  # at silent members' standby ports (_knock)
        self._said_late: set[str] = set()  # silent members logged as answering
        self._hosting: dict[str, float] = {}  # members that announced a takeover, and when
        self._poller: zmq.Poller | None = None  # the serving loop's, once it runs
        self._announcers: dict[zmq.Socket, str] = {}  # to each endpoint, a socket
        self._announcement = announce[1] if announce else None
        self._rounds = 0  # rounds this coordinator formed
        self._took_over = takeover_cause is not None  # so it knows the job's epoch
        self._queued = False  # handling what reached our socket before we served (_drain_queued)
        self._queued_joins: set[str] = set()  # nodes that joined in what was queued
        self._said_short = False  # held for a quorum: said so, for the round forming
        self._settled_below = -1  # what heartbeat acks say (see _note_unsettled)
        self._ack: tuple[tuple[int, int, int], list[bytes], set[bytes]] | None = None  # _send_ack
        self._pace = pace(state.max_nodes)
        for endpoint in announce[0] if announce else ():
            announcer = self._socket.context.socket(zmq.DEALER)
            announcer.setsockopt(zmq.LINGER, 0)
            announcer.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued while no one is there
            announcer.connect(endpoint)
            self._announcers[announcer] = endpoint
        self._note_unsettled()  # (a successor's: from its assign)
        if takeover_cause:
            self._recover_from(f"{takeover_cause}", time.monotonic())

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self.release().close()

    @property
    def stood_down(self) -> bool:
        """A successor that found the job running at the endpoint (see
        _answers_to_announcement): it sent its agents there and serves no more. What comes
        to its socket waits for the next coordinator on it: agents reach a node's standby
        socket only following it as their successor, which it may become (the endpoint's
        node lost), and their joins must not be sent back to the endpoint."""
        return bool(self._announcers) and self._state.redirect is not None

    @property
    def redirect(self) -> Envelope | None:
        """Once stood down: what it told its agents, as they received it."""
        s = self._state
        return Envelope(s.epoch, s.redirect) if self.stood_down and s.redirect else None

    def release(self) -> zmq.Socket | Port:
        """Stop serving; the bound socket is the caller's (a standby that may host again)."""
        self._stopping.set()
        if self._thread.ident is not None:  # (started)
            self._thread.join(timeout=5)
        for announcer in self._announcers:
            announcer.close()
        self._announcers.clear()
        if self._intakes is not None:
            self._intakes.flush()
        return self._port

    @property
    def failure(self) -> str | None:
        """Why the serving thread died (a bug), else None. Its agent leaves the job on it:
        the others then find the coordinator's node lost and follow its successor, at once
        (the agent's exit closes its connections), instead of waiting on a decider that
        no longer answers."""
        return self._failure

    def wait_handed_over(self, timeout: float) -> bool:
        """Until the job no longer needs this coordinator's host: it is over, or the host
        node is not one of its leaving nodes (the others are told to go on once their ranks
        stopped), or the job runs elsewhere."""
        return self._handed_over.wait(timeout)

    def _check_handed_over(self) -> None:
        s = self._state
        handed_over = s.final is not None or s.host_node not in s.leaving \
            or s.redirect is not None
        if handed_over != self._handed_over.is_set():  # an Event's set() takes a lock
            self._handed_over.set() if handed_over else self._handed_over.clear()

    # --- loop ----------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._serve_until_stopped()
        except Exception as e:  # not a message's or a tick's (those are logged, served on)
            log.critical("the coordinator stopped serving: %s", e, exc_info=True)
            self._failure = f"{type(e).__name__}: {e}"

    def _serve_until_stopped(self) -> None:
        # A peer's TCP connection closing is a monitor event naming its file descriptor, which
        # each message carries too: an agent process that died is acted on at once, not after
        # the node timeout (only a frozen or cut-off machine stays silent until then).
        monitor = connection_monitor(self._socket, zmq.EVENT_DISCONNECTED)
        self._poller = poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        if self._intakes is not None:
            poller.register(self._intakes.hub, zmq.POLLIN)
        for announcer in self._announcers:
            poller.register(announcer, zmq.POLLIN)
        try:
            if self._took_over:
                self._drain_queued()
            self._serve_with(poller, monitor)
        finally:  # a monitor left open would block the context's term()
            self._socket.disable_monitor()
            monitor.close(linger=0)
            self.close_probes()

    def _serve_with(self, poller: zmq.Poller, monitor: zmq.Socket) -> None:
        next_tick = 0.0
        while not self._stopping.is_set() and not self.stood_down:
            ready = dict(poller.poll(int(TICK_SECONDS * 1000)))
            if ready:
                woke = time.monotonic()
                if monitor in ready:  # first: a fd closed may be reused below
                    self._closed_connections(monitor)
                for announcer in self._announcers.keys() & ready.keys():
                    self._answers_to_announcement(announcer)
                emptied = self._drain()
                if self._state.phase == RoundPhase.JOINING and self._state.final is None:
                    self._maybe_complete_round(time.monotonic())  # not a tick later
                if emptied and (rest := woke + self._pace - time.monotonic()) > 0:
                    self._stopping.wait(rest)
            if self._probes:  # answered (their sockets are polled too), or timed out
                self._probes_answered(time.monotonic())
            if time.monotonic() >= next_tick:  # liveness scans are O(N): not once a message
                next_tick = time.monotonic() + TICK_SECONDS
                try:
                    self._tick(time.monotonic())
                except IntakeLost:
                    raise
                except Exception:
                    log.exception("coordinator tick failed")
                self._announce()
                if self._intakes is not None and (lost := self._intakes.lost()):
                    raise IntakeLost(lost)
            self._check_handed_over()
            if self._intakes is not None:
                self._intakes.flush()

    def _drain_queued(self) -> None:
        """A successor's standby socket queued what came before it served: joins of agents
        that followed it first, and maybe announcements of a coordinator that took over from
        it once, cut off, and announced itself to it since (chaos seed 3000: of the job's
        epoch still, they made it stand down for a node cut off since). Those are old news:
        a coordinator that runs the job announces itself each tick, and is followed then."""
        self._queued = True
        until = time.monotonic() + FOLLOWED_QUIET  # (a stream that never pauses: served as usual)
        try:
            while not self._drain() and time.monotonic() < until:
                pass
        finally:
            self._queued = False
        self._forget_closed_joins(time.monotonic())
        if self._intakes is not None:
            self._intakes.flush()

    def _forget_closed_joins(self, now: float) -> None:
        """Joins queued from a connection that closed before we served are no joins: ZeroMQ
        hands over what a peer sent before it left (a spare that followed us while we still
        followed our predecessor, then went on or died). Taken as they stand, such a spare
        held a seat in our round that its assign never reached, its ranks awaited for the
        liveness timeout, and a dead survivor counted as back. A spare is forgotten (alive,
        it joins again); a survivor's machine is probed, as for any connection that closed.
        A large job's survivors are not asked, those only counted either (``expected``: their
        joins said they held a seat): an ack each, ~5 µs, and thousands of them would delay
        the round (10,224 acks in a 16,384-node takeover, before); one that died in that
        moment is found by its silence."""
        s = self._state
        small = self._liveness() <= s.node_timeout  # (see membership.liveness_timeout)
        joined = {node: s.identities[node] for node in self._queued_joins
                  if node in s.identities and (small or node not in s.expected)}
        self._queued_joins.clear()
        closed = self._unroutable(list(joined.values()))
        for node, identity in sorted(joined.items()):
            if identity not in closed:
                continue
            if node in s.group_ranks:
                self._connection_gone(identity, now)
            else:
                self._fds.pop(identity, None)  # its descriptor may be another connection's
                self._lose(node, now, f"node {node}: its join came on a connection closed "
                           "before this coordinator served; forgotten", silent=True)

    def _unroutable(self, identities: list[bytes]) -> set[bytes]:
        """Those of ``identities`` whose connection closed (see unroutable); each open one
        gets an ack: word that we serve."""
        frames = self._codec.encode(HeartbeatAck(settled_below=self._settled_below),
                                    self._state.epoch)
        if self._intakes is not None:
            return self._intakes.unroutable(identities, frames) if identities else set()
        return unroutable(self._socket, identities, frames)

    def _closed_connections(self, monitor: zmq.Socket) -> None:
        """Every connection last heard on a descriptor that closed is closed: the one on it
        now, and any before it there. (A peer's last message is often handled after its
        close, recording a gone connection's descriptor again, which the kernel then gives to
        the next one: taking only the first found, a death went unseen.) A close no message
        named yet is kept until the queue is emptied: the peer's first words may wait there."""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._closed(event["value"])

    def _closed(self, fd: int) -> None:
        closed = [i for i, known in self._fds.items() if known == fd]
        if not closed:
            self._closed_unheard.add(fd)
        for identity in closed:
            self._connection_gone(identity, time.monotonic())

    def _connection_gone(self, identity: bytes, now: float) -> None:
        """Forget a closed connection's descriptor (the kernel gives it to the next one) and
        its heartbeat cadence, then judge its node as for any close (_disconnected)."""
        self._fds.pop(identity, None)
        self._beats.pop(identity, None)
        self._disconnected(identity, now)

    def _announce(self) -> None:
        if self._announcement is None or self._state.final is not None \
                or self._state.redirect is not None:
            return
        frames = self._codec.encode(self._announcement, self._state.epoch)
        for announcer in self._announcers:
            with contextlib.suppress(zmq.Again):  # no one at the endpoint (yet)
                announcer.send_multipart(frames, zmq.NOBLOCK)

    def _answers_to_announcement(self, announcer: zmq.Socket) -> None:
        """The coordinator there still runs the job, or knows who does (we took over from
        inside a partition, and the others went on without our node; or our predecessor,
        cut off, kept the job on the tie). Having formed no round, or none that any other node
        is still in, we stand down: our agents are sent there, where they join again (as
        spares, or to scale the job up) instead of waiting for a round that never forms."""
        while True:
            try:
                frames = announcer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._codec.decode(frames).body
            except ProtocolError as e:
                log.warning("dropped an answer from %s: %s", self._announcers[announcer], e)
                continue
            s = self._state
            if not isinstance(msg, Redirect) or (self._rounds and not self._alone()) \
                    or s.redirect is not None or s.final is not None \
                    or msg.coordinator_node == s.host_node:
                continue
            endpoint = self._announcers[announcer]
            host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            log.warning("the job still runs under coordinator node %s, says %s: standing "
                        "down, sending our agents there", msg.coordinator_node, endpoint)
            s.redirect = Redirect(coordinator_node=msg.coordinator_node, addr=host,
                                  port=int(port))
            self._broadcast(s.redirect)

    def _drain(self) -> bool:
        """Handle the messages already queued, at most DRAIN_BATCH: under a stream faster
        than we keep up with, the round's completion and the liveness tick still run.
        Whether the queue was emptied."""
        emptied = self._drain_batch()
        if self._heard_after_close:
            self._first_words_of_the_closed(time.monotonic())
        if emptied:
            self._closed_unheard.clear()
        return emptied

    def _first_words_of_the_closed(self, now: float) -> None:
        """Peers first heard on a descriptor whose close came before their words (an agent
        that joined and died at once: its close named no connection yet). Those whose
        connection is gone closed like any other (_disconnected). One the socket still
        routes to is a connection the kernel gave the descriptor since, open, or the closed
        one, its route not ended yet: ZeroMQ's I/O thread ends it after it reports the close
        (under load, many ms later; seated, the dead node waited for its silence). Each is
        asked again every tick (_confirm_closes) until its route ends, or for the node
        timeout: an open one, acked meanwhile, is left alone."""
        identities, self._heard_after_close = self._heard_after_close, set()
        for identity in identities:
            self._closes_unconfirmed.setdefault(identity, now + self._state.node_timeout)
        self._confirm_closes(now)

    def _confirm_closes(self, now: float) -> None:
        pending = self._closes_unconfirmed
        for identity in sorted(self._unroutable(sorted(pending))):
            del pending[identity]
            self._connection_gone(identity, now)
        for identity in [i for i, until in pending.items() if now >= until]:
            del pending[identity]

    def _drain_batch(self) -> bool:
        emptied = self._drain_socket()
        if self._intakes is not None:  # what they verified, not checked for replays yet
            for fd, identity, verified in self._intakes.receive(INTAKE_BATCHES):
                if verified is None:
                    self._closed(fd)
                    continue
                try:
                    received = self._codec.accept(verified)
                except Exception as e:  # a replay (or a bug's: as in _drain_socket)
                    log.warning("dropped control message: %s", e)
                    continue
                self._heard(identity, fd, received)
            emptied = emptied and not self._intakes.pending()
        return emptied

    def _drain_socket(self) -> bool:
        for _ in range(DRAIN_BATCH):
            if not int(self._socket.getsockopt(zmq.EVENTS)) & _POLLIN:  # asked: a zmq.Again
                return True  # costs more than a message
            parts = [self._socket.recv(copy=False)]
            while parts[-1].more:  # a message's frames come together
                parts.append(self._socket.recv(copy=False))
            try:
                if len(parts) < 2:
                    raise ProtocolError("no identity frame")
                received = self._codec.decode([p.bytes for p in parts[1:]])
                self._heard(parts[0].bytes, parts[1].get(zmq.SRCFD), received)
            except ProtocolError as e:
                log.warning("dropped control message: %s", e)
            except Exception:  # a bug must not silently stop the job's only decider
                log.exception("coordinator failed to decode a message")
        return False

    def _heard(self, identity: bytes, fd: int, received: Envelope) -> None:
        # Its connection, once it proved it holds the secret: a forged message from a
        # connection that then closes must not make a member look dead.
        self._fds[identity] = fd
        if fd in self._closed_unheard:
            self._heard_after_close.add(identity)
        try:
            self._handle(identity, received, time.monotonic())
        except IntakeLost:
            raise
        except Exception:  # a bug must not silently stop the job's only decider
            log.exception("coordinator failed to handle a message")

    def _send(self, identity: bytes, msg: Body) -> None:
        self._send_frames(identity, self._codec.encode(msg, self._state.epoch))

    def _send_to_all(self, identities: list[bytes], msg: Body) -> None:
        """One encoding for all: each receiver checks sequence numbers on its own."""
        frames = self._codec.encode(msg, self._state.epoch)
        for identity in identities:
            self._send_frames(identity, frames)

    def _send_frames(self, identity: bytes, frames: list[bytes]) -> None:
        """send_multipart's work with plain int flags: its enum arithmetic cost more than
        the sending (a round's N assigns, a large job's acks)."""
        if self._intakes is not None:  # every connection is one of theirs (intake.Port)
            self._intakes.send(identity, frames)
            return
        send = self._socket.send
        send(identity, _SNDMORE)
        for frame in frames[:-1]:
            send(frame, _SNDMORE)
        send(frames[-1])

    def _send_ack(self, identity: bytes) -> None:
        """A heartbeat's ack. One encoding serves every node acked until it would say
        something else, the codec encodes any other message (a receiver that got one would
        take the ack for a replay) or a node would get it twice: a heartbeat handled in ~5 µs
        instead of ~10."""
        settled_below, epoch = self._settled_below, self._state.epoch
        if self._ack is None or self._ack[0] != (self._codec.sent, settled_below, epoch) \
                or identity in self._ack[2]:
            frames = self._codec.encode(HeartbeatAck(settled_below=settled_below), epoch)
            self._ack = ((self._codec.sent, settled_below, epoch), frames, set())
        self._ack[2].add(identity)
        self._send_frames(identity, self._ack[1])

    def _broadcast(self, msg: Body) -> None:
        self._send_to_all(list(self._state.identities.values()), msg)

    def _seen(self, node: str, now: float) -> None:
        """Heard from ``node``: last_seen stays in the order nodes were heard (oldest first),
        so the liveness tick reads only the silent ones. One of the last round heard while
        a round forms is on our side of any partition (see _quorum)."""
        s = self._state
        s.last_seen.pop(node, None)
        s.last_seen[node] = now
        if s.phase == RoundPhase.JOINING:
            s.heard.add(node)
            if node in s.voters:
                s.back.add(node)

    # --- messages ------------------------------------------------------------------------

    def _handle(self, identity: bytes, received: Envelope, now: float) -> None:
        s, msg = self._state, received.body
        node: str = getattr(msg, "node_id", "")
        if isinstance(msg, StatusQuery):  # ftlaunch status: signed with the secret, as all
            self._send(identity, self._status(now))
            return
        if s.final is not None:  # the job is over: tell whoever still talks to us
            self._send(identity, Stop(exit_code=s.final[0], reason=s.final[1]))
            return
        if isinstance(msg, Redirect):
            if not self._queued:
                self._on_announcement(identity, msg, received.epoch, now)
            return
        if s.redirect is not None:
            self._send(identity, s.redirect)
            return
        if received.epoch > s.epoch:
            # An agent of this job from before we started (our node was re-created and is
            # the endpoint again): continue its epochs, or our orders would look stale to it.
            log.info("adopting epoch %d from %s (ours was %d)", received.epoch, msg.TYPE,
                     s.epoch)
            s.epoch = received.epoch
        if isinstance(msg, Heartbeat):
            if node in s.members or node in s.group_ranks:  # after a takeover: not joined yet
                self._learnt(node, msg.electorate_epoch)
                self._seen(node, now)
                s.node_status[node] = (msg.phase, msg.ranks)
                s.identities[node] = identity
                acked, beat = self._beats.get(identity, (-1e9, now))
                next_beat = now + (now - beat)  # as far off as this one
                if next_beat - acked > self._ack_within():
                    acked = now
                    self._send_ack(identity)
                self._beats[identity] = (acked, now)
            else:  # declared lost but alive (it froze, or the network healed): come back in
                self._send(identity, Recover(
                    policy=s.current_policy or s.policy, restart_count=s.restart_count,
                    delay=0.0, cause=f"node {node} was dropped from the job; re-joining"))
            return
        if isinstance(msg, Join):
            self._on_join(identity, msg, now)
            return
        if isinstance(msg, Durable):  # a fact about storage, whatever the epoch it was sent in
            step = s.commits.report(msg.rank, msg.step)
            if step is not None:
                self._broadcast_round(Committed(step=step))
            return
        if isinstance(msg, Replicated):  # a fact about memory, like durable about storage
            step = s.copies.report(msg.rank, msg.step)
            if step is not None:
                self._broadcast_round(InMemory(step=step))
            return
        if received.epoch != s.epoch:
            log.info("ignored stale %s (epoch %d, now %d)", msg.TYPE, received.epoch, s.epoch)
            return
        if node in s.members:
            self._seen(node, now)
        match msg:
            case StoreReady() if s.phase == RoundPhase.WAITING_STORE:
                s.phase = RoundPhase.RUNNING
                s.running_since = now
                s.start = Start(master_addr=msg.master_addr, master_port=msg.master_port,
                                restart_count=s.restart_count)
                self._broadcast_round(s.start)
            case Failure() if s.phase == RoundPhase.RUNNING:
                cause = f"rank {msg.rank} (node {node}) {msg.cause}"
                if failures.is_peer_error(msg.cause):  # the rank that died under it may follow
                    s.peer_error = s.peer_error or (cause, msg.step, now + PEER_ERROR_GRACE)
                else:
                    self._recover_from(cause, now, step=msg.step)
            case Finished() if s.phase == RoundPhase.RUNNING:
                s.finished.add(node)
                s.first_finished_at = s.first_finished_at or now
                if s.finished >= set(s.group_ranks) - s.leaving:
                    if s.leaving:  # they stopped with the leaving node (trainer_shim.preempted)
                        # Not a failure (a pod deleted, a spot node reclaimed): like a scale-up,
                        # it does not count against the restart budget.
                        self._start_new_round(f"nodes {sorted(s.leaving)} left: the others "
                                              "go on", s.restart_count, delay=0.0, now=now)
                    else:
                        self._finish(exit_codes.OK, "all ranks finished")
            case Leave() if msg.exit_code > exit_codes.SIGNAL_BASE:
                self._on_leaving(node, msg, now)
            case Leave():
                self._finish(msg.exit_code, f"node {node} left: {msg.reason}")
            case Unhealthy() if node in s.members:
                self._lose(node, now, f"node {node} excluded: {msg.reason}")

    def _on_join(self, identity: bytes, msg: Join, now: float) -> None:
        s = self._state
        node = msg.node_id
        if self._queued:
            self._queued_joins.add(node)
        s.members[node] = membership.Member(node, msg.local_world_size, msg.addr, msg.rank_hint)
        s.standby_ports[node] = msg.standby_port
        s.replica_ports[node], s.held[node] = msg.replica_port, msg.held
        s.identities[node] = identity
        self._learnt(node, msg.electorate_epoch)
        self._seated(node, (msg.seated_epoch, *msg.seated_earlier), msg.settled_below)
        self._seen(node, now)
        if s.phase == RoundPhase.JOINING and msg.seated_epoch == s.electorate_epoch:
            s.back.add(node)  # of the last round, if a takeover's assign did not name it
        if msg.seated_epoch == s.epoch and msg.group_rank >= 0:
            s.seats_held[node] = msg.group_rank
        # A coordinator that started afresh (its node re-created) learns the job's restarts.
        s.restart_count = max(s.restart_count, msg.restart_count)
        if (s.phase == RoundPhase.JOINING and msg.seated_epoch == s.epoch
                and s.expected_count > len(s.expected)):
            s.expected.add(node)  # a survivor the assign did not name (a takeover of > 16 nodes)
        if s.phase == RoundPhase.JOINING and membership.takes_seat(
                node, s.round_joined, s.expected, s.expected_count, s.max_nodes):
            s.round_joined.add(node)
            if len(s.round_joined) >= s.min_nodes and s.min_reached_at is None:
                s.min_reached_at = now
        elif (s.phase in (RoundPhase.WAITING_STORE, RoundPhase.RUNNING)
              and node not in s.group_ranks
              and len(s.group_ranks) < s.max_nodes):
            # A late joiner within MAX: scale up at the next safe point, i.e. now (a restart).
            self._start_new_round(f"node {node} joined: scaling up to {len(s.group_ranks) + 1} "
                                  "nodes", s.restart_count, delay=0.0, now=now, newcomer=node)
        elif node not in s.group_ranks:
            if s.phase != RoundPhase.JOINING:
                log.warning("node %s waits as a spare: the job runs on its maximum of %d nodes",
                            node, s.max_nodes)
            self._send(identity, Spare(members=s.successors, spares=s.spares,
                                       coordinator_node=s.host_node))
        elif msg.seated_epoch != s.epoch and node in s.assigns:
            # Seated, yet it says it never was: its assign went to a connection it has since
            # left (chaos seed 1332: its join, held up by a partition, reached the successor
            # late and put it in the takeover's round). Again, on this one.
            log.info("node %s joined again without its seat: sending its assign again", node)
            self._send(identity, s.assigns[node])
            if s.start is not None:
                self._send(identity, s.start)
        # else: a duplicate join from a member (a restarted agent has a new node id).

    def _alone(self) -> bool:
        """No node of our rounds is left but our own: we are fresh, or were cut off from
        every other node."""
        s = self._state
        return not set(s.group_ranks) - {s.host_node}

    def _on_announcement(self, identity: bytes, msg: Redirect, epoch: int, now: float) -> None:
        """Another coordinator says it runs the job (a successor announcing itself at the
        endpoint). Who goes on: the coordinator with other nodes of the job; failing that,
        the announcer unless it is behind (a successor takes over at its predecessor's epoch,
        so a tie is no proof that we kept the job)."""
        s = self._state
        if not self._alone() and s.redirect is None:
            if msg.coordinator_node not in s.group_ranks:
                # A node we lost took over from inside a partition: the job runs here.
                self._send(identity, Redirect(coordinator_node=s.host_node, addr="", port=0))
            else:  # a member took over from us (we were cut off, or frozen): its silence
                self._hosting[msg.coordinator_node] = now  # decides, its knocks do not
            return
        # A successor knows the job's epoch: an older announcement is stale (chaos seed
        # 3011: one its standby socket had queued, from a successor since dead).
        behind = epoch < (s.redirect_epoch if s.redirect is not None else
                          s.epoch if self._rounds or self._took_over else 0)
        if behind:  # cut off from the job longer than we were: it stands down
            runs = s.redirect.coordinator_node if s.redirect is not None else s.host_node
            self._send(identity, Redirect(coordinator_node=runs, addr="", port=0))
            return
        # We never formed a round (our node was re-created at the endpoint while the job went
        # on under a successor), or we were cut off from every other node and the job went on
        # without us: send our agents, and any that come, there. The latest successor to
        # announce itself, of the newest epoch, wins (the one before may be gone too: its
        # successor takes over at its epoch; our own node may be it, on its standby socket),
        # once the one we follow stops announcing: two at one epoch (both held, after a
        # heal) must not send our agents back and forth each tick until one stands down.
        if s.redirect is not None and s.redirect != msg and epoch == s.redirect_epoch \
                and now - s.redirect_heard < FOLLOWED_QUIET:
            return
        s.redirect_epoch, s.redirect_heard = epoch, now
        if s.redirect != msg:
            log.warning("the job runs under coordinator node %s at %s:%d: redirecting agents "
                        "there", msg.coordinator_node, msg.addr, msg.port)
            s.redirect = msg
            for node_identity in s.identities.values():
                self._send(node_identity, msg)

    def _on_leaving(self, node: str, msg: Leave, now: float) -> None:
        """A node stopped by a signal: a pod deleted or evicted, a spot node reclaimed, a
        scancel. Its ranks get the signal, and with trainer_shim every rank of the job
        agrees to save a checkpoint and stop; the job then goes on without the node (and
        with its replacement when one joins), unless every node is leaving."""
        s = self._state
        s.leaving.add(node)
        for table in (s.members, s.standby_ports, s.identities, s.last_seen, s.held, s.seats_held,
                      s.replica_ports):
            table.pop(node, None)
        s.round_joined.discard(node)
        if s.group_ranks and not set(s.group_ranks) - s.leaving:
            self._finish(msg.exit_code, f"every node left ({msg.reason})")
        elif s.phase == RoundPhase.JOINING:
            self._forget_leaving()
            self._seat_spares(now)

    def _forget_leaving(self) -> None:
        s = self._state
        s.gone |= {node for node in s.leaving if self._votes(node)}  # they train nowhere
        for node in s.leaving:
            s.group_ranks.pop(node, None)
            self._uncount(node)
        s.leaving.clear()

    def _uncount(self, node: str) -> None:
        """A survivor the round waits for will not come: one seat fewer to wait for. A
        spare or newcomer lost meanwhile was never counted (a large takeover's count of its
        unnamed survivors would fall short: one left out, to come back as a scale-up)."""
        s = self._state
        if node in s.expected:
            s.expected.discard(node)
            s.expected_count = max(0, s.expected_count - 1)

    # --- decisions -----------------------------------------------------------------------

    def _recover_from(self, cause: str, now: float, step: int = -1) -> None:
        """``step``: the highest step the failed attempt reported (-1: unknown)."""
        s = self._state
        uptime = now - s.running_since if s.running_since is not None else None
        s.progress = s.progress.after_failure(step, uptime, s.healthy_after)
        s.running_since = None
        decision = recovery.decide(s.restart_count, s.max_restarts, s.policy, cause,
                                   s.backoff, s.backoff_max, s.progress, s.max_stalled)
        if decision.action == recovery.Action.FAIL:
            self._finish(exit_codes.JOB_FAILED, decision.reason)
        elif decision.action == recovery.Action.STALLED:
            self._finish(exit_codes.DO_NOT_REQUEUE, decision.reason)
        else:
            s.current_policy = decision.policy
            self._start_new_round(cause, decision.restart_count, decision.delay, now)

    def _start_new_round(self, cause: str, restart_count: int, delay: float, now: float,
                         newcomer: str = "") -> None:
        """``newcomer``: the late joiner the round scales up for; it takes the seat it
        opened before any idle spare is seated."""
        s = self._state
        s.restart_count, s.last_cause = restart_count, cause
        s.peer_error = None
        self._forget_leaving()
        s.expected = set(s.group_ranks)
        s.expected_count = max(s.expected_count, len(s.expected))
        self._broadcast_round(Recover(policy=s.current_policy or s.policy,
                                      restart_count=restart_count, delay=delay, cause=cause))
        s.phase = RoundPhase.JOINING
        s.round_joined.clear()
        s.back.clear()  # each survivor is heard again
        s.heard.clear()
        s.joining_since = now
        s.min_reached_at = None
        if newcomer:
            s.expected.add(newcomer)
            s.round_joined.add(newcomer)
        self._seat_spares(now)

    def _seat_spares(self, now: float) -> None:
        """Idle nodes that joined already (hot spares) take the round's free seats: those
        up to MAX that neither a node of the last round nor a joined one will fill."""
        s = self._state
        free = s.max_nodes - len(set(s.group_ranks) | s.round_joined)
        s.round_joined.update(self._idle_spares(now)[:max(0, free)])

    def _idle_spares(self, now: float) -> list[str]:
        """Members outside the round, heard from lately: one silent for half the liveness
        timeout, not yet found lost, is no seat-holder (chaos seed 1436: a coordinator cut
        off by a partition closed a round of spares as silent as the rest of the job)."""
        s = self._state
        lately = now - self._liveness() / 2
        return sorted(n for n in s.members if n not in s.group_ranks and n not in s.round_joined
                      and s.last_seen.get(n, now) >= lately)

    def _complete_round(self, now: float) -> None:
        s = self._state
        committed = s.commits.committed  # of the last world: the newest step storage has
        self._rounds += 1
        if s.electorate:  # it votes on the next rounds too until most of it learnt the new one
            # Its voters: those we knew by name, and (after a takeover, which knows 16) those
            # that said in their join they held a seat in it; counted by name from now on.
            voters = frozenset(s.voters | s.back)
            self._settle().append(membership.Electorate(s.electorate_epoch, s.electorate, voters,
                                                       frozenset(s.gone & voters)))
        # Who trains nowhere stays so for every round it voted on (chaos seed 2701: a voter of
        # one not settled, known gone only while this round formed, held the next round).
        s.earlier = [replace(e, gone=e.gone | (s.gone & e.voters)) for e in s.earlier]
        s.epoch += 1
        s.expected_count = 0
        s.back, s.heard, s.gone, s.wins_tie = set(), set(), set(), True
        self._said_short = False
        s.finished.clear()
        s.first_finished_at = None
        spares = self._idle_spares(now)
        s.round_joined.update(spares[:max(0, s.max_nodes - len(s.round_joined))])  # in for the lost
        assignments = membership.assign_ranks([s.members[n] for n in s.round_joined],
                                              {**s.seats_held, **s.group_ranks})
        s.seats_held = {}
        s.group_ranks = {a.node_id: a.group_rank for a in assignments}
        s.spares = tuple(Successor(n, s.members[n].addr, s.standby_ports[n])
                         for n in self._idle_spares(now)[:SUCCESSORS])
        s.voters = set(s.group_ranks) | {spare.node_id for spare in s.spares}
        s.electorate, s.electorate_epoch = len(s.voters), s.epoch
        self._learnt(s.host_node, s.epoch)  # we hold it
        s.learnt = {node: epoch for node, epoch in s.learnt.items()  # of the others: moot
                    if node in s.members or self._votes(node)}
        if assignments and assignments[0].world_size != s.commits.world_size:
            s.commits = CommitLog(assignments[0].world_size)  # shards of another world differ
            s.copies = CommitLog(assignments[0].world_size)
        members = tuple(Successor(a.node_id, s.members[a.node_id].addr,
                                  s.standby_ports[a.node_id]) for a in assignments[:SUCCESSORS])
        s.successors = members
        s.phase = RoundPhase.WAITING_STORE
        replicas = self._replicas(assignments, committed)
        s.start = None
        earlier = tuple(EarlierVoter(*row) for row in  # (noted before any ack follows them)
                        membership.named(self._note_unsettled(), SUCCESSORS))
        first = assignments[0] if assignments else None
        s.assigns = Seats(Assign(
            group_rank=0, group_world_size=first.group_world_size if first else 0,
            rank_offset=0, world_size=first.world_size if first else 0,
            restart_count=s.restart_count, max_restarts=s.max_restarts, members=members,
            spares=s.spares, earlier=earlier, coordinator_node=s.host_node, replicate_to=(),
            fetch=()), {a.node_id: (a.group_rank, a.rank_offset, *replicas[a.node_id])
                        for a in assignments})
        self._send_seats(s.assigns, now)
        for node in s.members.keys() - s.group_ranks.keys():  # spares: whom to follow now
            if node in s.identities:
                self._send(s.identities[node], Spare(members=members, spares=s.spares,
                                                     coordinator_node=s.host_node))

    def _send_seats(self, assigns: Seats, now: float) -> None:
        """Each node its assign: the shared part encoded once (Codec.reserve), each seat
        signed here or, on an intake's connection, by the intake."""
        assert assigns.template is not None
        s, kind = self._state, Assign.TYPE
        head, first = self._codec.reserve(assigns.template, Assign.SEAT, s.epoch, len(assigns))
        for seq, (node, seat) in enumerate(assigns.seats.items(), first):
            identity = s.identities[node]
            if self._intakes is not None:  # the intake signs it
                self._intakes.send_signed(identity, head, kind, Assign.SEAT, seat, seq)
            else:
                self._send_frames(identity, self._codec.sign(head, kind, Assign.SEAT, seat, seq))
            # Word from us, as an ack is: a node's first beat after it needs none (else a
            # large job's every node has its first beat acked, 16,384 acks a round).
            self._beats[identity] = (now, now)

    def _replicas(self, assignments: list[membership.Assignment],
                  committed: int) -> dict[str, tuple[Peers, Fetches]]:
        """Per node: who keeps copies of its staged shards, and what it pulls from whom
        before its ranks restore (from the shards the nodes said they hold when joining;
        nothing when storage has a newer step than memory)."""
        s = self._state
        members, ports = s.members, s.replica_ports
        ring = [(a.node_id, members[a.node_id].addr) for a in assignments]  # domain: host
        seats = [replica_plan.Seat(a.node_id, a.rank_offset, members[a.node_id].local_world_size,
                                   a.world_size) for a in assignments]
        held = {n: s.held.get(n, ()) for n in s.round_joined}
        in_memory = replica_plan.newest_in_memory(held)
        plan = replica_plan.fetch_plan(held, seats, committed, in_memory)
        # Each node's Peer built once, not once for each node it keeps copies for.
        keepers = {node: Peer(node, addr, ports[node]) for node, addr in ring if ports.get(node)}
        every_holder = replica_plan.every_holder(ring, s.replicas)
        out: dict[str, tuple[Peers, Fetches]] = {
            node: (tuple(keepers[n] for n in every_holder.get(node, ()) if n in keepers), ())
            for node, _ in ring}
        for node, pulls in plan.items():
            out[node] = (out[node][0], tuple(
                Fetch(h.world_size, h.rank, h.step, src, members[src].addr, ports.get(src, 0))
                for h, src in pulls))
        if plan:
            log.info("restoring from peers' memory: %s", {n: [(h.rank, h.step, src) for h, src in pulls]
                                                        for n, pulls in plan.items()})
        elif in_memory and in_memory[1] < committed:
            log.info("storage has a newer step (%d) than the nodes' memory (%d): the ranks "
                     "restore it", committed, in_memory[1])
        elif in_memory and replica_plan.too_wide_to_reshard(in_memory[0], seats):
            log.warning("step %d, whole in the nodes' memory, was saved by %d ranks: resized "
                        "to %d nodes, each would pull every saved shard (the whole state), so "
                        "the ranks restore from storage (%s)", in_memory[1], in_memory[0],
                        len(seats), f"step {committed}" if committed >= 0
                        else "no step committed there yet: they start afresh")
        elif any(held.values()) and in_memory is None:
            log.warning("no checkpoint step is whole in the memory of the %d nodes joined (a "
                        "node and the peer keeping its copies lost together?): the ranks "
                        "restore from storage", len(held))
        return out

    def _status(self, now: float) -> JobStatus:
        """The job as this coordinator sees it: every member's and each rank's last word."""
        s = self._state
        nodes = sorted(set(s.members) | set(s.group_ranks),
                       key=lambda n: (s.group_ranks.get(n, 1 << 30), n))
        ages = {n: int(1000 * (now - s.last_seen[n])) if n in s.last_seen else -1
                for n in nodes}
        ages[s.host_node] = 0  # its own agent: alive by definition
        return JobStatus(
            run_id=s.run_id, coordinator_node=s.host_node, round_phase=str(s.phase),
            job_epoch=s.epoch, restart_count=s.restart_count, max_restarts=s.max_restarts,
            min_nodes=s.min_nodes, max_nodes=s.max_nodes,
            committed_step=s.commits.committed,
            last_cause=s.last_cause, final="" if s.final is None else s.final[1],
            nodes=tuple(NodeState(n, s.group_ranks.get(n, -1),
                                  s.node_status.get(n, ("unknown", ()))[0], ages[n])
                        for n in nodes),
            ranks=tuple(NodeRankState(n, r.rank, r.step, r.beat_age_ms) for n in nodes
                        for r in s.node_status.get(n, ("", ()))[1]))

    def _broadcast_round(self, msg: Body) -> None:
        """To the nodes of the current round we can reach (a successor knows none at first)."""
        identities = self._state.identities
        self._send_to_all([identities[n] for n in self._state.group_ranks if n in identities], msg)

    def _finish(self, exit_code: int, reason: str) -> None:
        self._state.phase = RoundPhase.DONE
        self._state.final = (exit_code, reason)
        self._broadcast(Stop(exit_code=exit_code, reason=reason))

    def _tick(self, now: float) -> None:
        s = self._state
        if s.final is not None:
            return
        if self._closes_unconfirmed:
            self._confirm_closes(now)
        self._note_unsettled()
        self._lose_the_silent(now)
        if s.final is None and s.phase == RoundPhase.JOINING:
            self._seat_spares(now)  # a spare passed over while silent that speaks again
        if (s.final is None and s.phase == RoundPhase.JOINING
                and not self._maybe_complete_round(now)
                and now - s.joining_since > s.join_timeout):
            if self._said_short and (short := self._short_of_quorum()) is not None:
                whose, back, size, away = short
                why = f"held for a quorum: {back} of {whose} {size} nodes came back within " \
                    f"{s.join_timeout:g}s, {away} may have gone on behind a partition; heal " \
                    "the network"
            else:
                why = f"{len(s.round_joined)} of at least {s.min_nodes} nodes joined within " \
                    f"{s.join_timeout:g}s; start the missing nodes"
            self._finish(exit_codes.JOB_FAILED, f"rendezvous timed out: {why} or raise "
                         "--rdzv-conf join_timeout")
        if s.phase == RoundPhase.RUNNING and s.peer_error and now >= s.peer_error[2]:
            self._recover_from(s.peer_error[0], now, step=s.peer_error[1])  # no other came
        if (s.phase == RoundPhase.RUNNING and s.first_finished_at is not None
                and now - s.first_finished_at > s.exit_barrier_timeout):
            missing = sorted(set(s.group_ranks) - s.finished)
            self._finish(exit_codes.JOB_FAILED, f"exit barrier timed out waiting for {missing}")

    def _lose_the_silent(self, now: float) -> None:
        """Members silent past the liveness timeout, their machines not answering knocks
        (membership.lost_by_silence): lost."""
        s = self._state
        liveness = self._liveness()
        silent = membership.silent_members(s.last_seen, now, liveness / 2, s.host_node)
        for node in silent:
            silence = now - s.last_seen[node]
            unanswered = now - max(self._knock(node, now), s.last_seen[node])
            if self._hosting.get(node, -1e9) > s.last_seen[node]:
                # It announced itself coordinator since we heard it: its agent follows
                # itself, not a stalled one of ours (chaos 2-node seed 3900: a cut-off
                # coordinator, healed, held its successor's round twice the timeout).
                unanswered = silence
            if membership.lost_by_silence(silence, unanswered, liveness):
                if node in self._knocks and unanswered < silence:
                    log.warning("node %s: its machine last answered a knock %.1fs ago", node,
                                unanswered)
                self._lose(node, now, silent=True)
            elif silence > liveness and node not in self._said_late:
                self._said_late.add(node)
                log.warning("node %s silent for %.1fs, but its machine answers: a lossy link, "
                            "or its agent stalls; lost if silent for %gs", node, silence,
                            2 * liveness)
        still = {node for node in silent if node in s.last_seen}
        for node in self._knocks.keys() - still:  # heard again, or lost
            self._knocks.pop(node).close()
            self._said_late.discard(node)

    def _knock(self, node: str, now: float) -> float:
        """When a silent member's machine last answered a knock at its standby port (as an
        agent knocks at its coordinator's: ControlPlane._silent). Not in a large job, whose
        timeout is three of its beats, far past TCP's back-off."""
        s = self._state
        member, port = s.members.get(node), s.standby_ports.get(node)
        liveness = self._liveness()
        if member is None or not port or liveness > s.node_timeout:
            return -1e9
        if node not in self._knocks:
            self._knocks[node] = Knocks(member.addr, port, membership.KNOCK * liveness,
                                        liveness / 2)
        return self._knocks[node].knock(now)

    def _ack_within(self) -> float:
        """Seconds within which an agent hears an ack (see ACK_WITHIN)."""
        liveness = self._liveness()
        return liveness * (LARGE_ACK_WITHIN if liveness > self._state.node_timeout
                           else ACK_WITHIN)

    def _liveness(self) -> float:
        """Heartbeat silence that loses a node: a large job heartbeats less often."""
        return membership.liveness_timeout(self._state.node_timeout, self._state.max_nodes)

    def _maybe_complete_round(self, now: float) -> bool:
        s = self._state
        reason = membership.round_complete(s.round_joined, s.expected, s.min_nodes,
                                           s.max_nodes, s.min_reached_at, now, s.last_call,
                                           s.expected_count)
        if reason is None or not self._quorum():
            return False
        log.info("rendezvous round closed: %s", reason)
        with collector_paused():
            self._complete_round(now)
        return True

    def _quorum(self) -> bool:
        """More of the last round back than may train on cut off (membership.has_quorum),
        and of each earlier one not yet settled; the round waits otherwise, for them to come
        back, until the join timeout."""
        short = self._short_of_quorum()
        if short is None:
            return True
        if not self._said_short:
            self._said_short = True
            whose, back, size, away = short
            log.warning("rendezvous round held: %d of %s %d nodes here, %d may go on behind a "
                        "partition; waiting for them", back, whose, size, away)
        return False

    def _short_of_quorum(self) -> tuple[str, int, int, int] | None:
        """The first electorate without a quorum here: (whose, back, size, maybe away)."""
        s = self._state
        self._settle()
        ahead = {n for n, epoch in s.learnt.items() if epoch > s.electorate_epoch}  # see settled
        back, gone = len((s.back - ahead) | ({s.host_node} & s.voters)), len(s.gone & s.voters)
        if not membership.has_quorum(s.electorate, back, gone, s.wins_tie):
            return "the last round's", back, s.electorate, s.electorate - back - gone
        for e in s.earlier:  # (with their reported voters: see _settle)
            back = len(((s.heard - ahead) | {s.host_node}) & e.voters)
            gone = len(e.gone | (s.gone & e.voters))
            if not membership.has_quorum(e.size, back, gone, s.wins_tie):
                return (f"the round of epoch {e.epoch}'s (most not yet told of the next)", back,
                        e.size, e.size - back - gone)
        return None

    def _settle(self) -> list[membership.Electorate]:
        """The earlier electorates not settled yet (forgetting the others), oldest first,
        with their reported voters."""
        s = self._state
        s.earlier = [e for e in map(self._counted, s.earlier)
                     if not membership.settled(e, s.learnt)]
        s.reported = {}  # (counted in now)
        return s.earlier

    def _note_unsettled(self) -> list[membership.Electorate]:
        """What heartbeat acks say: every electorate before this epoch is settled, the
        oldest earlier one's that is not, else our own electorate's (an agent then forgets
        those its assign named before it: a successor counts no settled one). Said of
        epochs, not of what the agent was told: a successor behind it (an assign it missed)
        claims nothing of rounds it never heard of. Found once a tick and at each close,
        not per ack (O(voters)). The earlier electorates not settled, as _settle."""
        earlier = self._settle()
        self._settled_below = earlier[0].epoch if earlier else self._state.electorate_epoch
        return earlier

    def _seated(self, node: str, epochs: tuple[int, ...], settled_below: int) -> None:
        """A node says it held a seat in the rounds of these epochs: a voter of their
        electorates, which a successor knew not by name (a large job's earlier round).
        One that never says so is not counted: a round may wait, never close wrongly.
        It reports those since the oldest it was told is not settled; what a coordinator
        told it is settled stays so (most of it learnt better), and is counted no more."""
        s = self._state
        if s.earlier and s.earlier[0].epoch < settled_below:  # (oldest first; rarely so)
            s.earlier = [e for e in s.earlier if e.epoch >= settled_below]
        for e in s.earlier:
            if e.epoch in epochs and node not in e.voters:
                s.reported.setdefault(e.epoch, set()).add(node)

    def _counted(self, electorate: membership.Electorate) -> membership.Electorate:
        """An earlier electorate with the voters that reported themselves (see _seated)."""
        reported = self._state.reported.get(electorate.epoch)
        return replace(electorate, voters=electorate.voters | reported) if reported \
            else electorate

    def _learnt(self, node: str, electorate_epoch: int) -> None:
        s = self._state
        s.learnt[node] = max(s.learnt.get(node, -1), electorate_epoch)

    def _votes(self, node: str) -> bool:
        """In the last round's electorate, or an earlier one not yet settled."""
        s = self._state
        return node in s.voters or any(node in e.voters for e in s.earlier)

    def _disconnected(self, identity: bytes, now: float) -> None:
        """A member's connection closed: its agent died (a process that exits closes its
        sockets), or the kernel ended it: after the node timeout without a packet from its
        machine (keep_alive: powered off, cut off), or with its messages still coming under
        packet loss (TCP_USER_TIMEOUT). A quiet one of a large job is lost now as silent (its
        rare heartbeats would take longer); any other is probed (peer_probe): a death is acted
        on within a round trip, a live agent is left to its heartbeats, and their silence to
        _lose_the_silent. A frozen process on a live machine keeps its connection and is
        found by its heartbeats' silence."""
        s = self._state
        node = next((n for n, i in s.identities.items() if i == identity), None)
        if node is None or node == s.host_node or s.final is not None or node in s.leaving:
            return  # not a member (a status query, a spare's old link), or on its way out
        if went_silent(now - s.last_seen.get(node, now), s.node_timeout) \
                and self._liveness() > s.node_timeout:
            self._lose(node, now, f"node {node} lost (nothing from its machine for "
                       f"{s.node_timeout:g}s)", silent=True)
            return
        member, port = s.members.get(node), s.standby_ports.get(node)
        if member is None or not port:
            self._connection_closed(node, Verdict.DIED, now)  # nothing to ask: as it says
            return
        self._drop_probe(node)
        probe = self._probes[node] = Probe(member.addr, port, s.node_timeout)
        if self._poller is not None and probe.fd >= 0:
            self._poller.register(probe.fd, zmq.POLLIN)
        self._probes_answered(now)  # refused at once, or no route

    def _probes_answered(self, now: float) -> None:
        for node, probe in list(self._probes.items()):
            if (answer := probe.answer(now)) is not None:
                self._drop_probe(node)
                self._connection_closed(node, answer, now)

    def close_probes(self) -> None:
        """Close every probe and knock under way (their sockets are the coordinator's own)."""
        for node in list(self._probes):
            self._drop_probe(node)
        for knock in self._knocks.values():
            knock.close()

    def _drop_probe(self, node: str) -> None:
        probe = self._probes.pop(node, None)
        if probe is None:
            return
        if self._poller is not None and probe.fd >= 0:
            self._poller.unregister(probe.fd)
        probe.close()

    def _connection_closed(self, node: str, answer: Verdict, now: float) -> None:
        """What a probe of a member whose connection closed while it was heard from said:
        refused, its agent died; else its silence decides, as for any machine."""
        s = self._state
        if node not in s.identities or s.final is not None or node in s.leaving:
            return  # lost or leaving meanwhile
        if answer is Verdict.DIED:
            self._lose(node, now, f"node {node} lost (its agent's connection closed)")
        else:
            log.warning("node %s: its connection closed while it was heard from, and its "
                        "machine %s: a network fault, not its death; lost only if it goes "
                        "silent for %gs", node, no_death(answer), self._liveness())

    def _lose(self, node: str, now: float, cause: str = "", silent: bool = False) -> None:
        """``silent``: its machine went quiet, so it may be alive behind a partition."""
        s = self._state
        if cause:
            log.warning("%s", cause)
        else:
            log.warning("node %s lost: no heartbeat for %.1fs", node, now - s.last_seen[node])
            cause = f"node {node} lost (no heartbeat for {self._liveness():g}s)"
        for table in (s.members, s.standby_ports, s.identities, s.last_seen, s.held, s.seats_held,
                      s.replica_ports, self._hosting):
            table.pop(node, None)
        s.round_joined.discard(node)
        s.back.discard(node)
        s.heard.discard(node)
        if self._votes(node) and not silent:  # its process died, or it was excluded: it
            s.gone.add(node)  # trains nowhere
        if node in s.group_ranks:
            in_round = s.phase in (RoundPhase.WAITING_STORE, RoundPhase.RUNNING)
            del s.group_ranks[node]
            if in_round:
                self._recover_from(cause, now)
        self._uncount(node)
        if s.phase == RoundPhase.JOINING:  # lost while a round forms: a spare takes its seat
            self._seat_spares(now)
