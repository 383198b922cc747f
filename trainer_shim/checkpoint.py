"""Asynchronous checkpoints: ``save`` blocks only to copy tensors into staging memory.

Each save is copied into staging (ftlaunch_contract/staging.py: shared memory the agent owns,
so it survives this process) and then persisted in the background by a writer thread in
the format of ftlaunch_contract/shards.py, to a directory or an S3 prefix. A step is committed
once every rank's shard is durable. ``load_latest`` loads the newest step *every* rank
holds, in staging or committed on storage (the ranks agree through one small collective),
verifies checksums of what comes from storage and falls back past a damaged step; a
replacement rank on the same node restores from shared memory without touching storage.

With ``overlap=True`` the copy itself runs beside training: ``save`` returns once it has
taken the state's structure, and the optimizer's next ``step`` waits for the copy (a
pre-step hook), the one place the saved tensors change in a training loop.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import mmap
import os
import queue
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from ftlaunch_contract import environment, reshard, shards
from ftlaunch_contract.messages import ShardDurable, ShardStaged
from ftlaunch_contract.parallel import Parallel
from ftlaunch_contract.reshard import Box
from ftlaunch_contract.staging import SLOTS, Slot, StagingFull, read_meta
from ftlaunch_contract.storage import open_storage
from trainer_shim import collective, shutdown
from trainer_shim.collective import all_reduce_int

log = logging.getLogger("trainer_shim.checkpoint")

COPY_THREADS = 4  # staging copies at once, at most (and no more than our cores)
COPY_PIECE = 32 << 20  # bytes per staging copy
PARALLEL_COPY_MIN = 64 << 20  # a smaller state is copied by the caller's thread alone


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which and why."""


