"""Every message between agents and their coordinator, and between a rank and its agent: one
frozen dataclass per type. The field annotations are the schema: ``protocol`` derives from
them what it checks on the wire (docs/protocol.md lists the same)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar, NamedTuple


class Successor(NamedTuple):
    """A node that may take over the coordinator: an assign lists them by group rank."""

    node_id: str
    addr: str
    standby_port: int


class Peer(NamedTuple):
    """A node's checkpoint replica service (``launcher/replica_service.py``)."""

    node_id: str
    addr: str
    port: int


class Held(NamedTuple):
    """A whole copy of one rank's shard of one step in some node's shared memory."""

    world_size: int  # of the world that saved it
    rank: int
    step: int


class HeldRun(NamedTuple):
    """Whole copies of ranks ``first_rank`` .. ``first_rank + ranks - 1``'s shards of one
    step in some node's shared memory. A join says what its node holds in runs: a node
    keeps its own ranks' shards and its predecessors' copies, a few runs of consecutive
    ranks, not a record a shard (at 16,384 nodes of 8: 32,768 runs against 262,144)."""

    world_size: int  # of the world that saved it
    step: int
    first_rank: int
    ranks: int  # how many (not ``count``: a tuple's method)


class EarlierVoter(NamedTuple):
    """A voter of an earlier electorate that most of its voters have not yet said they
    learnt a later one of (see has_quorum, settled): one row per voter, so a successor
    counts it too, as its predecessor did."""

    epoch: int  # the electorate's: of the round whose nodes and spares it is
    size: int
    node_id: str
    gone: bool  # known to train nowhere


class Fetch(NamedTuple):
    """Pull this shard from that peer before the ranks start (they restore from memory)."""

    world_size: int
    rank: int
    step: int
    node_id: str
    addr: str
    port: int


class RankState(NamedTuple):
    """What one rank of a node is doing, as its agent knows it (for ``ftlaunch status``)."""

    rank: int
    step: int  # the highest it reported; -1: none
    beat_age_ms: int  # since its last heartbeat; -1: none yet


class NodeState(NamedTuple):
    node_id: str
    group_rank: int  # -1: not in the current round (joining, a spare)
    phase: str  # the agent's (launcher/node_policy.py Phase)
    seen_ms_ago: int  # since the coordinator last heard from it


class NodeRankState(NamedTuple):
    node_id: str
    rank: int
    step: int
    beat_age_ms: int


Successors = tuple[Successor, ...]
EarlierVoters = tuple[EarlierVoter, ...]
Peers = tuple[Peer, ...]
HeldRuns = tuple[HeldRun, ...]
Fetches = tuple[Fetch, ...]
RankStates = tuple[RankState, ...]
NodeStates = tuple[NodeState, ...]
NodeRankStates = tuple[NodeRankState, ...]
Epochs = tuple[int, ...]
ROWS: dict[Any, type[tuple[Any, ...]]] = {Successors: Successor, EarlierVoters: EarlierVoter,
                                          Peers: Peer,
                                          HeldRuns: HeldRun, Fetches: Fetch,
                                          RankStates: RankState, NodeStates: NodeState,
                                          NodeRankStates: NodeRankState}
"""Fields that are lists of records: on the wire, lists of lists."""
Env = dict[str, str]


@dataclass(frozen=True, kw_only=True)
class Body:
    """A message; ``TYPE`` is its name on the wire."""

    TYPE: ClassVar[str]

    def payload(self) -> dict[str, Any]:
        """The fields as they go on the wire, beside the envelope's."""
        names = _FIELD_NAMES.get(type(self))
        if names is None:  # dataclasses.fields() costs more than the rest of an encode
            names = _FIELD_NAMES[type(self)] = tuple(f.name for f in fields(self))
        return {name: getattr(self, name) for name in names}


_FIELD_NAMES: dict[type[Body], tuple[str, ...]] = {}


# --- agent -> coordinator -------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Join(Body):
    TYPE = "join"
    node_id: str
    local_world_size: int
    addr: str
    standby_port: int
    rank_hint: int
    replica_port: int  # 0: keeps no replicas
    held: HeldRuns  # checkpoint shards whole in this node's memory
    restart_count: int  # the job's, as this agent knows it: a fresh coordinator takes the max
    seated_epoch: int  # the epoch of the round this node last held a seat in; -1: none yet
    # Its group rank in that round (-1: none): a successor, which knows 16 by name, keeps
    # every survivor's seat, so that ranks do not move and restore from their own memory.
    group_rank: int
    # Those before it since settled_below: a successor counts a large earlier round by them.
    seated_earlier: Epochs
    # Every electorate of an epoch before it is settled, as its coordinator told this node
    # (its assign's earlier rows, its heartbeat acks): a successor counts none of those.
    settled_below: int
    electorate_epoch: int  # see Heartbeat


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Body):
    TYPE = "heartbeat"
    node_id: str
    phase: str  # what the node is doing, and its ranks: the coordinator's picture of the job
    ranks: RankStates
    # The epoch of the assign (or spare word) whose members and spares this node follows:
    # it has learnt that round's electorate (see membership.settled); -1: none yet.
    electorate_epoch: int


