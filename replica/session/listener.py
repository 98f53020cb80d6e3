"""``Listener``: the receiving side's server, shared by the standby's ``Mirror``
and the engine's ``WeightReceiver``. It listens on the transport chosen for its
memory kind (loopback unless ``Config.host`` says otherwise) and, when that one may
refuse a peer (shm: another user or PID namespace), on the next that fits too, which
connectors fall back to (``replica.session.backends.connect``). It runs each accepted
connection's session on a thread of its own, and outlives a bad session: a
peer that vanishes or misbehaves is logged, never raised."""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from datetime import timedelta

from replica.config import Config
from replica.errors import PeerDisconnectedError, ReplicaError, TransferTimeoutError, TransportError
from replica.session.backends import choose_backends, locality_of, make_backend
from replica.transport import Connection, MemoryKind, Transport

__all__ = ["Listener"]

logger = logging.getLogger(__name__)

# Bounds how long close() waits for the accept loop. Handshakes run on the
# transport's own threads under their own deadline (EndpointConfig.handshake_timeout):
# accept() only hands out connections that finished one, so this poll is never
# a peer's budget, and a slow or silent peer delays no other.
_ACCEPT_POLL = timedelta(seconds=0.1)


class Listener(ABC):
    def __init__(self, *, config: Config, memory: MemoryKind, name: str):
        self.config = config
        self.name = name  # how logs name it: "standby rank 0", "engine 1"
        self.backend, fallback = choose_backends(config, memory, locality_of(config.host))
        self._transports: list[Transport] = [make_backend(self.backend, config)]
        #: Where it also listens, for peers its backend refuses: (backend, address), or None.
        self.fallback: tuple[str, str] | None = None
        try:
            self.address = self._transports[0].listen()
            if fallback is not None:
                self._listen_also(fallback)
        except BaseException:
            for transport in self._transports:
                transport.close()
            raise
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._threads: list[threading.Thread] = []

    def _listen_also(self, backend: str) -> None:
        """Listen on ``backend`` too, as the fallback; without it (a backend that cannot start
        here) peers of this process's memory still connect, the others are refused."""
        try:
            transport = make_backend(backend, self.config)
        except TransportError as exc:
            logger.warning("[%s] no fallback for peers %s refuses: %s", self.name, self.backend, exc)
            return
        self._transports.append(transport)
        self.fallback = (backend, transport.listen())

    def _start(self) -> None:
        """Begin accepting (once the subclass has published where it listens): a thread per transport."""
        self._threads = [
            threading.Thread(target=self._serve, args=(transport,), name=f"replica-{self.name}", daemon=True)
            for transport in self._transports
        ]
        for thread in self._threads:
            thread.start()
        also = f", and on {self.fallback[1]} ({self.fallback[0]}) for peers it refuses" if self.fallback else ""
        logger.info("[%s] listening on %s (%s)%s", self.name, self.address, self.backend, also)

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        for transport in self._transports:
            transport.close()
        for thread in self._threads:
            thread.join(timeout=10)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @abstractmethod
    def _session(self, conn: Connection) -> None:
        """Serve one connection until it ends (raise to end it)."""

    def _held(self) -> str:
        """What it still holds when a session ends, for the log."""
        return ""

    def _peer_lost(self, conn: Connection, exc: PeerDisconnectedError) -> None:
        """A session's peer went away (``exc.graceful`` says whether it said goodbye); a subclass
        that keeps per-peer state overrides it, the others need nothing."""
        return

    def _serve(self, transport: Transport) -> None:
        sessions: list[threading.Thread] = []
        while not self._closed.is_set():
            try:
                conn = transport.accept(_ACCEPT_POLL)
            except TransferTimeoutError:
                continue
            except (ReplicaError, OSError) as exc:
                if self._closed.is_set():
                    break
                logger.warning("[%s] refused a connection: %s", self.name, exc)
                continue
            sessions = [t for t in sessions if t.is_alive()]
            sessions.append(
                threading.Thread(
                    target=self._run_session, args=(conn,), daemon=True, name=f"replica-{self.name}-session"
                )
            )
            sessions[-1].start()
        for t in sessions:
            t.join(timeout=10)

    def _run_session(self, conn: Connection) -> None:
        try:
            self._session(conn)
        except PeerDisconnectedError as exc:
            if not self._closed.is_set():
                # A peer that said goodbye (its job ended, a newer sender took over) is no news.
                logger.log(
                    logging.INFO if exc.graceful else logging.WARNING,
                    "[%s] peer gone (%s)%s",
                    self.name,
                    exc,
                    self._held(),
                )
                self._peer_lost(conn, exc)
        except (ReplicaError, ValueError) as exc:
            logger.error("[%s] session ended: %s%s", self.name, exc, self._held())
        except Exception:
            logger.exception("[%s] session failed", self.name)
        finally:
            conn.close()
