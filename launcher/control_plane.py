"""This agent's link to the coordinator: host it when this node should, heartbeat it, and
follow it to a successor when its node is lost ("Paranoid Pirate" liveness both ways)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import resource
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from ftlaunch_contract.messages import (
    Assign,
    Body,
    EarlierVoters,
    Heartbeat,
    HeartbeatAck,
    Join,
    RankStates,
    Redirect,
    Spare,
    Successors,
)
from ftlaunch_contract.protocol import Codec, Envelope, ProtocolError
from launcher import UsageError, membership
from launcher.coordinator import (
    Coordinator,
    JobState,
    connection_monitor,
    keep_alive,
    went_silent,
)
from launcher.intake import Port
from launcher.peer_probe import Knocks, Probe, Verdict, no_death

log = logging.getLogger("ftlaunch.control")


def job_secret(secret_file: str | None, rdzv_id: str, single_node: bool) -> bytes:
    """The per-job key for message signatures: FTLAUNCH_SECRET, --secret-file, or a default."""
    if os.environ.get("FTLAUNCH_SECRET"):
        return hashlib.sha256(os.environ["FTLAUNCH_SECRET"].encode()).digest()
    if secret_file:
        try:
            return hashlib.sha256(Path(secret_file).read_bytes().strip()).digest()
        except OSError as e:
            raise UsageError(f"--secret-file {secret_file}: {e.strerror}; give a readable file "
                             "holding the job secret") from None
    if single_node:
        return secrets.token_bytes(32)
    log.warning("no FTLAUNCH_SECRET or --secret-file: control messages are signed with a key "
                "derived from --rdzv-id, which only protects against accidents")
    return hashlib.sha256(f"ftlaunch-job:{rdzv_id}".encode()).digest()


def names_this_host(host: str) -> bool:
    """``host`` is this machine by name (a pod's own DNS name, pod-0.svc...), which its
    DNS may not serve yet when the pod starts: its /etc/hosts knows the short name."""
    return host.split(".")[0] == socket.gethostname().split(".")[0]


def outgoing_addr(host: str) -> str:
    """The local address this machine uses to reach ``host`` (what peers should dial)."""
    if names_this_host(host):
        with contextlib.suppress(OSError):
            return socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((socket.gethostbyname(host), 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def room_for_connections(nodes: int, watched: bool, intakes: int = 0) -> None:
    """A coordinator holds a connection per agent (two in a large job: see the watch), and
    so does the standby socket of its first successor; ``intakes`` share them (they inherit
    the limit: raised before they start). Raise the open-file limit to what ``nodes``
    need, or say why the job will not fit."""
    need = -(-nodes * (2 if watched else 1) // max(1, intakes)) + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    if min(need, hard) < need:
        log.warning("open files are limited to %d here, below the %d connections a "
                    "coordinator of %d nodes needs a process (with %d intakes): agents past "
                    "that cannot connect; raise `ulimit -n` (LimitNOFILE) on the nodes, or "
                    "--intakes", hard, need, nodes, intakes)


class ControlPlane:
    """The DEALER socket to the current coordinator, plus this agent's standby ROUTER."""

    def __init__(self, context: zmq.Context, secret: bytes, node_id: str, addr: str,
                 endpoint: tuple[str, int] | None, new_state: Callable[[], JobState],
                 node_timeout: float, heartbeat_interval: float, intakes: int = 0,
                 runtime_dir: str | None = None):
        """``intakes``: processes serving our standby port, and the rendezvous endpoint
        should we host it (launcher.intake), whose local sockets live in ``runtime_dir``
        (private: the agent's staging directory)."""
        self._context, self._secret = context, secret
        self._intakes, self._runtime_dir = intakes, runtime_dir
        self.node_id, self.addr = node_id, addr
        self._new_state = new_state
        # As a job of up to --nnodes MAX (see membership.beat_interval).
        self._node_timeout, max_nodes = node_timeout, new_state().max_nodes
        self._interval = membership.beat_interval(heartbeat_interval, max_nodes)
        self._liveness = membership.liveness_timeout(node_timeout, max_nodes)  # coordinator's
        self._watching = self._liveness > node_timeout  # see the watch below
        self._woke_at = -1e9
        self.codec = Codec(secret)
        self.coordinator: Coordinator | None = None
        self._redirecting: Coordinator | None = None  # see _host
        # Every agent keeps a connection open to the coordinator's first successor (see
        # _prepare_takeover): ours may be the standby the whole job connects to.
        room_for_connections(max_nodes, self._watching, intakes)
        self.standby: Port | None = Port(context, addr, 0, node_timeout, secret, intakes,
                                         small=not self._watching, max_nodes=max_nodes,
                                         directory=runtime_dir)
        self.standby_port = self.standby.port
        self.members: Successors = ()  # by group rank: who would take over the coordinator
        self.spares: Successors = ()  # the round's spares (they vote: see fail_over)
        self.electorate_epoch = -1  # the epoch members and spares came at (see Heartbeat)
        self.earlier: EarlierVoters = ()  # electorates before it not settled (see fail_over)
        # Every electorate of an epoch before it is settled, as our coordinators said (see
        # Join): what an assign listed, what acks say; a spare word says nothing of it.
        self.settled_below = -1
        self._electorate_host = ""  # the coordinator that sent them: it holds that electorate
        self.coordinator_node = ""
        self.redirected = False  # we follow a redirect and have not been assigned since
        self._lost: set[str] = set()  # coordinators we failed over from, since members came
        self._cut_off: set[str] = set()  # those of them that went silent (see has_quorum)
        if endpoint is None:  # single node: our own coordinator on a free local port
            self._host(self.standby, self.new_state_for_host())
            endpoint = (addr, self.standby_port)
            self.standby = None
        else:
            self._try_to_host(endpoint)
        self._endpoint = f"tcp://{endpoint[0]}:{endpoint[1]}"
        self.socket, socket_monitor = self._dealer(self._endpoint)
        # In a large job, whose heartbeats and acks are too rare to find a silent machine
        # within the node timeout: a second connection that never carries a message, so
        # TCP keepalive alone says whether the coordinator's machine answers (on ours, a
        # heartbeat in flight would hold keepalive off). Not in a small job: 1 s keepalive
        # probes, unlike data, are not retransmitted fast, and lossy links would lose it.
        self._down: set[int] = set()  # which of our two connections (0, 1) closed
        self._died = False  # the coordinator's process died (a probe was refused)
        self._probe: Probe | None = None  # of the coordinator, for a connection that closed
        self._probing: set[int] = set()  # while it was heard from: which one (see on_probe)
        self._addresses = {endpoint[0]: _resolved(endpoint[0])} if endpoint else {}
        self._connect_by: float | None = None  # a successor's connection closed: see _unheard
        self._unheard = False  # we follow a successor that has not answered yet
        self._join: tuple[Join, int] | None = None  # sent on this connection, maybe lost
        # Its words late, the coordinator's machine may still answer (see _silent).
        self._knocks: Knocks | None = None
        self._answered_at = -1e9  # when it last did (a knock, or the probe of a close)
        self._said_late = False  # logged that it is late, since we last heard it
        self.watch = context.socket(zmq.DEALER)
        self.watch.setsockopt(zmq.LINGER, 0)
        keep_alive(self.watch, node_timeout)
        self._watch_endpoint = ""
        if self._watching:
            self._watch(self._endpoint)
        # The coordinator's process dying closes our connections: act on it at once.
        self.monitors = [socket_monitor, connection_monitor(self.watch, _CONNECTION_EVENTS)]
        # Our next socket, already connected to the first successor's standby: a takeover
        # of thousands of nodes then waits for no accept and no handshake.
        self._next: tuple[zmq.Socket, zmq.Socket] | None = None
        self._next_endpoint = ""
        self._takeover_due = False
        self._rendezvous = self._endpoint if endpoint is not None else ""  # where agents meet
        self.last_heard = time.monotonic()
        self.next_heartbeat = time.monotonic() + self._interval

    def _dealer(self, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER connected to ``endpoint``, and its connection monitor."""
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 2 << 20)
        monitor = connection_monitor(sock, _CONNECTION_EVENTS)
        sock.connect(endpoint)
        return sock, monitor

    @property
    def endpoint(self) -> str:
        """Where the coordinator we follow is (tcp://host:port)."""
        return self._endpoint

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between our heartbeats now (see membership.beat_interval)."""
        return self._interval

    @property
    def hosting(self) -> bool:
        return self.coordinator is not None

    @property
    def coordinator_failure(self) -> str | None:
        """The coordinator we host died of a bug (see Coordinator.failure)."""
        return self.coordinator.failure if self.coordinator is not None else None

    def new_state_for_host(self) -> JobState:
        state = self._new_state()
        state.host_node = self.node_id
        return state

    def _host(self, sock: zmq.Socket | Port, state: JobState, takeover: str | None = None,
              predecessors: tuple[str, ...] = ()) -> None:
        """``takeover``: as a successor, which also tells the rendezvous endpoint where the
        job now runs (whatever comes up there next is sent here), and ``predecessors`` that
        went silent (cut off, one may hold the tie: then we stand down once it answers)."""
        endpoints = tuple(e for e in (self._rendezvous, *predecessors) if e) if takeover else ()
        announce = (endpoints, Redirect(coordinator_node=self.node_id, addr=self.addr,
                                        port=self.standby_port)) if endpoints else None
        if self.coordinator is not None:  # ours at the endpoint, redirecting: newcomers ask it
            self._redirecting = self.coordinator
        room_for_connections(state.max_nodes, self._watching, self._intakes)
        self.coordinator = Coordinator(sock, self._secret, state, takeover, announce)
        self.coordinator.start()

    def _try_to_host(self, endpoint: tuple[str, int]) -> None:
        """Whoever can bind the rendezvous endpoint hosts the coordinator (like torchrun c10d)."""
        try:
            bind_host = "0.0.0.0" if names_this_host(endpoint[0]) else \
                socket.gethostbyname(endpoint[0])
            port = Port(self._context, bind_host, endpoint[1], self._node_timeout,
                        self._secret, self._intakes, small=not self._watching,
                        max_nodes=self._new_state().max_nodes, directory=self._runtime_dir)
        except (zmq.ZMQError, OSError):
            return  # the endpoint is another machine's, or another agent here got it first
        self._host(port, self.new_state_for_host())

    # --- traffic -------------------------------------------------------------------------

    def send(self, msg: Body, epoch: int) -> None:
        self.socket.send_multipart(self.codec.encode(msg, epoch))
        if isinstance(msg, Join):
            self._join = (msg, epoch)

    def receive(self) -> Envelope | None:
        """The next coordinator message, or None for heartbeat acks and dropped messages."""
        try:
            received = self.codec.decode(self.socket.recv_multipart())
        except ProtocolError as e:
            log.warning("dropped control message: %s", e)
            return None
        self.last_heard = time.monotonic()
        self._unheard = self._said_late = False
        self._drop_knocks()
        if isinstance(received.body, (Assign, Spare)):
            # The job's word on who would take over: what we took for lost before (cut off
            # by a partition: everyone) is not (chaos seeds 1301, 1306: a healed spare
            # passed over the live successor and, finding none, failed).
            self.members, self._lost, self._cut_off = received.body.members, set(), set()
            self.spares, self.electorate_epoch = received.body.spares, received.epoch
            self.redirected = False  # the successors we know are the job's coordinator's
            self.earlier = ()
            if isinstance(received.body, Assign):  # it names every one not settled before it
                self.earlier = received.body.earlier
                self.settled_below = min((v.epoch for v in self.earlier),
                                         default=received.epoch)
            self.coordinator_node = received.body.coordinator_node
            self._electorate_host = self.coordinator_node
            self._takeover_due = True  # with our next heartbeat: not on the start's path
            if self._watching and self._watch_endpoint != self._endpoint:
                self._watch(self._endpoint)
        if isinstance(received.body, Redirect):
            self._follow(received.body)
        if isinstance(received.body, HeartbeatAck):
            settled_below = received.body.settled_below  # no successor counts those
            self.earlier = tuple(v for v in self.earlier if v.epoch >= settled_below)
            self.settled_below = max(self.settled_below, settled_below)
            return None
        return received

    def _follow(self, redirect: Redirect) -> None:
        """The job runs under another coordinator: go there."""
        self._reconnect(f"tcp://{redirect.addr}:{redirect.port}")
        self.coordinator_node = redirect.coordinator_node
        self.redirected = True

    def own_redirect(self) -> Envelope | None:
        """The coordinator we host and follow stood down (see Coordinator.stood_down): its
        word reached only the agents that had spoken to it, and ours joins it only once its
        ranks have stopped (a chaos run's healed node then waited at it for good). Taken as
        received, once: we follow it, and no longer our own."""
        word = self.coordinator.redirect if self.coordinator is not None else None
        if word is None or self.coordinator_node != self.node_id:
            return None
        assert isinstance(word.body, Redirect)
        self._follow(word.body)
        return word

    @property
    def connection_lost(self) -> bool:
        """A connection to the coordinator we follow closed (and has not come back)."""
        return bool(self._down)

    def _reconnect(self, endpoint: str) -> None:
        """Follow the coordinator there; the watch follows once it has assigned us (all of
        a large job's agents reconnect at once: their joins first)."""
        self.socket.disconnect(self._endpoint)
        self._endpoint = endpoint
        self._down.clear()
        self._died = False
        self._drop_probe()
        self._connect_by, self._join = None, None
        self.socket.connect(self._endpoint)
        if self._watching:
            self._watch("")

    def _prepare_takeover(self) -> None:
        """Keep our next socket connected to whoever would take over from the coordinator
        (maybe us): the node of the lowest group rank, the coordinator's aside. Done at the
        heartbeat after an assign: a large job's beats are spread over their interval, so
        its thousands of connections to the successor are too."""
        self._takeover_due = False
        successor = membership.successor([m.node_id for m in self.members],
                                         self._lost | {self.coordinator_node})
        entry = next((m for m in self.members if m.node_id == successor), None)
        endpoint = f"tcp://{entry.addr}:{entry.standby_port}" \
            if entry is not None and entry.standby_port else ""
        if endpoint == self._next_endpoint:
            return
        self._drop_next()
        if endpoint:
            self._next, self._next_endpoint = self._dealer(endpoint), endpoint

    def _drop_next(self) -> None:
        if self._next is not None:
            _close(*self._next)
        self._next, self._next_endpoint = None, ""

    def _take_next(self) -> None:
        """Follow the coordinator on our next socket: the old one goes, with its monitor;
        what the next one's monitor saw meanwhile says whether it is connected now."""
        assert self._next is not None
        _close(self.socket, self.monitors[0])
        (self.socket, self.monitors[0]), self._next = self._next, None
        self._endpoint, self._next_endpoint = self._next_endpoint, ""
        self._down.discard(0)
        self._died = False
        self._drop_probe()
        self._connect_by, self._join = None, None
        if self._watching:
            self._watch("")
        self.on_monitor()

    def _watch(self, endpoint: str) -> None:
        """The watch connection to ``endpoint`` ("": none for now)."""
        if self._watch_endpoint:
            self.watch.disconnect(self._watch_endpoint)
        self._watch_endpoint = endpoint
        self._down.discard(1)
        if endpoint:
            self.watch.connect(endpoint)

    def redirect_went_silent(self, now: float) -> bool:
        """Sent to a successor that never answered: gone too (a redirect can be stale)."""
        return self.redirected and not self.knows_successors and (
            self.connection_lost or now - self.last_heard > self._liveness)

    def back_to_rendezvous(self) -> None:
        """Ask at the rendezvous endpoint again: whoever runs the job now is announced there
        (and names who would take over next: what we knew of that is of no use any more)."""
        self.redirected, self._unheard = False, False
        self.members = ()
        self._drop_next()
        self.last_heard = time.monotonic()
        self._reconnect(self._rendezvous)

    def on_monitor(self) -> None:
        """Connection events of our two connections, as they come."""
        for which, monitor in enumerate(self.monitors):
            while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:  # cheaper than zmq.Again
                self.on_connection_event(recv_monitor_message(monitor, zmq.NOBLOCK), which)

    def on_connection_event(self, event: Mapping[str, Any], which: int = 0) -> None:
        """The coordinator we follow went away, or is there (again); events of an endpoint
        we left are not about it."""
        if event["endpoint"].decode(errors="replace") != self._endpoint:
            return
        lost = event["event"] == zmq.EVENT_DISCONNECTED
        now = time.monotonic()
        if lost and now - self._woke_at < self._node_timeout:
            # The coordinator's kernel gave up on us while we were frozen: our socket
            # reconnects; if the coordinator is gone meanwhile, its silence says so.
            log.info("connection to the coordinator closed while this agent was frozen")
            return
        if lost and which == 0 and self._unheard:
            # The successor's connection, closed before it said a word: maybe not its death
            # but a blip (loss, the successor's kernel timing the idle connection out, the
            # word of which was lost: our join then met a reset). ZeroMQ reconnects; the
            # successor gets the node timeout to be reached. Our join goes out again now,
            # queued for the new connection ahead of our next heartbeat: one that came
            # first would find us unknown there, a spare "dropped from the job" (chaos
            # 2-node seed 1616: loss on the successor's node, then the coordinator killed).
            self._connect_by = self._connect_by or time.monotonic() + self._node_timeout
            if self._join is not None:
                self.send(*self._join)
        elif lost and went_silent(now - self.last_heard, self._node_timeout) \
                and (which == 1 or self._watching):
            # The kernel's node timeout: its machine went silent. (In a small job ours also
            # closes when TCP retried a message in vain that long, at heavy loss too: then
            # the probe and the knocks say whether its machine answers, see _silent.)
            self._down.add(which)
        elif lost:  # its process died, or the network ended the connection: ask its machine
            self._probing.add(which)
            if self._probe is None:
                self._probe = Probe(*self._coordinator_at(), self._node_timeout)
            self.on_probe()
        else:
            self._down.discard(which)
            self._probing.discard(which)
            if which == 0:
                self._connect_by = None

    @property
    def probe_fd(self) -> int:
        """The probe's socket, to poll for reading (-1: none under way)."""
        return self._probe.fd if self._probe is not None else -1

    def on_probe(self, now: float | None = None) -> None:
        """The probe of a coordinator whose connection closed while we heard from it has
        answered (or timed out): refused, its process died, acted on at once; else the
        network ended the connection (packet loss) and its silence decides."""
        if self._probe is None or (answer := self._probe.answer(now)) is None:
            return
        if answer is Verdict.DIED:
            self._down |= self._probing
            self._died = True
        else:
            if answer is Verdict.ALIVE:
                self._answered_at = time.monotonic()
            log.warning("connection to the coordinator closed while it was heard from, and "
                        "its machine %s: a network fault, not its death; lost only if it "
                        "goes silent for %gs", no_death(answer), self._liveness)
        self._drop_probe()

    def _coordinator_at(self) -> tuple[str, int]:
        """The literal address and port of the coordinator we follow (see _resolved)."""
        host, _, port = self._endpoint.removeprefix("tcp://").rpartition(":")
        return self._addresses.get(host, host).strip("[]"), int(port)

    def _drop_probe(self) -> None:
        """Whatever probes of the coordinator are under way (its connection's, knocks)."""
        if self._probe is not None:
            self._probe.close()
        self._probe, self._probing = None, set()
        self._drop_knocks()

    def _drop_knocks(self) -> None:
        if self._knocks is not None:
            self._knocks.close()
            self._knocks = None

    def heartbeat_if_due(self, now: float, epoch: int, phase: str = "",
                         ranks: RankStates = ()) -> None:
        """At our epoch: a coordinator that started afresh (its node re-created) learns the
        job's from it, and its answers are then not stale to us. ``phase`` and ``ranks``:
        what this node is doing, for ``ftlaunch status``."""
        if now >= self.next_heartbeat:
            self.send(Heartbeat(node_id=self.node_id, phase=phase, ranks=ranks,
                                electorate_epoch=self.electorate_epoch), epoch)
            self.next_heartbeat = now + self._interval
            if self._takeover_due:
                self._prepare_takeover()

    def woke(self, now: float) -> None:
        """This agent was frozen (SIGSTOP, a VM pause): the silence was ours, not the
        coordinator's. Speak first; if we were dropped meanwhile, it tells us to re-join."""
        self.last_heard = self._answered_at = now
        self.next_heartbeat = now
        self._woke_at = now
        self._down.clear()
        self._died = False
        self._drop_probe()

    @property
    def knows_successors(self) -> bool:
        """An assign or (a spare's) spare said who would take over the coordinator."""
        return bool(self.members)

    def coordinator_lost(self, now: float) -> bool:
        """Its connection closed, or silent past the node timeout, once we know who would
        take over. A coordinator we host is not the one we follow once it redirected us (our
        node came back as the endpoint while the job ran under a successor)."""
        self.on_probe(now)  # one not answered within the node timeout: no word of a death
        follows_own = self.hosting and self.coordinator_node in ("", self.node_id)
        return not follows_own and self.knows_successors and (
            self.connection_lost or self._silent(now)
            or (self._connect_by is not None and now > self._connect_by))

    def _silent(self, now: float) -> bool:
        """Silent past the liveness timeout, its machine not answering (a large job's timeout
        is three of its beats, far past TCP's back-off: it does not knock, and thousands of
        knocks would load a coordinator that only paused)."""
        silence = now - self.last_heard
        if silence > self._liveness / 2 and not self._watching:
            if self._knocks is None:
                self._knocks = Knocks(*self._coordinator_at(), membership.KNOCK * self._liveness,
                                      self._liveness / 2)
            self._answered_at = max(self._answered_at, self._knocks.knock(now))
        if silence <= self._liveness:
            return False
        unanswered = now - max(self._answered_at, self.last_heard)
        if membership.lost_by_silence(silence, unanswered, self._liveness):
            return True
        if not self._said_late:
            self._said_late = True
            log.warning("coordinator silent for %.1fs, but its machine answered %.1fs ago: a "
                        "lossy link, or its agent stalls; lost if silent for %gs", silence,
                        unanswered, 2 * self._liveness)
        return False

    def fail_over(self, epoch: int, restart_count: int, group_world_size: int) -> str | None:
        """Follow the coordinator to its successor (maybe us); returns the successor or None."""
        if not self._died:  # it went silent: maybe cut off, alive (see has_quorum)
            self._cut_off.add(self.coordinator_node)
        self._lost.add(self.coordinator_node)
        by_rank = [m.node_id for m in self.members]
        successor = membership.successor(by_rank, self._lost)
        if successor is None:
            return None
        entry = next(m for m in self.members if m.node_id == successor)
        if successor == self.node_id and self.standby is None and self.coordinator is not None \
                and self.coordinator.stood_down:  # we took over once, from inside a partition
            standby, self.coordinator = self.coordinator.release(), None
            assert isinstance(standby, Port)  # a successor's: hosted on our standby
            self.standby = standby
        if successor == self.node_id and self.standby is not None:
            state = self.new_state_for_host()
            state.epoch, state.restart_count = epoch, restart_count
            # Some survivors are not listed by name; lost nodes of earlier rounds are not
            # counted in group_world_size any more.
            state.expected_count = group_world_size - sum(m.node_id in self._lost
                                                          for m in self.members)
            # The quorum (membership.has_quorum): the last round's nodes and its spares; the
            # coordinators we lost among them that died train nowhere, one gone silent may
            # on the other side.
            named = {m.node_id for m in self.members}
            state.voters = named | {spare.node_id for spare in self.spares}
            state.electorate = group_world_size + len(self.spares)
            state.electorate_epoch = epoch
            state.gone = (self._lost - self._cut_off) & named
            state.wins_tie = not self._cut_off & named
            # An electorate before it that most had not learnt better of when our assign
            # came: a node cut off unassigned may count by it (see membership.settled), so we
            # need a quorum of it too, until most of it say they learnt better; we and the
            # coordinator whose assign it was have.
            state.earlier = membership.from_named(self.earlier)
            state.learnt = {node: self.electorate_epoch
                            for node in (self.node_id, self._electorate_host) if node}
            now = time.monotonic()
            for rank, (node, _, port) in enumerate(self.members):
                if node in self._lost:
                    continue
                state.group_ranks[node] = rank
                state.standby_ports[node] = port
                state.last_seen[node] = now
            silent = tuple(f"tcp://{m.addr}:{m.standby_port}" for m in self.members
                           if m.node_id in self._cut_off and m.standby_port)
            self._host(self.standby, state, f"coordinator node {self.coordinator_node} lost",
                       silent)
            self.standby = None
        endpoint = f"tcp://{entry.addr}:{entry.standby_port}"
        self._unheard = True
        if endpoint == self._next_endpoint:
            self._take_next()
        else:
            self._reconnect(endpoint)
        self.coordinator_node = successor
        self.last_heard = time.monotonic()
        return successor

    def close(self) -> None:
        """Hosting, wait (up to the node timeout) until the job no longer needs us: a node
        leaving by a signal tells the others to go on once their ranks have stopped, and
        without that word they would wait the node timeout to find us gone. The standby
        socket closes first: the coordinator probes it when our connection closes (see
        peer_probe), and must find it refused, not greeted by an agent on its way out."""
        if self.standby is not None:
            self.standby.close(linger=0)
            self.standby = None
        for sock, monitor in zip((self.socket, self.watch), self.monitors, strict=True):
            _close(sock, monitor)
        self._drop_next()
        self._drop_probe()
        if self.coordinator is not None:
            self.coordinator.wait_handed_over(self._node_timeout)
            self.coordinator.close()
        if self._redirecting is not None:
            self._redirecting.close()


_CONNECTION_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED


def _resolved(host: str) -> str:
    """``host``'s address, looked up now, while the network is fine (a probe must not wait
    for DNS when it is not); the name itself if that fails."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _close(sock: zmq.Socket, monitor: zmq.Socket) -> None:
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close(linger=0)
