"""Environment variables an agent sets for its ranks (beyond torchrun's), read by the shim."""

RUN_ID = "FTLAUNCH_RUN_ID"
"""Set for every rank an agent starts: the shim is managed (else every call is a no-op)."""

HUB = "FTLAUNCH_HUB"
"""The agent's node-local hub (``ipc://`` endpoint) for heartbeats, sections and commands."""

STAGING = "FTLAUNCH_STAGING"
"""The agent's staging directory in shared memory (see staging.py)."""

RESUME_STEP = "FTLAUNCH_RESUME_STEP"
"""The newest checkpoint step every rank had made durable when this attempt started."""

ROUND = "FTLAUNCH_ROUND"
"""The rendezvous round (job epoch) this attempt's ranks were started in: every save is
stamped with it, so shards of one step number from different histories are told apart."""

STACK_SIGNAL = "FTLAUNCH_STACK_SIGNAL"
STACKS_FILE = "FTLAUNCH_STACKS_FILE"
"""The signal on which a rank writes all its threads' stacks, and the file it writes them to."""