@dataclass(frozen=True, kw_only=True)
class StatusQuery(Body):
    """``ftlaunch status`` (any process holding the job secret) asks the coordinator."""

    TYPE = "status_query"


@dataclass(frozen=True, kw_only=True)
class StoreReady(Body):
    TYPE = "store_ready"
    master_addr: str
    master_port: int


@dataclass(frozen=True, kw_only=True)
class Failure(Body):
    TYPE = "failure"
    node_id: str
    rank: int
    local_rank: int
    exit_code: int | None  # None: killed by a signal
    signal: str
    cause: str
    step: int  # the highest step the node's ranks reported (-1: none)


@dataclass(frozen=True, kw_only=True)
class Finished(Body):
    TYPE = "finished"
    node_id: str


@dataclass(frozen=True, kw_only=True)
class Durable(Body):
    """A rank's checkpoint shard is durable (relayed by its agent)."""

    TYPE = "durable"
    node_id: str
    rank: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Replicated(Body):
    """This node now holds a whole copy of a peer's rank's shard of ``step`` in memory."""

    TYPE = "replicated"
    node_id: str
    rank: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Leave(Body):
    """This node ends the job (a signal, or an unhealthy single node)."""

    TYPE = "leave"
    node_id: str
    exit_code: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class Unhealthy(Body):
    """Exclude this node; the job goes on without it."""

    TYPE = "unhealthy"
    node_id: str
    reason: str


# --- coordinator -> agent -------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class HeartbeatAck(Body):
    TYPE = "heartbeat_ack"
    # Every electorate of an epoch before this one is settled (see Assign): the oldest
    # earlier one not settled yet, else the coordinator's own electorate's epoch.
    settled_below: int


@dataclass(frozen=True, kw_only=True)
class Assign(Body):
    TYPE = "assign"
    group_rank: int
    group_world_size: int
    rank_offset: int
    world_size: int
    restart_count: int
    max_restarts: int
    members: Successors
    spares: Successors  # the round's idle spares: they vote on the next (see has_quorum)
    earlier: EarlierVoters  # earlier electorates not yet settled (a larger one: one unnamed row)
    coordinator_node: str
    replicate_to: Peers  # who keeps copies of this node's staged shards
    fetch: Fetches  # what to pull from peers' memory before the ranks start
    SEAT: ClassVar[tuple[str, ...]] = ("group_rank", "rank_offset", "replicate_to", "fetch")
    """The fields that differ between a round's assigns (Codec.encode_each)."""


@dataclass(frozen=True, kw_only=True)
class Start(Body):
    TYPE = "start"
    master_addr: str
    master_port: int
    restart_count: int


@dataclass(frozen=True, kw_only=True)
class Recover(Body):
    TYPE = "recover"
    policy: str
    restart_count: int
    delay: float
    cause: str


@dataclass(frozen=True, kw_only=True)
class Stop(Body):
    TYPE = "stop"
    exit_code: int
    reason: str


@dataclass(frozen=True, kw_only=True)
class JobStatus(Body):
    """The coordinator's picture of the job, in answer to a ``status_query``."""

    TYPE = "job_status"
    run_id: str
    coordinator_node: str
    round_phase: str
    job_epoch: int
    restart_count: int
    max_restarts: int
    min_nodes: int
    max_nodes: int
    committed_step: int  # -1: none yet
    last_cause: str  # of the latest recovery; "" before any
    final: str  # "" while the job runs
    nodes: NodeStates
    ranks: NodeRankStates


@dataclass(frozen=True, kw_only=True)
class Redirect(Body):
    """The job's coordinator is elsewhere: a successor took over while the node at the
    rendezvous endpoint was gone (a re-created pod 0). Sent by that successor to the
    endpoint, and by a coordinator that never formed a round there to its agents. The
    endpoint's coordinator still running the job answers a node it lost that took over
    from inside a partition with one naming itself (addr "", port 0: where you announce)."""

    TYPE = "redirect"
    coordinator_node: str
    addr: str
    port: int


