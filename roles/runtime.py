"""The role side of a job: what the user script calls. The same script runs as
every trainer and every standby; ``steps()`` hides the difference: a standby
blocks in it until the coordinator promotes it, a survivor of a failure rolls
back and joins the next process-group generation inside it."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

import torch

import replica
from replica.jobstore.commit import EpochRecord, hint_generation
from replica.state.data import Batches, prepare_extras
from replica.state.divergence import Divergence, Measure, comparable
from replica.errors import DivergenceError, FencedError, StoreWaitTimeoutError
from replica.jobstore import Epoch, Flag, Generation, JobStore, Promotion, Regroup, Stamp, Text, keys
from replica.state.export import export_path, load_export, step_folder
from replica.state.restore import materialize_optimizer_state, restore_snapshot
from replica.roles import timing
from replica.roles.env import Role, RoleEnv, configure_logging
from replica.roles.join import join
from replica.roles.rollouts import RolloutClient, serve_rollouts

__all__ = ["Job", "init"]

logger = logging.getLogger(__name__)
_HEARTBEAT_LOG_EVERY = 50  # repeated failures: one warning in 50 (5 s)
_FENCED_EXIT = 75  # the exit code of a trainer that found itself replaced
_COORDINATOR_LOST_EXIT = 76  # the exit code of a role whose job store went away
_DIVERGED_EXIT = 77  # the exit code of a role that found its redo diverged, under --strict
_LOSSES_KEPT = 64  # steps whose loss a role remembers, to check their redo against


def _endpoint(address: str) -> tuple[str, int]:
    """``host:port`` (as the coordinator publishes its liveness endpoint) split; ValueError if it is not."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a host:port: {address!r}")
    return host, int(port)


