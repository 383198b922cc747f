"""Which checkpoint step is committed: a pure record of the durable reports agents relay.
(The coordinator keeps a second one of the copies peers hold in memory: the newest step
every rank has a peer copy of.)

Each rank's checkpoint writer reports every shard it made durable; its agent relays the
report to the coordinator, which announces a step once every rank of the world holds it
durable. The storage stays the arbiter (a step is loadable once every rank's meta is
there); this is how the job learns it without listing storage: the committed step is
logged as an event and told to every rank (``AsyncCheckpointer.latest_step``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

REMEMBERED = 16
"""Steps remembered per rank: ranks a few saves apart still meet in the intersection."""


@dataclass
class CommitLog:
    world_size: int
    durable: dict[int, list[int]] = field(default_factory=dict)  # rank -> recent steps
    committed: int = -1

    def report(self, rank: int, step: int) -> int | None:
        """Rank ``rank``'s shard of ``step`` is durable; returns a newly committed step."""
        if not 0 <= rank < self.world_size or step <= self.committed:
            return None
        steps = self.durable.setdefault(rank, [])
        if step not in steps:
            steps.append(step)
            steps.sort()
            del steps[:-REMEMBERED]
        if len(self.durable) < self.world_size:
            return None
        common = set.intersection(*(set(s) for s in self.durable.values()))
        newest = max((s for s in common if s > self.committed), default=None)
        if newest is not None:
            self.committed = newest
        return newest