class AsyncCheckpointer:
    """Save and restore one rank's state; see the module docstring.

    ``persist_every``: persist only saves whose step is a multiple of it (the others are
    staged only: a restart on the same node still resumes from them, and the agent persists
    the newest one if the job ends). ``keep_last`` committed steps are kept, plus every
    multiple of ``keep_every``.
    """

    def __init__(self, uri: str | os.PathLike, *, rank: int | None = None,
                 world_size: int | None = None, keep_last: int = 3, keep_every: int = 0,
                 persist_every: int = 1, staging_dir: str | None = None,
                 overlap: bool = False):
        text = os.fspath(uri)
        self.uri = text if text.startswith("s3://") else os.path.abspath(text)
        self.storage = open_storage(self.uri)
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        if persist_every < 1 or keep_last < 0 or keep_every < 0:
            raise CheckpointError("persist_every must be >= 1, keep_last and keep_every >= 0")
        self.keep_last, self.keep_every, self.persist_every = keep_last, keep_every, persist_every
        self.overlap = overlap
        self._in_flight: _InFlight | None = None  # overlap: a save being copied
        self._waited = 0.0  # overlap: seconds optimizer steps waited for copies, unreported
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        if _COPIER is not None:  # a checkpointer of an attempt left in place may still copy
            _COPIER.drain()       # into the slots we are about to open
        directory = staging_dir or os.environ.get(environment.STAGING)
        self._staging = Path(directory) if directory else None  # None: anonymous slots
        self._slots = [Slot(directory, self.rank, k) for k in range(SLOTS)]
        for slot in self._slots:
            slot.open_existing()
        self._busy: list[threading.Event | None] = [None] * SLOTS  # set when persisted
        staged = self.staged_steps()
        self._next_slot = staged[max(staged)] ^ 1 if staged else 0
        self._writer: threading.Thread | None = None
        self._sizer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.restored_from = "nothing"  # by load_latest: "shared memory" or "storage"
        self.restored_bytes: dict[str, int] = {}  # by load_latest: bytes read, by source
        self._mapped: list[tuple[Path, dict[str, Any], Any]] = []  # during load_latest
        this = weakref.ref(self)  # a script that never calls close() still gets its saves

        def close_if_alive() -> None:
            checkpointer = this()
            if checkpointer is not None:
                checkpointer.close()
        shutdown.at_exit(close_if_alive)

    # --- saving --------------------------------------------------------------------------

    def save(self, step: int, **state: Any) -> None:
        """Stage a copy of ``state`` (returns then; with ``overlap``, once the copy is
        queued) and persist it in the background."""
        began = time.monotonic()
        self._finish_copy()
        self._raise_writer_error()
        tensors: list[torch.Tensor] = []
        tree = _encode({k: _state_of(v) for k, v in state.items()}, tensors, _dtensor_type())
        index = self._next_slot
        self._next_slot ^= 1
        busy = self._busy[index]
        if busy is not None:
            busy.wait()  # the writer still persists this slot's previous save
        slot = self._slots[index]
        sizes = [t.nbytes for t in tensors]
        try:
            slot.ensure(sum(map(_aligned, sizes)))
        except StagingFull as e:
            raise CheckpointError(f"step {step} not saved: {e.strerror}") from None
        optimizers = _optimizers(state.values()) if self.overlap else []
        versions = _versions(tensors) if optimizers else None
        if versions is not None:
            for optimizer in optimizers:
                if optimizer not in self._hooked:
                    optimizer.register_step_pre_hook(_finish_copy_hook(self))
                    self._hooked.add(optimizer)
            # The stall it reports: this call, and what an optimizer step waited for the last
            # copy (the agent hears of a save as soon as it is sealed, while training runs).
            flight = _InFlight(index, began, versions, time.monotonic() - began + self._waited)
            self._waited = 0.0
            _copier().copy(lambda: self._copy(slot, step, tree, tensors, sizes, flight), flight)
            self._in_flight = flight
        else:
            meta = self._copy(slot, step, tree, tensors, sizes)
            self._staged(index, meta, time.monotonic() - began, began)

    def _copy(self, slot: Slot, step: int, tree: Any, tensors: list[torch.Tensor],
              sizes: list[int], flight: _InFlight | None = None) -> dict[str, Any]:
        """Copy the tensors into ``slot`` and seal it (in the caller's thread, or the
        copier's, which then also tells the agent): from then on it survives this process."""
        slot.invalidate()  # (growing it kept the previous save whole until now)
        entries = _stage(slot, tensors, sizes)
        if flight is not None and flight.versions != _versions(tensors):
            changed = next(i for i, t in enumerate(tensors) if t._version != flight.versions[i])
            raise CheckpointError(
                f"step {step} not saved: its tensor #{changed} was changed while it was being "
                "copied (overlap=True lets the state change only in its optimizer's step); "
                "save with overlap=False")
        meta = {"step": step, "rank": self.rank, "world_size": self.world_size,
                "save_id": os.urandom(8).hex(),  # tells this save from another of the step
                "history": _history(),
                "dest": self.uri, "tree": tree, "tensors": entries,
                "nbytes": entries[-1]["offset"] + entries[-1]["nbytes"] if entries else 0}
        slot.seal(meta)
        if flight is not None:
            self._staged(flight.index, meta, flight.stall, flight.began)
        return meta

    def _staged(self, index: int, meta: dict[str, Any], stall: float, began: float) -> None:
        """A save is sealed: the agent copies it to a peer's memory (``stall``: how long
        training waited for it), the writer persists it if due."""
        _tell_agent(ShardStaged, self.rank, meta["step"], stall)
        if meta["step"] % self.persist_every == 0:
            self._persist_in_background(index, meta, began)
        buffer = self._slots[index].buffer
        if self._slots[index ^ 1].buffer is None and self._busy[index ^ 1] is None:
            assert buffer is not None  # ensured by the save
            self._size_in_background(index ^ 1, len(buffer))

    def _finish_copy(self) -> None:
        """Wait for an overlapped save's copy (before anything reads the slots or changes
        the state); its error, if any, is raised as a writer's is."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        waited = time.monotonic()
        flight.done.wait()
        self._waited += time.monotonic() - waited
        if flight.error is not None:
            self._error = self._error or flight.error

    def reserve(self, **state: Any) -> threading.Event:
        """Size both staging slots for saves of ``state`` in the background (``load_latest``
        does it for the state it restores): the first save then only copies, instead of
        also allocating and mapping staging memory. Returns an event set once done."""
        self._finish_copy()
        tensors: list[torch.Tensor] = []
        _encode({k: _state_of(v) for k, v in state.items()}, tensors, _dtensor_type())
        nbytes = sum(_aligned(t.numel() * t.element_size()) for t in tensors)
        for index, slot in enumerate(self._slots):
            busy = self._busy[index]
            if (busy is None or busy.is_set()) and (slot.buffer is None
                                                     or len(slot.buffer) < nbytes):
                self._size_in_background(index, nbytes)
        done, waits = threading.Event(), [b for b in self._busy if b is not None]

        def when_reserved() -> None:
            for busy in waits:
                busy.wait()
            done.set()
        threading.Thread(target=when_reserved, name="ftlaunch-ckpt-reserved", daemon=True).start()
        return done

    def wait(self) -> None:
        """Block until every save so far is durable; raises the writer's error if any."""
        self._finish_copy()
        if self._writer is not None:
            self._writer.join()
        self._raise_writer_error()

    def close(self) -> None:
        """Finish every save (durable, or its error raised) and join the background threads;
        run at exit too, so no thread of ours outlives the interpreter."""
        self.wait()
        if self._sizer is not None:
            self._sizer.join()
        for slot in self._slots:
            slot.close()

    def _persist_in_background(self, index: int, meta: dict[str, Any],
                               began: float | None = None) -> None:
        """``began``: when the save started (its time to durable is reported from it)."""
        self._busy[index] = busy = threading.Event()
        previous = self._writer
        self._writer = threading.Thread(target=self._persist,
                                        args=(index, meta, busy, previous, began),
                                        name="ftlaunch-ckpt-writer", daemon=True)
        self._writer.start()

    def _size_in_background(self, index: int, nbytes: int) -> None:
        """Allocate and map a slot off the training path: the first save into it then
        blocks only for the copy, like every later one. Sizings run one after another."""
        self._busy[index] = ready = threading.Event()
        previous = self._sizer

        def size() -> None:
            try:
                if previous is not None:
                    previous.join()
                self._slots[index].ensure(nbytes)
            except OSError:
                pass  # no room: the save into it reports that, clearly
            finally:
                ready.set()

        self._sizer = threading.Thread(target=size, name="ftlaunch-ckpt-size", daemon=True)
        self._sizer.start()

    def _persist(self, index, meta, busy, previous, began) -> None:
        try:
            if previous is not None:
                previous.join()  # steps become durable in order
            view = memoryview(self._slots[index].buffer)[:meta["nbytes"]]
            try:
                shards.persist(self.storage, meta, view)
            finally:
                view.release()
            _tell_agent(ShardDurable, meta["rank"], meta["step"],
                        -1.0 if began is None else time.monotonic() - began)
            if self.rank == 0:
                shards.retire(self.storage, self.world_size, self.keep_last, self.keep_every)
        except BaseException as e:  # surfaced by the next save() or wait()
            self._error = e
        finally:
            busy.set()

    def _raise_writer_error(self) -> None:
        """A failed write stops training (the script decides what next), except a full
        storage: the step stays staged in this node's memory (restorable, persisted at exit
        if there is room then), later saves try again, and training goes on."""
        if isinstance(self._error, OSError) and self._error.errno in (errno.ENOSPC, errno.EDQUOT):
            log.warning("checkpoint storage %s is full: a step was not made durable (it stays "
                        "in this node's memory); training goes on and the next save tries "
                        "again. Free space at %s.", self.uri, self.uri)
            self._error = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"saving a checkpoint to {self.uri} failed: {error}; "
                                  "training went on, the previous committed step stands") \
                from error

    # --- loading -------------------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """Steps whose every rank's shard is durable, oldest first."""
        try:
            return shards.committed_steps(self.storage, self.world_size)
        except OSError as e:
            raise CheckpointError(f"cannot list checkpoints in {self.uri}: {e}") from None

    def staged_steps(self) -> dict[int, int]:
        """Steps this rank holds whole in staging (a previous process's too) -> slot."""
        self._finish_copy()
        held = {}
        for index, slot in enumerate(self._slots):
            meta = slot.meta()
            if (meta and meta.get("dest") == self.uri and meta.get("rank") == self.rank
                    and meta.get("world_size") == self.world_size and slot.buffer is not None):
                held[meta["step"]] = index
        return held

    def _memory(self) -> dict[tuple[int, int, int], tuple[Path, dict[str, Any]]]:
        """Shards of this checkpoint whole in this node's shared memory, whichever rank and
        world saved them: the node's staging slots, and the copies its agent keeps for peers
        or pulled from them for this restore -> (meta path, meta), by (world, rank, step).
        This rank's own copies of another save than storage holds for their step are left
        out (they would be steps to agree on); any other is checked once it is read from
        (``_held``): each of a node's ranks checking each of its ~32 copies against storage
        was 4 M requests to an object store at 16,384 nodes, for each restore."""
        if self._staging is None:
            return {}
        found = {}
        for path in [*self._staging.glob("replicas/rank_*.*.meta"),  # staging's own win
                     *self._staging.glob("rank_*.*.meta")]:
            meta = read_meta(path)
            if meta is not None and meta.get("dest") == self.uri and (
                    not self._mine(meta) or self._same_save_as_stored(
                        meta["step"], meta["rank"], meta.get("save_id"))):
                found[(meta["world_size"], meta["rank"], meta["step"])] = (path, meta)
        return found

    def _mine(self, meta: dict[str, Any]) -> bool:
        return meta.get("world_size") == self.world_size and meta.get("rank") == self.rank

    def _held(self, memory: dict, key: tuple[int, int, int]) -> tuple[Path, dict[str, Any]] | None:
        """A copy in this node's memory to read from, if it holds one of the save storage
        holds (this rank's own were checked by _memory)."""
        found = memory.get(key)
        if found is None or self._mine(found[1]) or self._same_save_as_stored(
                key[2], key[1], found[1].get("save_id")):
            return found
        return None

    def _same_save_as_stored(self, step: int, rank: int, save_id: Any) -> bool:
        """Whether a copy in memory is the save that storage holds for its step, if storage
        holds one: a copy staged before the job went back to an older step (a node lost,
        the world resized) is of another history, even under the same step number."""
        try:
            stored = shards.read_meta(self.storage, step, rank)
        except shards.ShardError:
            return True  # not persisted (yet): agreement among the ranks decides
        return stored.get("save_id") == save_id

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def load_latest(self, **state: Any) -> int:
        """Load the newest step every rank holds into ``state``'s objects; returns the step
        (0 when there is none). With torch.distributed initialized the ranks agree on it
        and each verifies its own shard; without, every rank verifies every shard.
        A shard is read from this node's memory when it is there (its own staging, a
        peer's copy), else from storage; a step saved by another world size is resharded."""
        self._finish_copy()  # it changes the state's tensors
        group = _group(self.world_size)
        worlds = self._committed_worlds(group)  # steps of other world sizes are resharded
        durable = sorted(worlds)  # none of them readable: an error, not a start from step 0
        failed = ""
        memory = self._memory()
        staged = {step: slot for step, slot in self.staged_steps().items()
                  if memory.get((self.world_size, self.rank, step), (None,))[0]
                  == self._slots[slot].meta_path}
        own = {s for (w, r, s) in memory if w == self.world_size and r == self.rank}
        for whole, world in _whole_in_memory(memory).items():
            worlds.setdefault(whole, world)  # a resized world restores from memory too
        candidates = set(worlds)
        if group or self.world_size == 1:
            candidates |= set(staged) | own  # only agreement makes a staged-only step safe
        while True:
            step = _agree(candidates) if group else max(candidates, default=None)
            if step is None:
                if durable:  # all ranks alike: they tried the same steps, and agreed on each
                    raise CheckpointError(
                        f"committed steps {durable} in {self.uri} exist but none could be "
                        f"restored ({failed or 'see the warnings above'}): not training from "
                        "step 0 over them; repair or move them, or checkpoint elsewhere")
                self._reserve_quietly(state)
                return 0
            same = step in staged or step in own
            saved_world = self.world_size if same else worlds[step]
            sources: dict[str, int] = {}  # where shards were read from -> bytes or shards
            currents: dict[str, Any] = {}
            try:
                if step in staged:
                    loaded = self._read_staged(step, staged[step])
                    sources["shared memory"] = (self._slots[staged[step]].meta() or {})["nbytes"]
                elif saved_world == self.world_size:
                    loaded = self._read(step, memory, sources, verify_all=not group)
                else:  # read now what each tensor needs, so a bad read falls back for all
                    loaded = _prefetch(self._read_resharded(step, saved_world, memory,
                                                            sources, group),
                                       currents := {k: _current(v) for k, v in state.items()})
            except CheckpointError as e:
                log.warning("%s; falling back to the previous step", e)
                loaded, failed = None, failed or str(e)
            if group and not _all(loaded is not None):
                loaded = None  # some rank could not load it: nobody does
            if group and loaded is not None and saved_world == self.world_size:
                mine = zlib.crc32(str(self._history_of(step, staged.get(step), memory)).encode())
                if all_reduce_int(mine, "min") != all_reduce_int(mine, "max"):
                    log.warning("step %d: its shards come from different saves (a world "
                                "went back before committing it); taking an older one", step)
                    loaded = None
            if loaded is None:
                self._unmap(check=False)
                candidates = {s for s in candidates if s < step}
                continue
            owned = step not in staged and not self._mapped  # else views: copied out
            for name, target in state.items():  # staged views must not outlive this
                current = currents.get(name) if saved_world != self.world_size else None
                _restore(target, loaded.pop(name), owned=owned, current=current)
            del loaded
            self._unmap(check=True)
            self.restored_from = ", ".join(name for name, n in sources.items() if n)
            self.restored_bytes = sources
            if saved_world != self.world_size:
                self.restored_from += f", resharded from {saved_world} ranks"
            if step in staged:
                self._next_slot = staged[step] ^ 1  # keep it until the next save is staged
                if not self.storage.exists(shards.meta_name(step, self.rank)):
                    meta = self._slots[staged[step]].meta()
                    assert meta is not None  # staged: sealed with its meta
                    self._persist_in_background(staged[step], meta)
            self._reserve_quietly(state)
            return step

    def _committed_worlds(self, group: bool) -> dict[int, int]:
        """Every committed step on storage -> the world size that saved it. With the ranks
        in a group only rank 0 lists storage and tells the others: a listing is of every
        step's every shard, and one a rank at 131,072 ranks was ~70 M requests to an object
        store (paged by 1,000 keys) for each restore."""
        steps: dict[int, int] | None = None
        error = ""
        if not group or self.rank == 0:
            try:
                steps = shards.saved_world_sizes(self.storage)
            except OSError as e:
                error = str(e)
        if group:  # [step, world, ...], or [-1]: rank 0 could not list
            told = collective.broadcast_ints(
                [-1] if steps is None else [n for pair in sorted(steps.items()) for n in pair])
            if told == [-1]:
                error = error or "rank 0 could not list them"
            else:
                steps = dict(zip(told[::2], told[1::2], strict=True))
        if error or steps is None:
            raise CheckpointError(f"cannot list checkpoints in {self.uri}: {error}")
        return steps

    def _reserve_quietly(self, state: dict[str, Any]) -> None:
        """Staging for the saves to come, sized from the state just restored (a fresh
        optimizer has no state yet: the first save then grows it)."""
        with contextlib.suppress(CheckpointError):  # what cannot be saved, save() reports
            self.reserve(**state)

    def _unmap(self, check: bool) -> None:
        """Close the shards mapped from memory; ``check``: they were restored from, so each
        must still hold the save it held (a slot is re-sealed before it is reused)."""
        mapped, self._mapped = self._mapped, []
        for path, meta, data in mapped:
            if isinstance(data, mmap.mmap):
                with contextlib.suppress(BufferError):  # a view still alive: unmapped by GC
                    data.close()
            again = read_meta(path) if check else meta
            if again is None or again.get("save_id") != meta.get("save_id"):
                raise CheckpointError(f"rank {meta['rank']}'s step {meta['step']} in shared "
                                      "memory was overwritten while it was restored")

    def _history_of(self, step: int, slot: int | None, memory: dict) -> Any:
        if slot is not None:
            return (self._slots[slot].meta() or {}).get("history")
        if (self.world_size, self.rank, step) in memory:
            return memory[(self.world_size, self.rank, step)][1].get("history")
        try:
            return shards.read_meta(self.storage, step, self.rank).get("history")
        except shards.ShardError:
            return None

    def _read_staged(self, step: int, slot: int) -> dict[str, Any]:
        """This rank's own staged copy: views of staging (``_restore`` copies them out)."""
        meta = self._slots[slot].meta()
        assert meta is not None  # staged: sealed with its meta
        tensors = [_tensor(self._slots[slot].buffer, e) for e in meta["tensors"]]
        log.info("rank %d restored step %d from shared memory", self.rank, step)
        return _decode(meta["tree"], tensors)

    def _shard(self, step: int, world: int, rank: int, memory: dict,
               sources: dict[str, int]) -> tuple[dict[str, Any], Any]:
        """One saved rank's shard: from this node's memory if it holds it (mapped), else
        storage (read, verified against its checksum); ``sources`` counts where each came
        from."""
        if held := self._held(memory, (world, rank, step)):
            path, meta = held
            data = _map_copy(path, meta)
            if data is not None:
                self._mapped.append((path, meta, data))  # checked and closed once restored
                where = f"peer memory (node {meta['replica_from']})" \
                    if meta.get("replica_from") else "shared memory"
                sources[where] = sources.get(where, 0) + meta["nbytes"]
                return meta, data
        try:
            meta, data = shards.read(self.storage, step, rank)
        except shards.ShardError as e:
            raise CheckpointError(str(e)) from None
        sources["storage"] = sources.get("storage", 0) + meta["nbytes"]
        return meta, data

    def _read(self, step: int, memory: dict, sources: dict[str, int],
              verify_all: bool) -> dict[str, Any]:
        for r in range(self.world_size) if verify_all else ():
            if r != self.rank:
                self._shard(step, self.world_size, r, memory, {})
        meta, data = self._shard(step, self.world_size, self.rank, memory, sources)
        log.info("rank %d restored step %d from %s", self.rank, step, ", ".join(sources))
        return _decode(meta["tree"], [_tensor(data, e) for e in meta["tensors"]])

    def _read_resharded(self, step: int, saved_world: int, memory: dict,
                        sources: dict[str, int], group: bool) -> dict[str, Any]:
        """A step saved by another world size: a saved rank's tree (rank ``own``: plain state
        is any rank's), its tensors read lazily (``_Lazy``: only the byte ranges this rank's
        new shards overlap, from memory where this node holds the shard, else storage),
        each sharded tensor given the saved parts a wanted box overlaps (``_Deferred``: a
        saved rank's meta is read once a part of it is needed). Where each saved part sits
        follows from the tensor's saved layout; the ranks check that against the saved
        metas, a share each (every new-world-th from its rank: a rank reading every meta
        was W^2 reads in all, 16.7 M at 4,096 ranks). Tensors saved without a layout have
        every saved part's box gathered instead (W x their number, to every rank)."""
        own = self.rank if self.rank < saved_world else 0
        read: dict[int, _Source] = {}

        def source(r: int) -> _Source:
            if r not in read:
                read[r] = self._source(step, saved_world, r, memory, sources)
            return read[r]
        share = range(self.rank, saved_world, self.world_size) if group else range(saved_world)
        boxes_read, error = [], None
        try:  # no collective may be skipped below: a rank that failed says so in its row
            base = source(own).meta
            save = (base.get("world_size"), base.get("history"), _skeleton(base["tree"]))
            layouts = [shard.layout for shard in _shards_in(_bare(base))]
            fits = all(layout is not None and layout.ranks == saved_world for layout in layouts)
            for r in share:
                meta = source(r).meta
                if (meta.get("world_size"), meta.get("history"), _skeleton(meta["tree"])) != save:
                    raise CheckpointError(f"step {step}: its shards come from different saves "
                                          "or states (cannot reshard them)")
                saved_shards = _shards_in(_bare(meta))
                for shard in saved_shards:
                    if shard.box is not None and shard.box.shape != shard.local:
                        raise CheckpointError(
                            f"step {step}: saved rank {r}'s part of a sharded tensor holds "
                            f"{list(shard.local)} where its saved position says "
                            f"{list(shard.box.shape)} (saved wrong, as FSDP2 over tensor "
                            "parallelism was before 2026-12-07 where the mesh did not divide "
                            f"a dimension): restore it on the {saved_world} ranks that saved it")
                boxes_saved = [shard.box for shard in saved_shards]
                fits = fits and all(box == reshard.box_of(layout, r) for box, layout
                                    in zip(boxes_saved, layouts, strict=True) if layout)
                boxes_read += [r, *_encoded_boxes(boxes_saved)]
            mine = [1, zlib.crc32(repr((save, layouts)).encode()), int(fits)]
        except CheckpointError as e:
            error, mine = e, [0, 0, 0]
        agreed = collective.all_gather_ints(mine) if group else [mine]
        if error is not None:
            raise error
        if not all(row[0] for row in agreed):
            raise CheckpointError(f"step {step}: another rank could not read its share of the "
                                  "saved shards' metas")
        if len({row[1] for row in agreed}) > 1:  # e.g. a shard of a world that went back
            raise CheckpointError(f"step {step}: its shards come from different saves")
        log.info("rank %d restores step %d saved by %d ranks (resharding)", self.rank, step,
                 saved_world)
        decoded: dict[int, list[_Shard]] = {}

        def shards_of(r: int) -> list[_Shard]:  # saved rank r's sharded tensors, not read yet
            if r not in decoded:
                src = source(r)
                decoded[r] = _shards_in(_decode(src.meta["tree"],
                                                [_Lazy(src, e) for e in src.meta["tensors"]]))
            return decoded[r]

        def part(r: int, k: int, box: Box, shard: _Shard) -> tuple[Box, Any]:
            return box, shard.local if r == own else _Deferred(shards_of, r, k, box)
        leaves = iter(range(len(layouts)))
        if all(row[2] for row in agreed):  # every saved part where its layout says

            def parts(shard: _Shard) -> _Shard:
                k, layout = next(leaves), shard.layout
                assert layout is not None
                return replace(shard, parts=lambda wanted: [
                    part(r, k, reshard.box_of(layout, r), shard)
                    for r in reshard.ranks_over(layout, wanted, prefer=own)])
        else:
            rows = collective.all_gather_ints(boxes_read) if group else [boxes_read]
            boxes = _decoded_boxes(rows, saved_world)

            def parts(shard: _Shard) -> _Shard:
                k = next(leaves)
                every = [part(r, k, boxes[r][k], shard) for r in range(saved_world)]
                return replace(shard, parts=lambda wanted: every)
        tree = _decode(base["tree"], [_Lazy(source(own), e) for e in base["tensors"]])
        loaded: dict[str, Any] = _map_shards(tree, parts)
        return loaded

    def _source(self, step: int, world: int, rank: int, memory: dict,
                sources: dict[str, int]) -> _Source:
        if held := self._held(memory, (world, rank, step)):
            path, meta = held
            return _Source(meta, sources, path=path)
        try:
            return _Source(shards.read_meta(self.storage, step, rank), sources,
                           storage=self.storage)
        except shards.ShardError as e:
            raise CheckpointError(str(e)) from None