class Job:
    def __init__(self, env: RoleEnv):
        self.env = env
        self.role = env.role
        self.rank = env.rank
        self.store = JobStore(env.store.connect(timeout=timing.ROLE_WAIT), token=env.token)
        self._epochs = EpochRecord(self.store)  # the generation record, read whole only when its number moved
        # Present the job's token; a refusal (wrong token, rank taken, job running) raises JoinRefusedError.
        self.member = join(self.store, role=env.role, rank=env.rank, token=env.token, timeout=timing.ROLE_WAIT).member
        self._failed_generation = -1  # the newest generation this process could not join
        # Beat from the moment it is a member: the coordinator's deadline runs from the join.
        self.group: replica.ResilientProcessGroup | None = None
        self._stop = threading.Event()
        self._lost = threading.Lock()  # held once the job store is found gone (the role is exiting)
        self._beat = None  # the native heartbeat (JobStore.heartbeat), once the watch started it
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="replica-watch")
        self._watcher.start()
        # A lost standby is replaced by the launcher: wait for it rather than fail the trainer.
        self.config = replica.Config(token=env.token, host=env.host, standby_wait=timing.STANDBY_WAIT,
                                     commit_timeout=timing.COMMIT_WAIT,
                                     **({"backends": env.backends} if env.backends else {}))
        # gloo fails a frozen peer's collective at its timeout; NCCL's watchdog never beats the coordinator.
        self.group = None if env.role == Role.ROLLOUT else replica.init_resilient_process_group(
            store=self.store.sub(keys.process_group()), rank=env.rank, world_size=env.world_size,
            timeout=timing.PROCESS_GROUP_TIMEOUT, nccl_timeout=timing.NCCL_TIMEOUT,
            generation=0 if env.role == Role.TRAINER else None)
        self._rep: replica.Replicator | None = None
        self._mirror: replica.Mirror | None = None
        self._bound: tuple | None = None
        self._step = 0
        self._resumed_from = 0  # the step of the export this job started from (--resume)
        self._exported = False
        self._on_restore: list[Callable[[int], None]] = []
        self._losses: dict[int, str] = {}  # step -> the loss this process logged for it (hex)
        self._redo_in_store: set[int] = set()  # steps a promoted standby redoes that its trainer logged
        self._divergences_seen = 0  # of self._rep.divergences, those reported

    # --- what the script calls ---

    def replicate(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  extra: Mapping[str, object]) -> Job:
        """Mirror ``model``, ``optimizer`` and ``extra`` (``Stateful`` objects: LR schedulers,
        ``replica.RNGState()``, and data loaders, which are wrapped in ``replica.Batches``:
        take the batches from ``next_batch(name)``). Everything that feeds the loss must be
        in there; see the README, "What must be in the mirrored state"."""
        extra = prepare_extras(extra)
        self._bound = (model, optimizer, extra)
        if self.role == Role.TRAINER and self.env.resume:
            self._resume(self.env.resume)
        elif self.role == Role.TRAINER:
            self._start_replicator()
        else:
            # Create the optimizer's state now, while waiting: promotion is then one unpack.
            materialize_optimizer_state(optimizer)
            # A trainer of another model is refused at once (checked before the mirror is published).
            self._mirror = replica.Mirror(rank=self.rank, world_size=self.env.world_size, store=self.store,
                                          config=self.config, model=model, optimizer=optimizer,
                                          device=self.env.mirror_device or None)
        self._install_faults(model, optimizer)
        return self

    def batches(self, name: str) -> Batches:
        """The job's iterator over the data loader passed as ``extra[name]``: after a
        failover its next batch is the one the failure-free run took."""
        if self._bound is None:
            raise replica.ReplicaError("batches() before replicate()")
        found = self._bound[2].get(name)
        if not isinstance(found, Batches):
            loaders = sorted(k for k, v in self._bound[2].items() if isinstance(v, Batches))
            raise KeyError(f"extra[{name!r}] is not a data loader (the loaders passed to replicate(): {loaders})")
        return found

    def next_batch(self, name: str) -> Any:
        """The next batch of the data loader passed as ``extra[name]`` (``batches(name)``)."""
        return next(self.batches(name))

    def on_restore(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` whenever this process's state was rolled back to the
        commit ``step`` (a survivor of a failover) or restored there (a promoted standby),
        before the next step starts: for what the loop holds outside the mirrored state
        (an iterator it made itself, a cache, an accumulation counter)."""
        self._on_restore.append(callback)

    def restored(self, step: int) -> Job:
        """The script restored this trainer's state of ``step`` itself, from a checkpoint of its
        own (``replica coordinator --resume-step STEP``): ``steps()`` starts at ``step + 1``.
        Call it before ``replicate()``."""
        if self.role != Role.TRAINER:
            raise ValueError(f"only a trainer restores a checkpoint, not a {self.role}")
        if self._bound is not None:
            raise ValueError("call restored() before replicate(): the replicator starts from the restored state")
        if step < 0:
            raise ValueError(f"need a step >= 0, got {step}")
        self._resumed_from = step
        logger.warning("[trainer rank %d] restored step %d from the script's own checkpoint", self.rank, step)
        return self

    def _resume(self, folder: str) -> None:
        """Start from an export (``replica launch --resume``): restore this rank's file into
        the objects, keep it as the rank's copy of that commit and send it to the standby."""
        snapshot = load_export(export_path(folder, self.rank))
        model, optimizer, extra = self._bound
        restore_snapshot(snapshot, model, optimizer, extra, rank=self.rank, world_size=self.env.world_size)
        self._start_replicator((snapshot, None))
        self._rep.protect()
        self._resumed_from = snapshot.step
        logger.warning("[trainer rank %d] resumed from the export of step %d in %s", self.rank, snapshot.step, folder)

    def commit(self, step: int) -> bool:
        self._fault("commit", step)
        try:
            with self._store_guard():
                done = self._rep.commit(step)
        except replica.LayoutMismatchError as exc:
            self._report_fatal(exc)
            raise
        except FencedError:  # its standby or the commit record says the rank belongs to another process
            self._fenced_exit()
        for found in self._rep.divergences[self._divergences_seen:]:
            self._divergence(found)
        self._divergences_seen = len(self._rep.divergences)
        self._fault("mirror", step)  # the stream of this step is in flight now
        return done

    # --- the divergence guard ---

    def _check_loss(self, step: int, now: str) -> None:
        before = self._losses.get(step)
        if before is None and step in self._redo_in_store:  # a promoted standby: its trainer logged it
            self._redo_in_store.discard(step)
            logged = self.store.get(keys.loss(self.rank, step))
            before = logged.value.split(" ")[0] if logged is not None else None
        if before is not None and before != now:
            self._divergence(Divergence(rank=self.rank, step=step, measure=Measure.LOSS, before=before, after=now,
                                        comparable=comparable(self._bound[0])))
        self._losses[step] = now
        for old in sorted(self._losses)[:-_LOSSES_KEPT]:
            del self._losses[old]

    def _divergence(self, found: Divergence) -> None:
        """One loud line (the replicator logs what it finds itself), a record in the job
        report, and under --strict the job's end."""
        if found.measure is Measure.LOSS:
            (logger.error if found.comparable else logger.info)("[%s rank %d] %s", self.role, self.rank,
                                                                found.describe())
        self.store.put(keys.divergence(self.rank, found.step, found.measure.value), Text(value=found.to_json()))
        if self.env.strict and found.comparable:
            self._report_fatal(DivergenceError(found.describe()))
            logger.error("[%s rank %d] --strict: the job ends (exit code %d)", self.role, self.rank, _DIVERGED_EXIT)
            _exit_now(_DIVERGED_EXIT)

    def _restored_to(self, step: int) -> None:
        for callback in self._on_restore:
            callback(step)

    def log(self, step: int, loss: torch.Tensor | float, **metrics: float) -> None:
        """Record the step's loss exactly (a float's hex form) and any other metrics
        (``reward=...``) for the job report. A step redone after a failover is checked
        against the loss it had before (the divergence guard)."""
        # Reading the loss waits for the step's kernels, after which NCCL has reported any failure.
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        with self._store_guard():
            self._log(step, value, metrics)

    def _log(self, step: int, value: float, metrics: Mapping[str, float]) -> None:
        if self.group.check() is None:
            self._check_loss(step, value.hex())
            # One store round trip a step: the loss, when the step ended, the metrics.
            extra = "".join(f" {k}={float(v).hex()}" for k, v in sorted(metrics.items()))
            self.store.put(keys.loss(self.rank, step), Text(value=f"{value.hex()} {time.time()!r}{extra}"))

    def rollout_client(self, model: torch.nn.Module, *, num_shards: int, name_map=None,
                       dtype: torch.dtype | None = None) -> RolloutClient:
        """Weight sync to the job's rollout engines and generation requests to them
        (every trainer rank, and every standby, which uses it once promoted)."""
        sync = replica.WeightSync(model, store=self.store, num_engines=self.env.rollouts, config=self.config,
                                  rank=self.rank, name_map=name_map, dtype=dtype, epoch=self.epoch)
        return RolloutClient(store=self.store, sync=sync, num_shards=num_shards,
                             epoch=lambda: self.group.generation,
                             abort=lambda: self.group.errored is not None or self._failover_announced())

    def serve_rollouts(self, make_llm) -> None:
        """The rollout role: run the engine ``make_llm()`` builds and serve until the job ends."""
        if self.role != Role.ROLLOUT:
            raise replica.ReplicaError(f"serve_rollouts() in a {self.role} process")
        try:
            serve_rollouts(store=self.store, index=self.rank, num_engines=self.env.rollouts, token=self.env.token,
                           make_llm=make_llm, host=self.env.host, backends=self.env.backends or None,
                           stop=lambda: self.store.has(keys.finished()) or self.store.has(keys.rollout_stop(self.rank)),
                           on_shard=self._rollout_fault)
        finally:
            self.close()

    def steps(self, total: int) -> Iterator[int]:
        step = self._resumed_from + 1
        if self.role == Role.STANDBY:
            promoted = self._wait_promotion()
            if promoted is None:
                return
            step = promoted + 1
        while step <= total:
            self._step = step
            self._fault("forward", step)
            yield step
            with self._store_guard():
                if self.group.check() is not None or self._failover_announced():
                    step = self._recover() + 1
                    continue
                if self.group.generation > 0 and not self.store.has(keys.resumed(self.group.generation)):
                    self.store.put(keys.resumed(self.group.generation), Stamp(at=time.time()))
            step += 1
        with self._store_guard():
            self._rep.wait_committed()
            self.store.put(keys.done(self.rank), Flag())
            self.store.count(keys.done_count(), 1)
        self.close()

    def close(self) -> None:
        """Stop heartbeats, streams and listeners (the script's end does this itself)."""
        self._stop.set()
        if threading.current_thread() is not self._watcher:
            # Its native beat thread is joined here, not torn down with the interpreter.
            self._watcher.join(timeout=(timing.HEARTBEAT_IO + timing.HEARTBEAT_PERIOD).total_seconds() * 2)
        for closeable in (self._rep, self._mirror):
            if closeable is not None:
                closeable.close()
        self._rep = self._mirror = None
        if self.group is not None:
            self.group.shutdown()

    # --- failover ---

    def epoch(self) -> Epoch:
        """This process's epoch: the generation it trains in and its member id."""
        return Epoch(generation=self.group.generation, member=self.member)

    def _failover_announced(self, store: JobStore | None = None) -> bool:
        return self._generation_number(store) > self.group.generation

    def _superseded(self, store: JobStore | None = None) -> bool:
        """True when the coordinator gave this trainer's rank to another process. Never on a
        hint alone (``hint_generation``): a standby promoted a moment ago still holds the
        generation before its promotion, which the liveness answers may still vouch for (the
        endpoint learns the new number after the store): what would stop it is read again."""
        def given_away(current: Generation | None) -> bool:
            return (self.role == Role.TRAINER and current is not None and self.rank < len(current.trainers)
                    and current.trainers[self.rank] not in (-1, self.member))

        return given_away(self._epochs.generation(store)) and given_away(self._epochs.generation(store, fresh=True))

    def _announced(self) -> tuple[int, int]:
        """The newer generation and the commit it resumes from. A step that failed
        without one (a rendezvous or collective timed out on a loaded machine, no
        one died) waits for the coordinator's decision: a death is announced, or
        the slow peer catches up and the step is simply redone in a fresh generation.
        Blocks in the store until the next generation's failover record exists."""
        floor = max(self.group.generation, self._failed_generation)
        asked = False

        def announced(store: JobStore) -> tuple[int, int] | None:
            nonlocal asked
            current = store.get(keys.generation())
            if current is not None and current.number > floor:
                return current.number, store.wait(keys.failover(current.number), timing.ROLE_WAIT).commit
            if current is not None and not asked:  # no death announced (yet): ask for a fresh generation
                store.put(keys.regroup(self.rank), Regroup(rank=self.rank, generation=current.number))
                store.count(keys.regroup_count(), 1)
                asked = True
            return None

        try:
            return self.store.wait_for(announced, wake=lambda: [keys.failover(floor + 1)], timeout=timing.ROLE_WAIT,
                                       what="failover or regroup")
        except StoreWaitTimeoutError:
            raise replica.ReplicaError("the step failed but no coordinator announced a failover or a regroup "
                                       f"within {timing.ROLE_WAIT}") from None

    def _recover(self) -> int:
        while True:
            generation, commit = self._announced()
            if self._superseded():
                # Declared dead (a missed deadline) while alive: its standby has taken the rank over.
                self._fenced_exit()
            restored = self._rep.rollback(step=commit)
            if self._configure(generation):
                break
        self._rep.protect()  # a standby that does not hold the commit (a new one) receives it first
        self._restored_to(restored)
        logger.warning("[trainer rank %d] survived: rolled back to %d, generation %d", self.rank, restored, generation)
        return restored

    def _configure(self, generation: int) -> bool:
        """Join ``generation``; False if it failed or was superseded before every member
        arrived (the caller then waits for the next one)."""
        try:
            self.group.configure(generation, ready_timeout=timing.ROLE_WAIT,
                                 ready_abort=lambda: self._generation_number() > generation)
            return True
        except (replica.ReplicaError, RuntimeError) as exc:  # gloo reports a failed rendezvous as RuntimeError
            self._failed_generation = max(self._failed_generation, generation)
            logger.warning("[%s rank %d] generation %d could not be joined (%s); waiting for the next", self.role,
                           self.rank, generation, exc)
            return False

    def _generation_number(self, store: JobStore | None = None) -> int:
        """The coordinator's current generation (-1 while none is readable)."""
        current = self._epochs.generation(store)
        return -1 if current is None else current.number

    def _wait_promotion(self) -> int | None:
        """Wait (on a store connection of this thread's own) until the coordinator
        promotes this standby; None when the job ended first. Meanwhile, export the
        commit when asked (a rank's state is lost) and fire this standby's faults."""
        key = keys.promote(self.rank)
        faults = [f for f in self.env.faults if f.role == Role.STANDBY and f.rank == self.rank]
        generation = -1  # the newest generation seen: a promotion comes with the next one

        def promoted(store: JobStore) -> Promotion | Flag | None:
            nonlocal generation
            generation = max(generation, self._generation_number(store))
            promotion = store.get(key)
            if promotion is not None and promotion.member == self.member:  # meant for this standby only
                return promotion
            if not self._exported and (request := store.get(keys.export())) is not None:
                self._export(request.directory, [request.commit])  # the job is ending: a rank's state is lost
            if store.has(keys.finished()):
                return Flag()
            for f in faults:  # a standby's fault fires once its trainer has finished that step
                if store.has(keys.loss(self.rank, f.step)):
                    self._fault(f.phase, f.step)
            return None

        with self._store_guard():
            # Woken by the next generation's failover record (written before its promotion);
            # the job's end and an export request are looked for every timing.STANDBY_LOOK.
            # While a fresh liveness answer says the generation did not move, no promotion can have
            # come: the store is not asked for one (1,024 waiting standbys asked ~100,000 times a second).
            promotion = self.store.wait_for(
                promoted, wake=lambda: [keys.failover(generation + 1)], timeout=timing.PROMOTION_WAIT,
                what="promotion", every=timing.STANDBY_POLL if faults else timing.STANDBY_LOOK, poll=timing.STANDBY_POLL,
                quiet=lambda: self._fresh_generation() == generation,
                quiet_every=timing.STANDBY_POLL if faults else timing.STANDBY_QUIET_LOOK)
        if isinstance(promotion, Flag):
            self.close()
            return None
        generation = promotion.generation
        commit = self.store.wait(keys.failover(generation), timing.ROLE_WAIT).commit
        model, optimizer, extra = self._bound
        try:
            self._mirror.restore(model, optimizer, extra, step=commit, rank=self.rank,
                                 world_size=self.env.world_size)
        except replica.LayoutMismatchError as exc:
            self._report_fatal(exc)
            raise
        self.store.put(keys.restored(generation), Stamp(at=time.time()))
        while not self._configure(generation):  # a regroup or another death overtook this generation
            generation, commit = self._announced()
            self._mirror.restore(model, optimizer, extra, step=commit, rank=self.rank,
                                 world_size=self.env.world_size)
        self.store.put(keys.reconnected(generation), Stamp(at=time.time()))
        # The committed version restored from stays this rank's copy of the commit (no copy),
        # the other version takes the next step; closing the mirror waits for its threads.
        held = self._mirror.hand_over(commit)
        mirror, self._mirror = self._mirror, None
        threading.Thread(target=mirror.close, daemon=True, name="replica-mirror-close").start()
        self.role = Role.TRAINER
        self._start_replicator(held)
        self._rep.protect()  # the rank's new standby receives the commit first: it has two copies again
        # The steps after the commit that the rank's last trainer logged are redone here: the
        # guard checks them against its losses (at most the two in flight when it died).
        self._redo_in_store = {commit + 1, commit + 2}
        self._restored_to(commit)
        logger.warning("[standby rank %d] promoted to trainer at commit %d, generation %d", self.rank, commit,
                       generation)
        return commit

    def _start_replicator(self, held: tuple[replica.Snapshot, replica.Snapshot | None] | None = None) -> None:
        model, optimizer, extra = self._bound
        self._divergences_seen = 0
        self._rep = replica.Replicator(model, optimizer, extra, store=self.store, config=self.config,
                                       rank=self.rank, world_size=self.env.world_size, epoch=self.epoch)
        self._rep.interrupted = self._failover_announced
        if held is not None:
            self._rep.adopt(*held)

    # --- liveness and faults ---

    def _holder(self) -> replica.Mirror | replica.Replicator | None:
        """What holds this role's versions: a standby's mirror, a trainer's replicator."""
        return self._mirror if self._mirror is not None else self._rep

    def _export(self, directory: str, steps: list[int]) -> None:
        """Write this role's versions of ``steps`` to the job's export folder (one folder
        per step, ``replica.state.export.step_folder``), and say in the store what was written."""
        self._exported = True
        written = []
        for step in steps:
            try:
                path = self._holder().export(step_folder(directory, step), step=step)
                written.append(str(path))
                logger.warning("[%s rank %d] exported step %d to %s", self.role, self.rank, step, path)
            except replica.ReplicaError as exc:
                written.append(f"error: {exc}")
                logger.error("[%s rank %d] could not export step %d: %s", self.role, self.rank, step, exc)
        with contextlib.suppress(RuntimeError):  # the store may be gone (that may be why it exports)
            self.store.put(keys.exported(self.rank), Text(value="; ".join(written)))

    def _coordinator_lost(self, exc: BaseException) -> NoReturn:
        """The job store is unreachable (the coordinator died): nobody can decide a failover
        any more. Standbys and trainers write every version they hold to the export folder
        (the newest step all ranks wrote is where ``replica launch --resume`` starts); every
        role exits (code 76). Runs once, from whichever thread finds it first."""
        if not self._lost.acquire(blocking=False):  # another thread is at it, and exits the process
            while True:
                time.sleep(1)
        logger.error("[%s rank %d] the job store is gone (%s): the coordinator died or is cut off; this %s "
                     "exports the versions it holds to %s and stops", self.role, self.rank, exc, self.role,
                     self.env.export_dir)
        if self._holder() is not None:
            self._export(self.env.export_dir, self._holder().held_steps())
        _exit_now(_COORDINATOR_LOST_EXIT)

    @contextlib.contextmanager
    def _store_guard(self) -> Iterator[None]:
        """Store calls of the role's own thread: a failure that is the store going away
        ends the role as ``_coordinator_lost`` says, not with a traceback."""
        try:
            yield
        except replica.ReplicaError:
            raise
        except RuntimeError as exc:  # torch's DistStoreError and DistNetworkError are RuntimeErrors
            self._store_failed(exc)

    def _store_failed(self, exc: RuntimeError) -> None:
        """A store call of the role's own thread failed: if the store stays unreachable for
        timing.STORE_LOST, the coordinator is gone (``_coordinator_lost``); else ``exc`` was
        something else, and it is raised again."""
        deadline = time.monotonic() + timing.STORE_LOST.total_seconds()
        while time.monotonic() < deadline:
            try:
                self.store.reconnect(timing.HEARTBEAT_IO).get(keys.generation())
            except (RuntimeError, OSError):  # still unreachable
                time.sleep(0.2)
                continue
            raise exc  # the store answers: the failure was something else
        self._coordinator_lost(exc)

    def _report_fatal(self, exc: Exception) -> None:
        """An error no failover can fix (the roles disagree on the model): the job must stop."""
        message = f"{self.role} rank {self.rank}: {exc}"
        logger.error("[%s rank %d] fatal: %s", self.role, self.rank, exc)
        self.store.put(keys.fatal(), Text(value=message))

    def _watch(self) -> None:
        """The role's liveness, from the moment it joined. The beat itself comes from a
        native thread (``JobStore.heartbeat``: a Python thread waiting for the GIL behind
        a busy main thread was silent for seconds on a loaded machine); this thread tells
        it the interpreter lives, every HEARTBEAT_PERIOD, on a store connection of its own
        (the role's shared one sits in blocking waits for seconds). It also stops a
        trainer whose rank the coordinator gave to another process (declared dead:
        frozen, partitioned), gets a survivor out of a collective with a dead peer,
        and ends the role when the store stays unreachable (the coordinator is gone).
        An error is logged and the watch goes on (reconnecting)."""
        try:  # aimed from the first beat where the coordinator has an endpoint
            published = self.store.own().get(keys.liveness())
            aimed, endpoint = (published.value, _endpoint(published.value)) if published is not None else (None, None)
        except Exception as exc:  # noqa: BLE001 - the store path beats meanwhile; the loop looks again
            logger.warning("[%s rank %d] no liveness endpoint yet (%s)", self.role, self.rank, exc)
            aimed, endpoint = None, None
        beat = self.store.heartbeat(self.member, period=timing.HEARTBEAT_PERIOD, io_timeout=timing.HEARTBEAT_IO,
                                    python_grace=timing.PYTHON_GRACE, store_after=timing.LIVENESS_STORE_AFTER,
                                    liveness=endpoint)
        self._beat = beat
        hint_generation(self.store, self._fresh_generation)
        store: JobStore | None = None
        failures = 0
        failing_since = 0.0
        beats_failing = False
        aimed_at = time.monotonic() if endpoint is not None else -float("inf")  # aimed: the address the beat goes to
        try:
            while not self._stop.is_set():
                beat.touch()
                if (beat.failing_for > timing.HEARTBEAT_IO.total_seconds()) != beats_failing:
                    beats_failing = not beats_failing
                    logger.warning("[%s rank %d] heartbeats %s", self.role, self.rank,
                                   f"fail: {beat.last_error}" if beats_failing else "get through again")
                try:
                    if store is None:
                        store = self.store.reconnect(timing.HEARTBEAT_IO)
                    reaim = timing.LIVENESS_REAIM.total_seconds()
                    if beat.reply_age > reaim and time.monotonic() - aimed_at > reaim:
                        aimed_at = time.monotonic()  # first, and while no answer comes: the coordinator may have moved
                        aimed = self._aim(beat, store, aimed)
                    if self._superseded(store):
                        self._fenced_exit()
                    if self.group is not None and self.role == Role.TRAINER and \
                            self.group.errored is None and self._failover_announced(store):
                        # NCCL does not fail a collective whose peer died, nor does gloo before its timeout
                        # when the peer's host is lost (no reset): get this survivor out of it.
                        self.group.abort("the coordinator announced a failover")
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - the watch must never end the thread
                    failures += 1
                    failing_since = failing_since if failures > 1 else time.monotonic()
                    if failures == 1 or failures % _HEARTBEAT_LOG_EVERY == 0:
                        logger.warning("[%s rank %d] the job store does not answer (%d in a row): %s; beats: %s",
                                       self.role, self.rank, failures, exc, beat.last_error or "getting through")
                    store = None
                    if time.monotonic() - failing_since > timing.STORE_LOST.total_seconds():
                        self._coordinator_lost(exc)
                self._stop.wait(timing.HEARTBEAT_PERIOD.total_seconds())
        finally:
            hint_generation(self.store, None)
            beat.stop()

    def _aim(self, beat, store: JobStore, aimed: str | None) -> str | None:
        """Point the beat at the liveness endpoint the coordinator published, if it moved;
        returns the address aimed at (None: none published, the beats stay in the store)."""
        published = store.get(keys.liveness())
        if published is None or published.value == aimed:
            return aimed
        try:
            beat.aim(*_endpoint(published.value))
        except (RuntimeError, ValueError) as exc:  # unresolvable here: the store path goes on
            logger.warning("[%s rank %d] cannot beat to the liveness endpoint %s (%s); beating to the job store",
                           self.role, self.rank, published.value, exc)
            return aimed
        logger.info("[%s rank %d] beating to the liveness endpoint %s", self.role, self.rank, published.value)
        return published.value

    def _fresh_generation(self) -> int | None:
        """The generation number the coordinator's last liveness answer carried, while that
        answer is fresh (LIVENESS_FRESH); None otherwise (the store is asked)."""
        beat = self._beat
        if beat is None or beat.reply_age > timing.LIVENESS_FRESH.total_seconds() or beat.generation < 0:
            return None
        return beat.generation

    def _fenced_exit(self) -> None:
        """This trainer was declared dead and replaced: whatever it does now would be a
        zombie's. Exit at once (the standbys and engines refuse its epoch anyway)."""
        logger.error("[trainer rank %d] this process was declared dead and its rank given to another "
                     "process; it stops now (exit code %d)", self.rank, _FENCED_EXIT)
        _exit_now(_FENCED_EXIT)

    def _install_faults(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        mine = [f for f in self.env.faults if f.rank == self.rank]
        if not mine:
            return

        def on_backward(module, grad_output):
            self._fault("backward", self._step)

        # The last module holding parameters sees its output's gradient early in backward.
        last = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))][-1]
        last.register_full_backward_pre_hook(on_backward)
        optimizer.register_step_pre_hook(lambda *a: self._fault("optimizer", self._step))

        def on_collective(name: str) -> None:
            if name == "reduce_scatter_single":  # FSDP2's gradient reduce-scatter
                self._fault("reduce-scatter", self._step)

        self.group.on_collective = on_collective

    def _rollout_fault(self, step: int) -> None:
        """A rollout's fault fires at the first shard it generates for its step or a later one
        (which engine takes which shard depends on which is up first)."""
        for f in self.env.faults:
            if f.role == Role.ROLLOUT and f.rank == self.rank and f.step <= step:
                self._fault(f.phase, f.step)

    def _fault(self, phase: str, step: int) -> None:
        for f in self.env.faults:
            if f.rank != self.rank or f.role != self.role or f.step != step or f.phase != phase:
                continue
            if f.generation is not None and (self.group is None or self.group.generation != f.generation):
                continue
            key = keys.killed(str(f))
            if self.store.has(key):
                continue  # each fault fires once, not again when the step is redone
            self.store.put(key, Stamp(at=time.time()))
            # A round trip on the same connection: the stamp is in the store before this process stops (a
            # TCPStore set is not acknowledged, and a SIGKILL with unread replies resets the connection).
            self.store.has(key)
            logger.warning("[%s rank %d step %d] injected fault %s fires", self.role, self.rank, step, f)
            if f.action == "stall":
                time.sleep(f.seconds)
            elif f.action == "freeze":
                for handler in logging.getLogger().handlers:  # what it logged is out before it stops
                    handler.flush()
                os.kill(os.getpid(), signal.SIGSTOP)
                logger.warning("[%s rank %d step %d] woke up from the freeze", self.role, self.rank, step)
            else:
                os.kill(os.getpid(), signal.SIGKILL)


def _exit_now(code: int) -> NoReturn:
    """End the process at once (whatever thread this is, and whatever the others do), with
    what was logged written out first."""
    logging.shutdown()
    os._exit(code)


def init() -> Job:
    """Join the job ``replica launch`` (or a torchrun-style environment) describes. A role
    prints every thread's Python stack to stderr on SIGUSR1 (``kill -USR1 PID``: where is
    it stuck?)."""
    configure_logging()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return Job(RoleEnv.from_environ())
