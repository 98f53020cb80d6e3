"""The role side of a job: what the user script calls. The same script runs as
every trainer and every standby; ``steps()`` hides the difference: a standby
blocks in it until the coordinator promotes it, a survivor of a failure rolls
back and joins the next process-group generation inside it."""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

import replica
from replica.errors import DivergenceError, FencedError
from replica.jobstore import Epoch, ExportOutcome, ExportStatus, Flag, JobStore, Stamp, Text, keys
from replica.mirror.floor import Floor
from replica.mirror.warmup import WarmUp, compiled_graphs, warm_up
from replica.roles import timing
from replica.roles.env import Phase, Role, RoleEnv, configure_logging, process_group
from replica.roles.exits import ExitCode, exit_now
from replica.roles.faults import FaultPlan
from replica.roles.join import join
from replica.roles.recovery import Recovery
from replica.roles.rollout_engine import serve_rollouts
from replica.roles.rollouts import RolloutClient
from replica.roles.spares import wait_for_binding
from replica.state.data import Batches, prepare_extras
from replica.state.divergence import Divergence, Measure, comparable
from replica.state.export import export_path, load_export, step_folder
from replica.state.inputs import InputDigests
from replica.state.restore import materialize_optimizer_state, restore_snapshot

__all__ = ["Job", "init"]

logger = logging.getLogger(__name__)
_LOSSES_KEPT = 64  # steps whose loss a role remembers, to check their redo against