class _Source:
    """Where one saved rank's shard is read from, a byte range at a time: this node's
    shared memory (a staging slot or a peer's copy; its save re-checked after each read)
    or storage (read and verified in whole blocks, each block once). ``sources`` counts
    the bytes read from each."""

    def __init__(self, meta: dict[str, Any], sources: dict[str, int], *,
                 path: Path | None = None, storage: Any = None):
        self.meta, self._sources, self._path, self._storage = meta, sources, path, storage
        self._blocks: dict[int, bytes | bytearray] = {}  # verified blocks read from storage
        if path is None:
            self.name = "storage"
        elif meta.get("replica_from"):
            self.name = f"peer memory (node {meta['replica_from']})"
        else:
            self.name = "shared memory"
        sources.setdefault(self.name, 0)

    def read(self, offset: int, nbytes: int) -> bytes | bytearray:
        if not 0 <= offset <= offset + nbytes <= self.meta["nbytes"]:
            raise CheckpointError(f"rank {self.meta['rank']}'s step {self.meta['step']}: a "
                                  "tensor outside its shard")
        if self._path is None:
            return self._from_storage(offset, nbytes)
        self._sources[self.name] += nbytes
        data = bytearray(nbytes)
        with open(self._path.with_suffix(".data"), "rb", buffering=0) as f:
            f.seek(offset)
            if f.readinto(data) != nbytes:
                data = bytearray()
        again = read_meta(self._path)
        if len(data) != nbytes or again is None or again.get("save_id") != self.meta["save_id"]:
            raise CheckpointError(f"rank {self.meta['rank']}'s step {self.meta['step']} in "
                                  "shared memory was overwritten while it was read")
        return data


    def _from_storage(self, offset: int, nbytes: int) -> bytes | bytearray:
        if nbytes == 0:
            return bytearray()
        block = shards.block_size(self.meta)
        first, last = offset // block, (offset + nbytes - 1) // block
        wanted = [i for i in range(first, last + 1) if i not in self._blocks]
        while wanted:  # one ranged read per run of blocks not read yet
            run = 1
            while run < len(wanted) and wanted[run] == wanted[0] + run:
                run += 1
            try:
                data = shards.read_blocks(self._storage, self.meta, wanted[0], run)
            except shards.ShardError as e:
                raise CheckpointError(str(e)) from None
            self._sources[self.name] += len(data)
            for k in range(run):
                self._blocks[wanted[k]] = data[k * block:(k + 1) * block]
            wanted = wanted[run:]
        if first == last:
            skip = offset - first * block
            return self._blocks[first][skip:skip + nbytes]
        joined = b"".join(self._blocks[i] for i in range(first, last + 1))
        return joined[offset - first * block:offset - first * block + nbytes]


