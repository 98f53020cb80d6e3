"""Which of several ``replica coordinator`` processes leads, on etcd.

The leader holds a claim, ``keys.coordinator()``: a signed value naming it,
unique to this incarnation. Every write the leader makes to the job store is
fenced by it (``EtcdStore.fenced``: the write and a comparison of the claim in
one etcd transaction), so a leader that lost the claim changes nothing more and
learns so at its next write (``FencedError``): there is never a second
coordinator whose decisions land, whatever the clocks and pauses.

Liveness: the leader raises ``keys.coordinator_beat()`` every ``BEAT`` from a
thread of its own. A waiting candidate that sees the beat unchanged for
``SILENCE`` on its own clock replaces the claim (compare-and-set on the claim it
saw) and leads, from the state in the store. A leader that was only slow (a
loaded machine) finds itself fenced and stops; the job goes on under the new one.
Clocks need not agree between hosts. An etcd leader lost at the same time (its
member on the coordinator's host) costs its election (~1.2 s), which runs while
the silence is counted.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from replica.errors import FencedError, JobStoreInUseError
from replica.jobstore import JobStore, Number, Text, keys
from replica.jobstore.etcd import EtcdStore
from replica.jobstore.stores import StoreAddress
from replica.timing import Deadline, pause

__all__ = ["BEAT", "Leadership", "SILENCE", "lead_new_job"]

logger = logging.getLogger(__name__)

BEAT = timedelta(milliseconds=200)
SILENCE = timedelta(seconds=2)  # >= 10 beats: a loaded machine's pause is not a dead coordinator
CAMPAIGN_POLL = timedelta(milliseconds=100)


class Leadership:
    """This process's candidacy: ``campaign()`` blocks until it leads (or gives up);
    then ``store`` is the job store fenced by its claim, ``leading()`` says whether it
    still leads, ``resign()`` hands over at once."""

    def __init__(self, store: JobStore):
        if not isinstance(store.raw, EtcdStore):
            raise TypeError("an election needs the job store on etcd")
        self.candidate = store
        self._raw = store.raw  # the candidate's store, as the EtcdStore it is
        self.name = f"{socket.gethostname()} pid {os.getpid()}"
        self._claim = store.sign(keys.coordinator(), Text(value=f"{self.name} {secrets.token_hex(8)}"))
        self._key = store.full(keys.coordinator())
        #: The job store as the leader writes it (fenced by the claim); None until it leads.
        self.store: JobStore | None = None
        self._deposed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def claim(self) -> tuple[str, bytes]:
        """The fence of every write the leader makes (``EtcdStore.fenced``)."""
        return self._key, self._claim

    def campaign(self, *, timeout: timedelta, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Block until this candidate leads (True), ``give_up()`` says stop or ``timeout`` passed (False)."""
        raw = self._raw
        deadline = Deadline.after(timeout)
        beat_key = self.candidate.full(keys.coordinator_beat())
        seen: tuple[bytes | None, bytes | None] | None = None
        changed_at = read_at = time.monotonic()
        shown = False
        while not deadline.expired and not give_up():
            try:
                holder, beat = raw.read([self._key, beat_key])
                if (holder, beat) != seen:
                    # It changed after the last read that answered: when etcd did not answer for a
                    # while (its leader lost with the coordinator's host), not at the end of that gap.
                    seen, changed_at = (holder, beat), read_at
                read_at = time.monotonic()
                silent = read_at - changed_at
                if holder is None or silent >= SILENCE.total_seconds():
                    if raw.compare_set(self._key, holder or b"", self._claim) == self._claim:
                        if holder is not None:
                            logger.warning(
                                "the coordinator that led sent no beat for %.1f s: this one takes over", silent
                            )
                        self._lead()
                        return True
                elif not shown:
                    who = self.candidate.get(keys.coordinator())
                    logger.warning(
                        "another coordinator leads (%s): this one waits to take over",
                        who.value.rsplit(" ", 1)[0] if who is not None else "unverified",
                    )
                    shown = True
            except (RuntimeError, OSError) as exc:  # etcd electing a leader, a member lost: look again
                logger.info("campaign: %s", exc)
            pause(CAMPAIGN_POLL, deadline=deadline)
        return False

    def _lead(self) -> None:
        self.store = store = self.candidate.on(self._raw.fenced(*self.claim))
        self._thread = threading.Thread(target=self._beat, args=(store,), name="replica-coordinator-beat", daemon=True)
        self._thread.start()

    def leading(self) -> bool:
        return self.store is not None and not self._deposed.is_set()

    def deposed(self, exc: FencedError) -> None:
        """A fenced write failed: another coordinator leads now."""
        if not self._deposed.is_set():
            logger.error("this coordinator was replaced: %s", exc)
        self._deposed.set()

    def resign(self) -> None:
        """Stop beating and withdraw the claim (another candidate leads at once)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.store is not None and not self._deposed.is_set():
            try:
                self._raw.remove(self._key, self._claim)
            except Exception as exc:  # noqa: BLE001 - the others take over after SILENCE instead
                logger.warning("could not withdraw the coordinator's claim: %s", exc)
        self._deposed.set()

    def _beat(self, leader: JobStore) -> None:
        """The leader's beat (``leader``: the store fenced by its claim), until ``resign``."""
        store = leader.reconnect(timedelta(seconds=1))  # a connection of its own, fenced the same
        beat = 0
        while not self._stop.wait(BEAT.total_seconds()):
            try:
                beat += 1
                store.put(keys.coordinator_beat(), Number(value=beat))
            except FencedError as exc:
                self.deposed(exc)
                return
            except Exception as exc:  # noqa: BLE001 - the next beat tries again
                logger.warning("the coordinator's beat failed: %s", exc)


def lead_new_job(address: StoreAddress, token: bytes, *, connect: timedelta = timedelta(seconds=60)) -> Leadership:
    """Claim the lead of a new job in an etcd namespace, for a launcher (which starts the
    job's roles, so it never takes over a running job). JobStoreInUseError if the namespace
    holds a job already (running or finished) or another coordinator leads it (its beat
    is heard for ``SILENCE``). The caller resigns when the job ends."""
    leadership = Leadership(JobStore(address.connect(timeout=connect), token=token))
    if leadership.candidate.has(keys.generation()):
        raise JobStoreInUseError(
            f"the job store {address} holds a job already: give each job a namespace of its "
            "own (etcd://HOSTS/NAMESPACE); `replica coordinator --store` takes over a running one"
        )
    if not leadership.campaign(timeout=SILENCE * 2):
        raise JobStoreInUseError(
            f"another coordinator leads the job store {address}: give each job a namespace of "
            "its own (etcd://HOSTS/NAMESPACE)"
        )
    return leadership