class Job:
    """A role process's handle on the job; ``replica.roles.init()`` makes it. The same script
    runs as every trainer, every standby and every rollout engine: ``steps()`` hides the
    difference, and ``role``, ``rank`` and ``env`` say which one this is.

    **Joining.** Making it reads the role, its rank and the job store from the environment
    (``RoleEnv``; a spare standby first waits for the rank it gets, and exits when the job
    ends without needing it), joins the job with the job's token (a refusal raises
    ``replica.JoinRefusedError``), heartbeats to the coordinator from then on, and builds
    the trainers' process group (``group``, a ``replica.ResilientProcessGroup``: a trainer
    joins generation 0, a standby joins at its promotion; a rollout engine has none).

    **Before the loop.** ``replicate(model, optimizer, extra)`` names the state that is
    mirrored: a trainer starts its ``replica.Replicator`` (from an export with ``replica
    launch --resume``; call ``restored(step)`` first to start from a checkpoint of the
    script's own); a standby creates its optimizer's state and publishes its
    ``replica.Mirror``, which its rank's trainer streams to (and writes the durable floor,
    ``--durable``). ``warm_up(step)`` has a standby compile while it waits. Take batches
    from ``next_batch(name)``, never from the loader itself.

    **Each step.** ``for step in job.steps():`` yields the steps this role trains. The body
    runs the step (forward, backward, optimizer step), then ``log(step, loss)`` (the exact
    loss, for the job report and the divergence guard) and ``commit(step)``: the state after
    the step is snapshotted and streamed to the rank's standby in the background; it waits
    only for the global commit of the previous step (every rank's standby acknowledged it),
    and commits nothing when the step ran in a failed generation. After each step
    ``steps()`` looks at the group and at the coordinator's generation.

    **Failover, as a survivor.** When another trainer dies, this one's collectives finish
    without raising (their results are garbage); at the step's end ``steps()`` waits for the
    coordinator's decision, rolls the state back in place to the commit it fixed (this
    process's own snapshot: no network), joins the next generation, calls the
    ``on_restore`` callbacks and yields the step after that commit again. A trainer that was
    declared dead while alive (frozen, cut off) finds its rank given to its standby and
    exits (``ExitCode.FENCED``).

    **Failover, as a standby.** A standby blocks in ``steps()`` until the coordinator
    promotes it (meanwhile it writes the commit to the export folder if the job, ending,
    asks). Promoted, it restores the commit from its mirror into its model, optimizer and
    ``extra``, joins the new generation at the dead trainer's rank, becomes that rank's
    trainer (``role``; the commit is the first thing it sends to its own new standby), calls
    the ``on_restore`` callbacks and yields the step after the commit; the losses the dead
    trainer logged for the steps it redoes are checked against its own. A standby whose job
    ends without its promotion gets no step.

    **The end.** After the last step ``steps()`` waits for the last commit, records the
    rank done and closes the job (``close()``). A rollout engine calls
    ``serve_rollouts(make_llm)`` instead of the loop, which returns when the job ends. When
    the job store stays unreachable (the coordinator died and nothing took over), every
    role writes the versions it holds to the export folder (``env.export_dir``, one folder
    per step) and exits (``ExitCode.COORDINATOR_LOST``): ``replica launch --resume``
    continues from there.

    It owns what the script bound (``replicate``), this role's ``replica.Replicator`` (a
    trainer) or ``replica.Mirror`` and durable floor (a standby), the divergence guard's
    record, and the exports; it decides what each call does for the role the process has
    now. Its side of the failovers (heartbeats, the generation, the store's loss) is its
    ``replica.roles.recovery.Recovery``; the faults ``replica launch --inject`` gives it
    (tests, demos) are its ``replica.roles.faults.FaultPlan``."""

    def __init__(self, env: RoleEnv):
        self.env = env
        self.role = env.role
        self.rank = env.rank
        self.store = JobStore(env.store.connect(timeout=timing.ROLE_WAIT), token=env.token).attempt(env.attempt)
        if env.spare is not None:  # a spare standby: the rank comes with its binding (roles/spares.py)
            bound = wait_for_binding(self.store, env)
            if bound is None:
                raise SystemExit(ExitCode.OK)  # the job ended without needing it
            self.env, self.rank, env = bound, bound.rank, bound
        # Present the job's token; a refusal (wrong token, rank taken, job running) raises JoinRefusedError.
        self.member = join(self.store, role=env.role, rank=env.rank, token=env.token, timeout=timing.ROLE_WAIT).member
        self.group: replica.ResilientProcessGroup | None = None
        self._rep: replica.Replicator | None = None
        self._mirror: replica.Mirror | None = None
        self._floor: Floor | None = None  # a standby's durable floor (--durable)
        self._exported = False
        self._faults = FaultPlan(env.faults, role=self, rank=self.rank, store=self.store)
        self._recovery = Recovery(
            self,
            store=self.store,
            rank=self.rank,
            member=self.member,
            export_dir=env.export_dir,
            export_held=self._export_held,
        )
        self._recovery.start()  # beat from the moment it is a member: the coordinator's deadline runs from the join
        # A lost standby is replaced by the launcher: wait for it rather than fail the trainer.
        config = replica.Config(
            token=env.token, host=env.host, standby_wait=timing.STANDBY_WAIT, commit_timeout=timing.COMMIT_WAIT
        )
        # The job's backends (--backends), else Config's own.
        self.config = dataclasses.replace(config, backends=env.backends) if env.backends else config
        # gloo fails a frozen peer's collective at its timeout; NCCL's watchdog never beats the coordinator.
        self.group = (
            None
            if env.role == Role.ROLLOUT
            else replica.init_resilient_process_group(
                store=self.store.sub(keys.process_group()),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timing.PROCESS_GROUP_TIMEOUT,
                nccl_timeout=timing.NCCL_TIMEOUT,
                generation=0 if env.role == Role.TRAINER else None,
                ready_timeout=timing.ROLE_WAIT,
            )
        )
        # What replicate() bound: the model, the optimizer and the extras (prepared).
        self._bound: tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]] | None = None
        self._step = 0
        self._resumed_from = 0  # the step of the export this job started from (--resume)
        self._on_restore: list[Callable[[int], None]] = []
        self._losses: dict[int, str] = {}  # step -> the loss this process logged for it (hex)
        self._redo_in_store: set[int] = set()  # steps a promoted standby redoes that its trainer logged
        self._divergences_seen = 0  # of self._rep.divergences, those reported
        self._warmed: WarmUp | None = None  # what this standby's warm-up did
        # The divergence guard's record of each forward's inputs (a standby's warm-up is not one of the job's).
        self._inputs = InputDigests(skip=lambda: self.group is not None and self.group.rehearsing)

    # --- what the script calls ---

    def replicate(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Mapping[str, object]) -> Job:
        """Mirror ``model``, ``optimizer`` and ``extra`` (``Stateful`` objects: LR schedulers,
        ``replica.RNGState()``, and data loaders, which are wrapped in ``replica.Batches``:
        take the batches from ``next_batch(name)``). Everything that feeds the loss must be
        in there; see docs/mirror.md, "What must be in the mirrored state"."""
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
            self._mirror = replica.Mirror(
                rank=self.rank,
                world_size=self.env.world_size,
                store=self.store,
                config=self.config,
                model=model,
                optimizer=optimizer,
                device=self.env.mirror_device or None,
            )
            if self.env.durable is not None:  # the floor: some of the versions it holds, written to disk
                self._floor = Floor(self._mirror, self.env.durable, on_written=self._faults.on_written)
        self._faults.install(model, optimizer, step=lambda: self._step)
        self._inputs.attach(model)
        return self

    def batches(self, name: str) -> Batches:
        """The job's iterator over the data loader passed as ``extra[name]``: after a
        failover its next batch is the one the failure-free run took."""
        _, _, extra = self._replicated("batches()")
        found = extra.get(name)
        if not isinstance(found, Batches):
            loaders = sorted(k for k, v in extra.items() if isinstance(v, Batches))
            raise KeyError(f"extra[{name!r}] is not a data loader (the loaders passed to replicate(): {loaders})")
        return found

    def next_batch(self, name: str) -> Any:
        """The next batch of the data loader passed as ``extra[name]`` (``batches(name)``)."""
        return next(self.batches(name))

    def warm_up(self, step: Callable[[], object]) -> WarmUp | None:
        """On a standby, run ``step()`` once now, while it waits for a promotion, so that the
        first step after a failover does not pay for ``torch.compile`` (tracing, code
        generation) and CUDA's first-step work: a forward and a backward on a sample batch of
        the real shapes, no optimizer step. Its collectives complete without communicating
        (its loss and gradients are garbage); afterwards the gradients are dropped and every
        global RNG is as before. Batches from the job's loaders, ``log``, ``commit`` and an
        optimizer step are refused inside it (``replica.mirror.warmup``). A trainer returns
        None at once (its first step compiles). A promotion that comes meanwhile waits for it.
        The promoted standby says so if its first step compiled graphs the warm-up did not."""
        model, optimizer, extra = self._replicated("warm_up()")
        if self.role != Role.STANDBY:
            return None
        self._warmed = warm_up(step, model=model, optimizer=optimizer, extra=extra, group=process_group(self))
        logger.info(
            "[standby rank %d] warmed up in %.1f s (%d graphs compiled)",
            self.rank,
            self._warmed.seconds,
            self._warmed.graphs,
        )
        return self._warmed

    def _replicated(self, what: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
        """What ``replicate()`` bound (model, optimizer, extra); ReplicaError naming ``what`` before it."""
        if self._bound is None:
            raise replica.ReplicaError(f"{what} before replicate()")
        return self._bound

    def _replicator(self) -> replica.Replicator:
        """This trainer's replicator (``replicate()`` starts a trainer's, a promotion a standby's)."""
        if self._rep is None:
            raise replica.ReplicaError(f"this {self.role} process has no replicator: a trainer's starts in replicate()")
        return self._rep

    def _not_warming(self, what: str) -> None:
        if self.group is not None and self.group.rehearsing:  # a warm-up step runs now
            raise replica.ReplicaError(f"{what}() inside warm_up(): a warm-up step's loss and state are garbage")

    def _first_step_compiled(self, graphs: int) -> None:
        """A promoted standby's first step compiled ``graphs`` graphs, inside the failover."""
        if graphs <= 0:
            return
        if self._warmed is None:
            logger.warning(
                "[trainer rank %d] the promoted standby's first step compiled %d torch.compile graph(s) "
                "inside the failover; job.warm_up(step) compiles them while the standby waits "
                "(docs/mirror.md)",
                self.rank,
                graphs,
            )
        else:
            logger.warning(
                "[trainer rank %d] the promoted standby's first step compiled %d torch.compile graph(s) "
                "its warm-up did not: give warm_up() a batch of the real shapes and the step's whole "
                "code path (docs/mirror.md)",
                self.rank,
                graphs,
            )

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
        assert snapshot.step is not None  # load_export refuses a file without its step
        model, optimizer, extra = self._replicated("_resume()")
        restore_snapshot(snapshot, model, optimizer, extra, rank=self.rank, world_size=self.env.world_size)
        self._start_replicator((snapshot, None))
        self._replicator().protect()
        self._resumed_from = snapshot.step
        logger.warning("[trainer rank %d] resumed from the export of step %d in %s", self.rank, snapshot.step, folder)

    def commit(self, step: int) -> bool:
        """Snapshot the state after step ``step`` and stream it to this rank's standby in the
        background (``replica.Replicator.commit``): waits only for the global commit of the
        previous one; False, committing nothing, when the step ran in a failed generation
        (``steps()`` then redoes it)."""
        self._not_warming("commit")
        self._faults.fire(Phase.COMMIT, step)
        self._check_inputs(step)  # a loop that logs no loss (log() checks them first otherwise)
        rep = self._replicator()
        try:
            with self._recovery.store_guard():
                done = rep.commit(step)
        except replica.LayoutMismatchError as exc:
            self._report_fatal(exc)
            raise
        except FencedError:  # its standby or the commit record says the rank belongs to another process
            self._recovery.fenced_exit()
        for found in rep.divergences[self._divergences_seen :]:
            self._divergence(found)
        self._divergences_seen = len(rep.divergences)
        self._faults.fire(Phase.MIRROR, step)  # the stream of this step is in flight now
        return done

    # --- the divergence guard ---

    def _check_loss(self, step: int, now: str) -> None:
        before = self._losses.get(step)
        if before is None and step in self._redo_in_store:  # a promoted standby: its trainer logged it
            self._redo_in_store.discard(step)
            logged = self.store.get(keys.loss(self.rank, step))
            before = logged.value.split(" ")[0] if logged is not None else None
        if before is not None and before != now:
            self._divergence(
                Divergence(
                    rank=self.rank,
                    step=step,
                    measure=Measure.LOSS,
                    before=before,
                    after=now,
                    comparable=comparable(self._replicated("log()")[0]),
                )
            )
        self._losses[step] = now
        for old in sorted(self._losses)[:-_LOSSES_KEPT]:
            del self._losses[old]

    def _check_inputs(self, step: int) -> None:
        mismatch = self._inputs.settle(step)
        if mismatch is not None:
            model = self._replicated("log() or commit()")[0]
            self._divergence(
                Divergence(
                    rank=self.rank,
                    step=step,
                    measure=Measure.INPUT,
                    before=mismatch.before,
                    after=mismatch.after,
                    comparable=comparable(model),
                    where=f"{mismatch.what} of forward {mismatch.forward} of the step",
                )
            )

    def _divergence(self, found: Divergence) -> None:
        """One loud line (the replicator logs what it finds itself), a record in the job
        report, and under --strict the job's end."""
        if found.measure in (Measure.LOSS, Measure.INPUT):
            (logger.error if found.comparable else logger.info)(
                "[%s rank %d] %s", self.role, self.rank, found.describe()
            )
        self.store.put(keys.divergence(self.rank, found.step, found.measure.value), Text(value=found.to_json()))
        if self.env.strict and found.comparable:
            self._report_fatal(DivergenceError(found.describe()))
            logger.error("[%s rank %d] --strict: the job ends (exit code %d)", self.role, self.rank, ExitCode.DIVERGED)
            exit_now(ExitCode.DIVERGED)

    def _restored_to(self, step: int) -> None:
        for callback in self._on_restore:
            callback(step)

    def log(self, step: int, loss: torch.Tensor | float, **metrics: float) -> None:
        """Record the step's loss exactly (a float's hex form) and any other metrics
        (``reward=...``) for the job report. A step redone after a failover is checked
        against the loss it had before (the divergence guard)."""
        # Reading the loss waits for the step's kernels, after which NCCL has reported any failure.
        self._not_warming("log")
        value = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        with self._recovery.store_guard():
            self._log(step, value, metrics)

    def _log(self, step: int, value: float, metrics: Mapping[str, float]) -> None:
        if process_group(self).check() is None:
            self._check_inputs(step)
            self._check_loss(step, value.hex())
            # One store round trip a step: the loss, when the step ended, the metrics.
            extra = "".join(f" {k}={float(v).hex()}" for k, v in sorted(metrics.items()))
            self.store.put(keys.loss(self.rank, step), Text(value=f"{value.hex()} {time.time()!r}{extra}"))

    def rollout_client(
        self, model: torch.nn.Module, *, num_shards: int, name_map=None, dtype: torch.dtype | None = None
    ) -> RolloutClient:
        """Weight sync to the job's rollout engines and generation requests to them
        (every trainer rank, and every standby, which uses it once promoted)."""
        sync = replica.WeightSync(
            model,
            store=self.store,
            num_engines=self.env.rollouts,
            config=self.config,
            rank=self.rank,
            name_map=name_map,
            dtype=dtype,
            epoch=self.epoch,
        )
        return RolloutClient(
            store=self.store,
            sync=sync,
            num_shards=num_shards,
            token=self.env.token,
            num_engines=self.env.rollouts,
            epoch=lambda: process_group(self).generation,
            abort=self._step_failed,
        )

    def _step_failed(self) -> bool:
        """The step in progress failed (a trainer died): it is redone after the failover, and
        what its rollout client answers from now on are placeholders, which the divergence
        guard must not take for the step's inputs."""
        failed = process_group(self).errored is not None or self._recovery.failover_announced()
        if failed:
            self._inputs.void()
        return failed

    def serve_rollouts(self, make_llm) -> None:
        """The rollout role: run the engine ``make_llm()`` builds and serve until the job ends."""
        if self.role != Role.ROLLOUT:
            raise replica.ReplicaError(f"serve_rollouts() in a {self.role} process")
        try:
            serve_rollouts(
                store=self.store,
                index=self.rank,
                num_engines=self.env.rollouts,
                token=self.env.token,
                make_llm=make_llm,
                host=self.env.host,
                backends=self.env.backends or None,
                stop=lambda: self.store.has(keys.finished()) or self.store.has(keys.rollout_stop(self.rank)),
                retiring=lambda: not self.store.has(keys.finished()),
                on_shard=self._faults.on_shard,
            )
        finally:
            self.close()

    def steps(self, total: int | None = None) -> Iterator[int]:
        """The steps this role trains, up to ``total`` (default: the job's, ``env.steps``:
        ``replica launch --steps``): from the first after a resume, a standby's from the one
        after its promotion, a step again after a failover rolled the job back to it."""
        total = self.env.steps if total is None else total
        step = self._resumed_from + 1
        graphs = None  # a promoted standby's compiled graphs before its first step
        if self.role == Role.STANDBY:
            promoted = self._promote()
            if promoted is None:
                return
            step, graphs = promoted + 1, compiled_graphs()
        while step <= total:
            self._step = step
            self._inputs.begin(step)
            self._faults.fire(Phase.FORWARD, step)
            yield step
            if graphs is not None:
                self._first_step_compiled(compiled_graphs() - graphs)
                graphs = None
            group = process_group(self)
            with self._recovery.store_guard():
                if group.check() is not None or self._recovery.failover_announced():
                    step = self._recover() + 1
                    continue
                if group.generation > 0 and not self.store.has(keys.resumed(group.generation)):
                    self.store.put(keys.resumed(group.generation), Stamp(at=time.time()))
            step += 1
        with self._recovery.store_guard():
            self._replicator().wait_committed()
            self.store.put(keys.done(self.rank), Flag())
            self.store.count(keys.done_count(), 1)
        self.close()

    def close(self) -> None:
        """Stop heartbeats, streams and listeners (the script's end does this itself)."""
        self._recovery.close()
        for closeable in (self._floor, self._rep, self._mirror):
            if closeable is not None:
                closeable.close()
        self._rep = self._mirror = self._floor = None
        if self.group is not None:
            self.group.shutdown()

    # --- failover ---

    def epoch(self) -> Epoch:
        """This process's epoch: the generation it trains in and its member id."""
        return Epoch(generation=process_group(self).generation, member=self.member)

    def _start_replicator(self, held: tuple[replica.Snapshot, replica.Snapshot | None] | None = None) -> None:
        model, optimizer, extra = self._replicated("_start_replicator()")
        self._divergences_seen = 0
        self._rep = rep = replica.Replicator(
            model,
            optimizer,
            extra,
            store=self.store,
            config=self.config,
            rank=self.rank,
            world_size=self.env.world_size,
            epoch=self.epoch,
        )
        rep.interrupted = self._recovery.failover_announced
        if held is not None:
            rep.adopt(*held)

    def _recover(self) -> int:
        """A survivor's failover (its step failed): rolled back to the commit the coordinator
        fixed and in the next generation; returns the step restored."""
        restored, generation = self._recovery.rejoin(lambda commit: self._replicator().rollback(step=commit))
        self._replicator().protect()  # a standby that does not hold the commit (a new one) receives it first
        self._restored_to(restored)
        logger.warning("[trainer rank %d] survived: rolled back to %d, generation %d", self.rank, restored, generation)
        return restored

    def _promote(self) -> int | None:
        """A standby's wait for its promotion, then its rank taken over (the commit restored
        from the mirror, the new generation joined, a trainer from now on); returns the
        commit, or None when the job ended first (the job is closed)."""
        found = self._recovery.wait_promotion(self._serve_export, self._faults.while_waiting())
        if found is None:
            self.close()
            return None
        generation, commit = found
        model, optimizer, extra = self._replicated("steps()")
        mirror = self._mirror
        if mirror is None:  # replicate() publishes a standby's
            raise replica.ReplicaError(f"standby rank {self.rank} was promoted without a mirror to restore from")

        def restore(step: int) -> None:
            mirror.restore(model, optimizer, extra, step=step, rank=self.rank, world_size=self.env.world_size)

        try:
            restore(commit)
        except replica.LayoutMismatchError as exc:
            self._report_fatal(exc)
            raise
        generation, commit = self._recovery.join_promoted(generation, commit, restore)
        # The committed version restored from stays this rank's copy of the commit (no copy),
        # the other version takes the next step; closing the mirror waits for its threads.
        if self._floor is not None:  # a trainer now: its new standby writes the rank's floor
            floor, self._floor = self._floor, None
            threading.Thread(target=floor.close, daemon=True, name="replica-floor-close").start()
        held = mirror.hand_over(commit)
        self._mirror = None
        threading.Thread(target=mirror.close, daemon=True, name="replica-mirror-close").start()
        self.role = Role.TRAINER
        self._start_replicator(held)
        self._replicator().protect()  # the rank's new standby receives the commit first: it has two copies again
        # The steps after the commit that the rank's last trainer logged are redone here: the
        # guard checks them against its losses (at most the two in flight when it died).
        self._redo_in_store = {commit + 1, commit + 2}
        self._restored_to(commit)
        logger.warning(
            "[standby rank %d] promoted to trainer at commit %d, generation %d", self.rank, commit, generation
        )
        return commit

    def _report_fatal(self, exc: Exception) -> None:
        """An error no failover can fix (the roles disagree on the model): the job must stop."""
        message = f"{self.role} rank {self.rank}: {exc}"
        logger.error("[%s rank %d] fatal: %s", self.role, self.rank, exc)
        self.store.put(keys.fatal(), Text(value=message))

    # --- exports ---

    def _holder(self) -> replica.Mirror | replica.Replicator | None:
        """What holds this role's versions: a standby's mirror, a trainer's replicator."""
        return self._mirror if self._mirror is not None else self._rep

    def _serve_export(self, store: JobStore) -> None:
        """A waiting standby's look (over ``store``): the job is ending and asks for the
        commit's export (a rank's state is lost)."""
        if not self._exported and (request := store.get(keys.export())) is not None:
            self._export(request.directory, [request.commit])

    def _export_held(self) -> None:
        """Every version this role holds, to the export folder (the job store is gone)."""
        if (holder := self._holder()) is not None:
            self._export(self.env.export_dir, holder.held_steps())

    def _export(self, directory: str, steps: list[int]) -> None:
        """Write this role's versions of ``steps`` to the job's export folder (one folder
        per step, ``replica.state.export.step_folder``), and say in the store what was written."""
        self._exported = True
        holder = self._holder()
        if holder is None:  # a standby's mirror, a trainer's replicator: replicate() made it
            raise replica.ReplicaError(f"{self.role} rank {self.rank} holds no versions to export")
        outcomes = []
        for step in steps:
            try:
                path = holder.export(step_folder(directory, step), step=step)
                outcomes.append(ExportOutcome(rank=self.rank, step=step, status=ExportStatus.WRITTEN, path=str(path)))
                logger.warning("[%s rank %d] exported step %d to %s", self.role, self.rank, step, path)
            except replica.ReplicaError as exc:
                outcomes.append(ExportOutcome(rank=self.rank, step=step, status=ExportStatus.FAILED, error=str(exc)))
                logger.error("[%s rank %d] could not export step %d: %s", self.role, self.rank, step, exc)
        with contextlib.suppress(RuntimeError):  # the store may be gone (that may be why it exports)
            for outcome in outcomes:
                self.store.put(keys.exported(self.rank, outcome.step), outcome)


def init() -> Job:
    """Join the job ``replica launch`` (or a torchrun-style environment) describes. A role
    prints every thread's Python stack to stderr on SIGUSR1 (``kill -USR1 PID``: where is
    it stuck?)."""
    configure_logging()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return Job(RoleEnv.from_environ())