@dataclass
class _Lazy:
    """A saved tensor not read yet: ``rows`` reads only a slice along its first dimension."""

    source: _Source
    entry: dict[str, Any]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.entry["shape"])

    def rows(self, start: int, count: int) -> torch.Tensor:
        dtype = getattr(torch, self.entry["dtype"])
        shape = self.shape
        if not shape:
            data = self.source.read(self.entry["offset"], self.entry["nbytes"])
            return _tensor(bytearray(data), {**self.entry, "offset": 0})
        row = self.entry["nbytes"] // shape[0] if shape[0] else 0
        data = self.source.read(self.entry["offset"] + start * row, count * row)
        if not data:
            return torch.empty((count, *shape[1:]), dtype=dtype)
        return torch.frombuffer(data if isinstance(data, bytearray) else bytearray(data),
                                dtype=dtype).reshape(count, *shape[1:])

    def whole(self) -> torch.Tensor:
        return self.rows(0, self.shape[0]) if self.shape else self.rows(0, 1)


def _prefetch(value: Any, current: Any) -> Any:
    """``value`` with every ``_Lazy`` read: a sharded tensor's new local part cut from the
    byte ranges of the saved parts it overlaps, anything else whole."""
    if isinstance(value, _Shard):
        dtensor = _dtensor_type()
        if value.parts is not None and dtensor is not None and isinstance(current, dtensor):
            return _Shard(value.local, value.box, assembled=_assemble(value, current))
        return _Shard(_prefetch(value.local, None), value.box)
    if isinstance(value, _Lazy):
        return value.whole()
    if isinstance(value, dict):
        current = current if isinstance(current, dict) else {}
        return {k: _prefetch(v, current.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        same = isinstance(current, (list, tuple)) and len(current) == len(value)
        items = [_prefetch(v, current[i] if same else None) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _current(target: Any) -> Any:
    """What a target holds now (its state dict), to fit a loaded state to."""
    return target.state_dict() if hasattr(target, "load_state_dict") else dict(target)


def _whole_in_memory(memory: dict[tuple[int, int, int], Any]) -> dict[int, int]:
    """Steps whose every saved rank's shard is in this node's memory -> their world size."""
    ranks: dict[tuple[int, int], set[int]] = {}
    for world, rank, step in memory:
        ranks.setdefault((step, world), set()).add(rank)
    return {step: world for (step, world), have in ranks.items() if have >= set(range(world))}


def _map_copy(meta_path: Path, meta: dict[str, Any]) -> Any:
    """A shard's bytes in shared memory, mapped (nothing is copied until restored into
    the target), or None if its slot holds another save by now."""
    if not meta["nbytes"]:
        return bytearray()
    try:
        with open(meta_path.with_suffix(".data"), "r+b") as f:  # shared, populated: no
            mapped = mmap.mmap(f.fileno(), meta["nbytes"],  # page faults (nothing writes it)
                               flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except (OSError, ValueError):
        return None
    again = read_meta(meta_path)
    if again is None or again.get("save_id") != meta.get("save_id"):
        mapped.close()
        return None
    return mapped


def _skeleton(encoded: Any) -> str:
    """An encoded tree's structure (its keys, and where tensors and shards are), without
    plain values: the same for every saved rank of one state."""
    if isinstance(encoded, dict):
        if "__t__" in encoded:
            return "S" if encoded.get("shard") else "T"
        if "__d__" in encoded:
            return "{" + ",".join(f"{_skeleton(k) if isinstance(k, dict) else repr(k)}:"
                                  f"{_skeleton(v)}" for k, v in encoded["__d__"]) + "}"
        return "[" + ",".join(_skeleton(v) for v in encoded.get("__l__", ())) + "]"
    return "v"


def _encoded_boxes(boxes: list[Box | None]) -> list[int]:
    """Boxes as ints for a collective: per box its dimensions (-1: none saved), offsets, shape."""
    out = [len(boxes)]
    for box in boxes:
        out += [-1] if box is None else [len(box.offset), *box.offset, *box.shape]
    return out


def _decoded_boxes(rows: list[list[int]], saved_world: int) -> list[list[Box]]:
    """Saved rank -> its sharded tensors' boxes, from the ranks' rows of
    [rank, *_encoded_boxes(...)], ...; raises if a rank saved none (a checkpoint from
    before resharding) or a rank is missing."""
    boxes: dict[int, list[Box]] = {}
    for row in rows:
        at = 0
        while at < len(row):
            rank, count, at = row[at], row[at + 1], at + 2
            mine = []
            for _ in range(count):
                dims = row[at]
                if dims < 0:
                    raise CheckpointError("the checkpoint predates resharding (no chunk "
                                          "positions saved): restore it with the world size "
                                          "that saved it")
                mine.append(Box(tuple(row[at + 1:at + 1 + dims]),
                                tuple(row[at + 1 + dims:at + 1 + 2 * dims])))
                at += 1 + 2 * dims
            boxes[rank] = mine
    if sorted(boxes) != list(range(saved_world)):
        raise CheckpointError(f"saved ranks {sorted(set(range(saved_world)) - set(boxes))} "
                              "not read")
    return [boxes[r] for r in range(saved_world)]


def _map_shards(value: Any, fn: Any) -> Any:
    """``value`` with each _Shard replaced by ``fn(shard)``, in _decode's order."""
    if isinstance(value, _Shard):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_shards(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_map_shards(v, fn) for v in value]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _bare(meta: dict[str, Any]) -> Any:
    """A saved rank's tree with no tensor read: its shards' boxes and layouts, each shard's
    ``local`` the shape its saved tensor has (a resharded restore reads a part's rows by
    its box: a box that is not its tensor's shape would read another tensor's bytes)."""
    return _decode(meta["tree"], [tuple(entry["shape"]) for entry in meta["tensors"]])


def _shards_in(value: Any) -> list[_Shard]:
    """A decoded tree's sharded tensors, in _decode's order (the same for every saved rank
    of one state: see _skeleton)."""
    found: list[_Shard] = []
    _map_shards(value, found.append)
    return found


class _Deferred:
    """Saved rank ``rank``'s part of its ``leaf``-th sharded tensor, its meta read (once, by
    ``shards_of``) only when a byte of the part is: a restore reads the metas of the saved
    ranks its new shards overlap, not every saved rank's."""

    def __init__(self, shards_of: Any, rank: int, leaf: int, box: Box):
        self._shards_of, self._rank, self._leaf, self._box = shards_of, rank, leaf, box

    def _lazy(self) -> _Lazy:
        shard = self._shards_of(self._rank)[self._leaf]
        if shard.box != self._box or not isinstance(shard.local, _Lazy):
            raise CheckpointError(f"saved rank {self._rank}'s shard moved while it was read")
        return shard.local

    def rows(self, start: int, count: int) -> torch.Tensor:
        return self._lazy().rows(start, count)

    def whole(self) -> torch.Tensor:
        return self._lazy().whole()


@dataclass
class _InFlight:
    """An overlapped save while its copy runs."""
    index: int
    began: float
    versions: list[int]  # the tensors' version counters: an in-place change bumps them
    stall: float  # what training waited for it (and for the previous copy)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Copier:
    """The thread that runs overlapped saves' copies, one at a time, for every checkpointer
    of the process (one a re-entered attempt dropped included)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ftlaunch-ckpt-copy",
                                        daemon=True)
        self._thread.start()

    def copy(self, job: Any, flight: _InFlight) -> None:
        self._jobs.put((job, flight))

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            if isinstance(item, threading.Event):  # drain: every copy before it is done
                item.set()
                continue
            job, flight = item
            try:
                with torch.no_grad():
                    job()
            except BaseException as e:
                flight.error = e
            finally:
                flight.done.set()

    def drain(self) -> None:
        """Until every copy queued so far is done."""
        done = threading.Event()
        self._jobs.put(done)
        done.wait()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


_COPIER: _Copier | None = None


def _copier() -> _Copier:
    global _COPIER
    if _COPIER is None:
        _COPIER = _Copier()
        shutdown.at_exit(_close_copier)  # first (newest first): the copies queued finish
    return _COPIER


def _close_copier() -> None:
    global _COPIER
    if _COPIER is not None:
        _COPIER.close()
        _COPIER = None


def _finish_copy_hook(checkpointer: AsyncCheckpointer) -> Any:
    """An optimizer pre-step hook: the step waits for the copy of the last save."""
    this = weakref.ref(checkpointer)  # the optimizer must not keep the checkpointer alive

    def finish_copy(_optimizer: Any, _args: Any, _kwargs: Any) -> None:
        if (live := this()) is not None:
            live._finish_copy()
    return finish_copy


def _versions(tensors: list[torch.Tensor]) -> list[int] | None:
    """The tensors' version counters (an in-place change bumps one), or None where a copy
    cannot overlap: a GPU tensor (copied on its stream instead), or one without a counter
    (an inference tensor)."""
    if any(t.is_cuda for t in tensors):
        return None
    try:
        return [t._version for t in tensors]
    except RuntimeError:
        return None


def _optimizers(values: Any) -> list[torch.optim.Optimizer]:
    """The optimizers in a save's state (given as such, or in a DistributedState)."""
    found = []
    for value in values:
        value = getattr(value, "optimizer", value)
        if isinstance(value, torch.optim.Optimizer):
            found.append(value)
    return found


def _history() -> str:
    """Which history a save belongs to: the rendezvous round its ranks were started in
    (under an agent), else torchrun's restart count. All ranks of one save share it."""
    if environment.ROUND in os.environ:
        return f"round {os.environ[environment.ROUND]}"
    return f"restart {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _tell_agent(kind: type[ShardDurable] | type[ShardStaged], rank: int, step: int,
                seconds: float) -> None:
    """A shard is staged (the agent copies it to peers) or durable (the agent tells the
    coordinator, which commits the step once every rank's is); ``seconds`` since the save
    began (-1: unknown, e.g. a staged shard persisted after a restart)."""
    link = getattr(sys.modules["trainer_shim"], "_link", None)
    if link is not None:
        link.report(kind(pid=link.pid, rank=rank, step=step, seconds=round(seconds, 6)))


def _stage(slot: Slot, tensors: list[torch.Tensor], sizes: list[int]) -> list[dict[str, Any]]:
    """Copy the tensors in (64-byte aligned, same dtype: plain vectorised copies); returns
    where each one went. Host tensors are copied in pieces by a few threads at once (a
    rank runs with one intra-op thread, as under torchrun, and one core's copy is not the
    memory's bandwidth); GPU tensors asynchronously into the staging memory, page-locked
    for CUDA once, then awaited together."""
    on_gpu = any(t.is_cuda for t in tensors)
    if on_gpu:
        _pin(slot)
    entries, targets, sources, offset = [], [], [], 0
    for t, size in zip(tensors, sizes, strict=True):
        if size:
            target = torch.frombuffer(slot.buffer, dtype=t.dtype, count=t.numel(),
                                      offset=offset)
            source = t.detach().reshape(-1)
            if t.is_cuda:
                target.copy_(source, non_blocking=True)
            elif size <= COPY_PIECE:
                targets.append(target)
                sources.append(source)
            else:
                step = COPY_PIECE // t.element_size()
                targets += [target[i:i + step] for i in range(0, t.numel(), step)]
                sources += [source[i:i + step] for i in range(0, t.numel(), step)]
        entries.append({"dtype": _DTYPE_NAMES.get(t.dtype) or _dtype_name(t.dtype),
                        "shape": list(t.shape), "offset": offset, "nbytes": size})
        offset += _aligned(size)
    threads = min(COPY_THREADS, len(os.sched_getaffinity(0)), len(targets))
    if threads > 1 and offset >= PARALLEL_COPY_MIN:
        Parallel(lambda pair: pair[0].copy_(pair[1]), list(zip(targets, sources, strict=True)),
                 threads, name="ftlaunch-ckpt-stage").result()
    elif targets:
        torch._foreach_copy_(targets, sources)  # one call: a state has thousands of tensors
    if on_gpu:
        torch.cuda.synchronize()  # the copy is whole before the slot is sealed
    return entries


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32 (str() of a dtype is slow enough to show in a save)."""
    _DTYPE_NAMES[dtype] = name = str(dtype).removeprefix("torch.")
    return name


def _pin(slot: Slot) -> None:
    """Page-lock the slot's mapping for CUDA (once per mapping): device-to-host copies
    then run at full PCIe/NVLink speed and asynchronously."""
    if slot.before_unmap is not None:
        return
    assert slot.buffer is not None
    probe = torch.frombuffer(slot.buffer, dtype=torch.uint8, count=1)
    pointer = probe.data_ptr()
    del probe  # no export may outlive the mapping
    cudart = torch.cuda.cudart()
    if int(cudart.cudaHostRegister(pointer, len(slot.buffer), 0)) != 0:
        return  # not pinnable here: copies still work, synchronously

    def unpin(_buffer, slot=slot) -> None:
        cudart.cudaHostUnregister(pointer)
        slot.before_unmap = None

    slot.before_unmap = unpin


def _tensor(buffer, entry: dict) -> torch.Tensor:
    """A view of one tensor's bytes (the caller owns or clones the buffer)."""
    dtype = getattr(torch, entry["dtype"])
    if not entry["nbytes"]:
        return torch.empty(entry["shape"], dtype=dtype)
    raw = torch.frombuffer(buffer, dtype=torch.uint8, count=entry["nbytes"],
                           offset=entry["offset"])
    return raw.view(dtype).reshape(entry["shape"])


def _group(world_size: int) -> bool:
    """Whether the ranks can agree through torch.distributed (initialized, same world)."""
    return (world_size > 1 and collective.initialized()
            and torch.distributed.get_world_size() == world_size)


def _all(flag: bool) -> bool:
    return all_reduce_int(int(flag), "min") == 1


def _agree(candidates: set[int]) -> int | None:
    """The newest step in every rank's ``candidates`` (collective; None if there is none)."""
    while True:
        step = all_reduce_int(max(candidates, default=-1), "min")
        if step < 0:
            return None
        if _all(step in candidates):
            return step
        candidates = {s for s in candidates if s < step}  # someone lacks it, and all newer


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64


# --- state trees: nested dicts/lists of tensors and plain values, never pickle -----------------

_PLAIN = (int, float, bool, str, bytes, type(None))
_PLAIN_TYPES = frozenset(_PLAIN)
_TENSOR_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))


class DistributedState:
    """A model (and optimizer) as torch.distributed.checkpoint sees them: with FSDP their
    state is DTensor shards: each rank saves its own, and restores its own or, on another
    world size, cuts its new shard from the saved ones. Pass it like a module:
    ``save(step, train=DistributedState(model, optimizer))``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint import state_dict as dcp

        if self.optimizer is None:
            return {"model": dcp.get_model_state_dict(self.model)}
        model, optim = dcp.get_state_dict(self.model, self.optimizer)
        return {"model": model, "optim": optim}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint import state_dict as dcp

        if self.optimizer is None:
            dcp.set_model_state_dict(self.model, state["model"])
        else:
            dcp.set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                               optim_state_dict=state["optim"])


@dataclass
class _Shard:
    """A rank's part of a DTensor, until it is matched with the target's layout; loaded on
    another world size or layout, with the saved parts a wanted box overlaps (``parts``:
    box -> [(saved box, its part)], to cut the target's new local part from)."""

    local: Any  # a tensor, or a _Lazy one not read yet
    box: Box | None = None  # where ``local`` sits in the global tensor (saved since #13)
    layout: reshard.Layout | None = None  # how it was split (saved since 2026-12-06)
    parts: Callable[[Box], list[tuple[Box, Any]]] | None = None
    assembled: torch.Tensor | None = None  # the target's new local part, cut from parts


def _chunk_box(dtensor: Any) -> Box:
    """Where this rank's local part of a DTensor sits in the global tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    cuts = _cuts(dtensor)
    if cuts is not None and cuts[1]:  # FSDP2 over TP: see _cuts
        mesh = dtensor.device_mesh
        return reshard.box_at(reshard.Layout(tuple(dtensor.shape), tuple(mesh.shape), *cuts),
                              mesh.get_coordinate())
    shape, offset = compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements)
    return Box(tuple(offset), tuple(shape))


def _cuts(dtensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Per mesh dimension the tensor dimension it shards (-1: it replicates), and the order
    the mesh dimensions cut in (empty: the mesh's), or None for placements this does not
    know. FSDP2 over tensor parallelism marks its dimension a _StridedShard whose split
    factor is the TP dimensions' size: FSDP2 cuts each TP part, so those cut first. (For a
    dimension not divisible by both, torch's own offsets of such a shard are not where its
    rows are: a 13-row weight on 3 x 2 ranks holds row 6 at (2, 0), torch says rows 6-7.)"""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    splits: list[int] = []
    strided: dict[int, int] = {}
    for level, placement in enumerate(dtensor.placements):
        if type(placement) is Replicate:
            splits.append(-1)
        elif type(placement) in (Shard, _StridedShard) and placement.dim >= 0:
            splits.append(placement.dim)
            if type(placement) is _StridedShard:
                strided[level] = int(placement.split_factor)
        else:
            return None
    order = list(range(len(splits)))
    for level, factor in strided.items():
        later = [b for b in range(level + 1, len(splits)) if splits[b] == splits[level]]
        if any(b in strided for b in later) or factor != math.prod(
                dtensor.device_mesh.shape[b] for b in later):
            return None
        if later:
            order.remove(level)
            order.insert(order.index(later[-1]) + 1, level)
    return tuple(splits), tuple(order) if order != sorted(order) else ()


_IN_WORLD: weakref.WeakKeyDictionary[Any, tuple[tuple[int, ...], tuple[int, ...]] | None] = \
    weakref.WeakKeyDictionary()
"""Per mesh, checked once (a restarted rank's new meshes are new entries; its old ones go
with them): see _in_world."""


def _in_world(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The shape of the mesh holding the world's ranks in order that ``mesh`` is, or is a
    slice of (init_device_mesh's, sliced by dimension names: FSDP over "dp" under TP), and
    which of its dimensions are ``mesh``'s; None where it is neither."""
    if mesh in _IN_WORLD:
        return _IN_WORLD[mesh]
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    ranks, found = root.mesh, None
    if torch.equal(ranks.flatten(), torch.arange(ranks.numel(), dtype=ranks.dtype)):
        names, own = root.mesh_dim_names or (), mesh.mesh_dim_names or ()
        dims = tuple(range(ranks.dim())) if root is mesh else tuple(
            names.index(n) if n in names else -1 for n in own)
        if dims and list(dims) == sorted(set(dims)) and dims[0] >= 0:  # in the root's order
            coordinate = root.get_coordinate() or ()  # the slice through this rank
            through = tuple(slice(None) if d in dims else c for d, c in enumerate(coordinate))
            if len(through) == ranks.dim() and torch.equal(ranks[through], mesh.mesh):
                found = (tuple(root.shape), dims)
    _IN_WORLD[mesh] = found
    return found


def _layout(dtensor: Any) -> reshard.Layout | None:
    """How ``dtensor`` is split, where that says where every rank's part sits: its mesh is
    one in world order or a slice of one (see _in_world; a slice's other dimensions
    replicate it), and its placements are known (see _cuts). Else None: a restore on
    another world size then gathers every saved part's box."""
    cuts, world = _cuts(dtensor), _in_world(dtensor.device_mesh)
    if cuts is None or world is None:
        return None
    (splits, order), (mesh, dims) = cuts, world
    everywhere = [-1] * len(mesh)
    for dim, split in zip(dims, splits, strict=True):
        everywhere[dim] = split
    cutting = tuple(dims[level] for level in order or range(len(dims)))
    cutting += tuple(d for d in range(len(mesh)) if d not in dims)  # (they cut nothing)
    return reshard.Layout(tuple(dtensor.shape), mesh, tuple(everywhere),
                          cutting if cutting != tuple(range(len(mesh))) else ())


def _region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(o, o + n) for o, n in zip(box.offset, box.shape, strict=True))]


def _assemble(shard: _Shard, current: Any) -> torch.Tensor:
    """The target's local part, cut from whichever saved parts overlap it."""
    assert shard.parts is not None
    wanted = _chunk_box(current)
    distinct = list({box: (box, t) for box, t in reversed(shard.parts(wanted))}.values())
    # ^ a replicated mesh dimension saved each part twice
    dtype = getattr(torch, shard.local.entry["dtype"]) if isinstance(shard.local, _Lazy) \
        else shard.local.dtype
    local = torch.empty(wanted.shape, dtype=dtype)
    try:
        pieces = reshard.plan([(i, box) for i, (box, _) in enumerate(distinct)], wanted)
    except ValueError as e:
        raise CheckpointError(f"cannot reshard a saved tensor: {e}") from None
    for piece in pieces:
        saved = distinct[piece.source][1]
        if isinstance(saved, (_Lazy, _Deferred)):  # only the rows of the part it needs
            first, count = (piece.src.offset[0], piece.src.shape[0]) if piece.src.shape \
                else (0, 1)
            rows = saved.rows(first, count) if piece.src.shape else saved.whole()
            src = Box((0, *piece.src.offset[1:]), piece.src.shape) if piece.src.shape \
                else piece.src
            _region(local, piece.dst).copy_(_region(rows, src))
        else:
            _region(local, piece.dst).copy_(_region(saved, piece.src))
    return local


def _dtensor_type() -> Any:
    """DTensor, if anything imported it (otherwise no state can hold one)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)


def _state_of(value: Any) -> Any:
    return value.state_dict() if hasattr(value, "state_dict") else value


def _encode(value: Any, tensors: list[torch.Tensor], dtensor: Any) -> Any:
    """``value``'s structure, its tensors appended to ``tensors`` (``dtensor``: the DTensor
    type, or None when nothing imported it). A save encodes every value of the model's and
    the optimizer's state on the training path: the common kinds are told by their exact
    type first, and a plain value inside a dict or list costs no call."""
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return value
    if kind in _TENSOR_TYPES:  # not a subclass (a DTensor): no more checks
        tensors.append(value)
        return {"__t__": len(tensors) - 1}
    if isinstance(value, dict):
        return {"__d__": [[k if type(k) in _PLAIN_TYPES else _encode(k, tensors, dtensor),
                           v if type(v) in _PLAIN_TYPES else _encode(v, tensors, dtensor)]
                          for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        if dtensor is not None and isinstance(value, dtensor):
            tensors.append(value.to_local())
            layout = _layout(value)  # and from it the box: 5 µs, torch's function 15
            box = _chunk_box(value) if layout is None else reshard.box_of(
                layout, value.device_mesh.get_rank())
            encoded = {"__t__": len(tensors) - 1, "shard": True,
                       "box": [list(box.offset), list(box.shape)]}
            if layout is not None:
                encoded["layout"] = [list(layout.shape), list(layout.mesh), list(layout.splits),
                                     *([list(layout.order)] if layout.order else [])]
            return encoded
        tensors.append(value)
        return {"__t__": len(tensors) - 1}
    if isinstance(value, (list, tuple)):
        return {"__l__": [v if type(v) in _PLAIN_TYPES else _encode(v, tensors, dtensor)
                          for v in value],
                "tuple": isinstance(value, tuple)}
    if isinstance(value, _PLAIN):
        return value
    raise CheckpointError(f"cannot checkpoint a {type(value).__name__}: use tensors, dicts, "
                          "lists and plain values (or an object with state_dict())")


def _decode(value: Any, tensors: list[Any]) -> Any:
    if isinstance(value, dict):
        if "__t__" in value:
            t = tensors[value["__t__"]]
            if not value.get("shard"):
                return t
            box = value.get("box")
            return _Shard(t, Box(tuple(box[0]), tuple(box[1])) if box else None,
                          _saved_layout(value.get("layout")))
        if "__d__" in value:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["__d__"]}
        items = [_decode(v, tensors) for v in value["__l__"]]
        return tuple(items) if value["tuple"] else items
    return value


def _saved_layout(saved: Any) -> reshard.Layout | None:
    """A shard's saved layout, or None where there is none or it is not one (then a resized
    restore gathers every saved part's box, as for a checkpoint from before layouts)."""
    if not (isinstance(saved, list) and len(saved) in (3, 4) and all(
            isinstance(part, list) and all(type(n) is int for n in part) for part in saved)):
        return None
    shape, mesh, splits, *order = map(tuple, saved)
    if len(mesh) != len(splits) or not all(-1 <= d < len(shape) for d in splits) \
            or min(mesh, default=0) < 1 or min(shape, default=0) < 0 \
            or (order and sorted(order[0]) != list(range(len(mesh)))):
        return None
    return reshard.Layout(shape, mesh, splits, *order)


def _rebuild(value: Any, current: Any, owned: bool) -> Any:
    """The loaded tree, made to fit the target's current state: a tensor the target already
    has (same shape and dtype) is overwritten in place, which is one memcpy into memory the
    process owns (no page faults, no second copy: a re-entered rank restores at memory
    speed); any other is kept if ``owned``, else copied out (staging is overwritten later).
    Shards become DTensors laid out like the target's."""
    if isinstance(value, _Shard):
        dtensor = _dtensor_type()
        if dtensor is not None and isinstance(current, dtensor) and (
                value.assembled is not None or value.parts is not None):
            local = value.assembled if value.assembled is not None else _assemble(value, current)
            return dtensor.from_local(local.to(current.device),
                                      current.device_mesh, current.placements,
                                      run_check=False, shape=current.shape,
                                      stride=current.stride())
        if dtensor is not None and isinstance(current, dtensor):
            local = _rebuild(value.local, current.to_local(), owned)
            if local is current.to_local():
                return current
            return dtensor.from_local(local.to(current.device), current.device_mesh,
                                      current.placements, run_check=False,
                                      shape=current.shape, stride=current.stride())
        return _rebuild(value.local, None, owned)
    if isinstance(value, torch.Tensor):
        if (isinstance(current, torch.Tensor) and type(current) is torch.Tensor
                and current.shape == value.shape and current.dtype == value.dtype):
            current.copy_(value)
            return current
        return value if owned else value.clone()
    if isinstance(value, dict):
        current = current if isinstance(current, dict) else {}
        return {k: _rebuild(v, current.get(k), owned) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        same = isinstance(current, (list, tuple)) and len(current) == len(value)
        items = [_rebuild(v, current[i] if same else None, owned) for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _restore(target: Any, value: Any, owned: bool, current: Any = None) -> None:
    """``current``: the target's state dict, if the caller has it already."""
    if hasattr(target, "load_state_dict"):
        state = current if current is not None else target.state_dict()
        target.load_state_dict(_rebuild(value, state, owned))
    elif isinstance(target, dict):
        rebuilt = _rebuild(value, current if current is not None else dict(target), owned)
        target.clear()
        target.update(rebuilt)
    else:
        raise CheckpointError(f"cannot load into a {type(target).__name__}: pass an object with "
                              "load_state_dict() or a dict")