@dataclass(frozen=True, kw_only=True)
class Spare(Body):
    """The job runs on its maximum of nodes: wait as a spare for the next round. Sent on
    a spare's join and with every round, so that it knows whom to follow should the
    coordinator's node be lost (as an assign tells the job's nodes)."""

    TYPE = "spare"
    coordinator_node: str
    members: Successors
    spares: Successors  # as in an assign


@dataclass(frozen=True, kw_only=True)
class Committed(Body):
    """Every rank's shard of ``step`` is durable (coordinator -> agents -> their ranks)."""

    TYPE = "committed"
    step: int


@dataclass(frozen=True, kw_only=True)
class InMemory(Body):
    """Every rank's shard of ``step`` has a copy in another node's memory: losing any one
    node, the job restores ``step`` without storage (coordinator -> agents)."""

    TYPE = "in_memory"
    step: int


# --- rank (trainer_shim) -> its agent, over the node-local socket ---------------------------

@dataclass(frozen=True, kw_only=True)
class Hello(Body):
    """From the shim's command socket; ``stacks``: it armed faulthandler on the agent's signal."""

    TYPE = "hello"
    pid: int
    stacks: bool


@dataclass(frozen=True, kw_only=True)
class Restartable(Body):
    """The rank runs inside ``trainer_shim.restartable``: it can re-enter in place."""

    TYPE = "restartable"
    pid: int


@dataclass(frozen=True, kw_only=True)
class Beat(Body):
    TYPE = "beat"
    pid: int
    step: int


@dataclass(frozen=True, kw_only=True)
class Tick(Body):
    """From the shim's own thread: the process runs, whatever training does."""

    TYPE = "tick"
    pid: int
    sent: float  # its time.monotonic() (one clock per host)


@dataclass(frozen=True, kw_only=True)
class Leaving(Body):
    """From the shim at exit: its training is over, no heartbeat comes any more; what is
    left (closing checkpoints, the interpreter's shutdown) is no hang."""

    TYPE = "leaving"
    pid: int


@dataclass(frozen=True, kw_only=True)
class Learned(Body):
    """The longest heartbeat interval, restored from a checkpoint."""

    TYPE = "learned"
    pid: int
    interval: float


@dataclass(frozen=True, kw_only=True)
class Section(Body):
    TYPE = "section"
    pid: int
    name: str
    open: bool


@dataclass(frozen=True, kw_only=True)
class Parked(Body):
    """Left the training function (``error``: its own traceback, "" after an abort)."""

    TYPE = "parked"
    pid: int
    error: str
    step: int  # the highest step it reached (its last heartbeat's may have been throttled)
    sent: float  # its time.monotonic(): parked ranks read together are taken in this order


@dataclass(frozen=True, kw_only=True)
class Entered(Body):
    """The training thread entered the training function (again, after a resume)."""

    TYPE = "entered"
    pid: int


@dataclass(frozen=True, kw_only=True)
class Stuck(Body):
    """Told to leave, the thread running the training function has been blocked in one
    native call since, burning no CPU (a collective waiting for a rank that is gone or
    parked: gloo's cannot be interrupted): it will not park, replace it now."""

    TYPE = "stuck"
    pid: int
    where: str  # the innermost Python frame it is blocked under


@dataclass(frozen=True, kw_only=True)
class ShardDurable(Body):
    """Its checkpoint writer made its shard of ``step`` durable."""

    TYPE = "durable"
    pid: int
    rank: int
    step: int
    seconds: float  # since its save began: the time to durable (-1: unknown)


@dataclass(frozen=True, kw_only=True)
class ShardStaged(Body):
    """Its shard of ``step`` is whole in staging: the agent copies it to peers."""

    TYPE = "staged"
    pid: int
    rank: int
    step: int
    seconds: float  # since its save began: how long the save blocked training


# --- agent -> its ranks ---------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Abort(Body):
    """Leave the training function (raises RestartRequested there)."""

    TYPE = "abort"


@dataclass(frozen=True, kw_only=True)
class Resume(Body):
    """Re-enter with this environment (the next attempt's)."""

    TYPE = "resume"
    env: Env


CONTROL: dict[str, type[Body]] = {m.TYPE: m for m in (
    Join, Heartbeat, StoreReady, Failure, Finished, Durable, Replicated, Leave, Unhealthy,
    HeartbeatAck, Assign, Start, Recover, Stop, Redirect, Spare, Committed, InMemory,
    StatusQuery, JobStatus)}
LOCAL: dict[str, type[Body]] = {m.TYPE: m for m in (
    Hello, Restartable, Beat, Tick, Leaving, Learned, Section, Parked, Entered, Stuck, ShardDurable,
    ShardStaged, Abort, Resume, Committed)}
