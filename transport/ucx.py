"""UCX backend (UCXX): a TCP control channel for the handshake and liveness,
and a UCX data endpoint made from the peer's worker address.

The data endpoint runs without UCX endpoint error handling by default: with it
UCX restricts itself to tcp (~1 GB/s here), without it UCX may use shared
memory (posix/sysv, ~10 GB/s here) on one node and RDMA or cuda_ipc where present.
Such an endpoint never notices a dead peer by itself; the control socket does,
within milliseconds, and a deadline on every wait catches a frozen one.

A peer killed while writing into this worker's shared-memory receive FIFO
leaves a slot that is never completed, and every later message to this worker
waits behind it. So a connection that ends without the peer's goodbye retires
the worker it ran on: later connections get a fresh worker (a new address and
FIFO), and the retired one stops once its last connection is gone.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from replica.errors import PeerDisconnectedError, TransportError
from replica.timing import Backoff, Deadline
from replica.transport.base import Capabilities, Locality, MemoryKind
from replica.transport.control import ControlledConnection, ControlledTransport, EndpointConfig
from replica.transport.framing import GRACEFUL

__all__ = ["UcxConfig", "UcxConnection", "UcxTransport"]

logger = logging.getLogger(__name__)

_KIND_PAYLOAD = 0
_KIND_HEADER = 1
# How long a connection's release waits for the progress thread to run each of
# its cancel and close steps (ns, as ucxx takes it): moments, unless that thread is stuck.
_CLOSE_WAIT_NS = 2_000_000_000
# A peer that said goodbye sent everything before it: receives still posted when its goodbye
# is read may only wait for the progress thread to complete them (late on a loaded machine;
# failing the connection would cancel them, data and all). They get this long first.
_DRAIN_AFTER_BYE = timedelta(milliseconds=500)


# repr=False keeps EndpointConfig.__repr__, which leaves the token out.
@dataclass(kw_only=True, frozen=True, slots=True, repr=False)
class UcxConfig(EndpointConfig):
    """Settings of one process's UCX transport. UCX options go to this
    transport's context only; nothing is read from or written to the environment."""

    # UCX_TLS towards peers on this host. Without endpoint error handling a failed
    # process_vm_readv is fatal in UCX's cma transport: a peer killed mid-transfer
    # would abort this process. The shared-memory FIFOs (posix, sysv) have no
    # such call on the peer and measured faster here (~10 vs ~5.5 GB/s).
    ucx_transports: str = "^cma,knem,xpmem"
    # UCX_TLS towards a peer on another host (its address is not one of this
    # host's): shared memory and CUDA IPC reach only this host's processes. UCX
    # tells hosts apart by boot id, which containers and network namespaces on one
    # machine share: there it would pick shared memory for a "remote" peer.
    remote_transports: str = "^sm,cuda_ipc"
    # False: every peer is reached as if on another host (remote_transports), for peers
    # that cannot map this process's memory though they share its host (another user,
    # another PID namespace: UCX's shared-memory transports would time out there).
    share_memory: bool = True
    data_error_handling: bool = False
    # The progress thread sleeps in epoll and wakes at least every
    # epoll_timeout_ms (a missed wake-up costs at most that); polling burns a
    # whole core even when idle, which a trainer sharing its CPUs cannot afford.
    # Measured here, 64-512 MiB over shared memory: 8-9.3 GB/s blocking (1 ms)
    # against 5.9-7.9 polling; idle cost 1.5% of a core against 100%.
    polling_progress: bool = False
    epoll_timeout_ms: int = 1
    # UCX's progress thread queries the CUDA events of its device copies
    # (cuda_copy, cuda_ipc), which needs a CUDA context current on that thread:
    # it gets the primary context of the GPU current when the transport is made.
    # This creates the CUDA context in this process; a host-only process on a
    # GPU machine may turn it off.
    cuda_progress_context: bool = True

    def __post_init__(self) -> None:
        super(UcxConfig, self).__post_init__()
        if self.epoll_timeout_ms < 1:
            raise ValueError(f"epoll_timeout_ms must be >= 1, got {self.epoll_timeout_ms}")


def _ucx():
    import ucxx._lib.libucxx as ucx  # imported late: it loads libucx

    return ucx


def _array(flat: torch.Tensor):
    from ucxx._lib.arr import Array

    # Zero-copy: numpy view of host memory, __cuda_array_interface__ for CUDA.
    return Array(flat.numpy() if flat.device.type == "cpu" else flat)


def _settle(ready) -> None:
    """Wait for ``ready`` (``replica.transport.base.ready_event``: the buffer's producers,
    or the work queued on it before a receive), if any.

    torch's ``__cuda_array_interface__`` carries no stream and UCX copies on
    streams of its own, so without this a send could read a bucket that kernels
    still write, and a receive could be overwritten by work queued before it.
    Only that event: a thread's current stream may hold work queued since (the
    next training step). The other direction needs nothing: UCX completes a
    request only once its copies have run, so work queued after completion sees the bytes.
    """
    if ready is not None:
        ready.synchronize()


def _bind_cuda_context(device: int) -> None:
    """Progress-thread start callback: make ``device``'s primary context current
    on this thread. Through the driver API, as UCX uses it: torch's set_device
    skips cudaSetDevice when the thread's device already matches (0 on a new
    thread), which would leave the thread without a context."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        for name, call in (
            ("cuInit", lambda: cuda.cuInit(0)),
            ("cuDeviceGet", lambda: cuda.cuDeviceGet(ctypes.byref(dev), device)),
            ("cuDevicePrimaryCtxRetain", lambda: cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)),
            ("cuCtxSetCurrent", lambda: cuda.cuCtxSetCurrent(ctx)),
        ):
            status = call()
            if status != 0:
                raise OSError(f"{name} returned CUDA error {status}")
    except Exception as exc:  # noqa: BLE001 - without it host transfers still work; say why CUDA ones may not
        logger.warning("UCX progress thread has no CUDA context for cuda:%d (%s); CUDA transfers may fail", device, exc)


def _endpoint_closed(conn_ref: weakref.ref) -> None:
    """UCX's close callback, run on the progress thread inside UCX's progress: the
    connection is released on a thread of its own, as releasing waits for posts
    that may wait for that progress."""
    conn = conn_ref()
    if conn is not None and conn.alive:
        threading.Thread(
            target=conn._peer_lost, args=("UCX endpoint closed",), daemon=True, name="replica-ucx-closed"
        ).start()


class _Requests:
    """The UCX requests of one posted piece and the buffers they read or write.

    ucxx cancels a request when its last Python reference dies, and a cancel on
    any thread but the progress thread can deadlock with that thread completing
    the same request: the cancel holds the request's mutex and waits for the
    worker's lock; progress holds the lock and waits for the mutex (seen: a
    transfer dropped while its connection closed). So requests dropped unfinished
    (a transfer abandoned, a post half made when the connection closed) pass to
    their worker with their buffers, which drops them once they finished."""

    __slots__ = ("_requests", "_keep", "_worker", "__weakref__")

    def __init__(self, worker: _Worker, requests: list, keep):
        self._worker = worker
        self._requests = requests
        self._keep = keep  # buffers UCX reads or writes until the requests finish

    @property
    def finished(self) -> bool:
        """Every request completed (delivered, failed or cancelled)."""
        return all(r.completed for r in self._requests)

    def poll(self) -> bool:
        if not self.finished:
            return False
        for r in self._requests:
            r.check_error()
        self._keep = None
        return True

    def __del__(self) -> None:
        requests = self._requests
        if requests and not all(r.completed for r in requests):
            self._worker.abandon(requests, self._keep)


class _Worker:
    """One UCX worker and its progress thread, shared by connections until a
    peer leaves without saying goodbye (see the module docstring)."""

    def __init__(self, context, config: UcxConfig, locality: Locality):
        ucx = _ucx()
        self.locality = locality  # of the peers it serves
        self.handle = ucx.UCXWorker(context)
        if config.cuda_progress_context and torch.cuda.is_available():
            self.handle.set_progress_thread_start_callback(_bind_cuda_context, cb_args=(torch.cuda.current_device(),))
        if config.polling_progress:
            self.handle.start_progress_thread(polling_mode=True)
        else:
            self.handle.init_blocking_progress_mode()
            self.handle.start_progress_thread(polling_mode=False, epoll_timeout=config.epoll_timeout_ms)
        self.address = bytes(self.handle.address.tobytes())
        self.users = 0  # connections (and handshakes under way) on this worker
        self.retired = False
        self.stopped = False
        # Requests dropped before they finished, with their buffers (see _Requests):
        # `incoming` takes them without a lock, as __del__ runs wherever a reference
        # dies, a collection inside a sweep included; `held` is the sweep's, under its lock.
        self._incoming: collections.deque[tuple[list, Any]] = collections.deque()
        self._held: list[tuple[list, Any]] = []
        self._sweep_lock = threading.Lock()
        self._progress_stopped = False

    @property
    def abandoned(self) -> int:
        """Requests dropped unfinished that have not finished yet."""
        self.release_finished()
        with self._sweep_lock:
            return sum(len(requests) for requests, _ in (*self._held, *self._incoming))

    def abandon(self, requests: list, keep) -> None:
        """Hold ``requests`` (and the buffers in ``keep``) until they finished: their
        peer's message completes them, or their endpoint's close cancels them."""
        if not self._progress_stopped:  # else dropping them cannot deadlock: nothing progresses
            self._incoming.append((requests, keep))
        self.release_finished(wait=False)  # a sweep under way (maybe this very thread's) takes them later

    def release_finished(self, *, wait: bool = True) -> None:
        """Drop the held requests that have finished."""
        if not self._sweep_lock.acquire(blocking=wait):
            return
        try:
            while self._incoming:
                self._held.append(self._incoming.popleft())
            unfinished, finished = [], []
            for entry in self._held:
                (finished if all(r.completed for r in entry[0]) else unfinished).append(entry)
            self._held = unfinished
        finally:
            self._sweep_lock.release()
        del finished  # dropped outside the lock: their cancels find them finished

    def stop(self) -> None:
        with self._sweep_lock:
            if self.stopped:
                return
            self.stopped = True
        self.handle.stop_progress_thread()
        self._progress_stopped = True
        with self._sweep_lock:
            held, self._held = self._held, []
            held.extend(self._incoming)
            self._incoming.clear()
        del held  # no progress thread is left for their cancels to deadlock with


class UcxConnection(ControlledConnection):
    _transport: UcxTransport

    def __init__(self, *, endpoint, worker: _Worker, send_id: int, recv_id: int, **kwargs):
        super().__init__(memory=UcxTransport.capabilities.memory, **kwargs)
        self._endpoint = endpoint
        self._worker = worker
        self._send_id = send_id
        self._recv_id = recv_id
        # UCX crashes the process on a post to an endpoint closed under it, and the
        # close comes from other threads (the control socket's, the caller's):
        # posts and the close take turns on this lock, and nothing is posted after.
        self._posting = threading.Lock()
        self._released = False
        self._receives: weakref.WeakSet[_Requests] = weakref.WeakSet()  # posted, maybe unfinished

    def _tag(self, conn_id: int, tag: int, kind: int):
        # UCX matches tags per worker, not per endpoint: the top 16 bits say
        # which connection a message belongs to (the receiver chose the id).
        return _ucx().UCXXTag((conn_id << 48) | (tag << 8) | kind)

    def _post(self, post: Callable[[Any], Any]):
        with self._posting:
            if self._released:
                raise self._error or PeerDisconnectedError(f"connection to {self.peer} is closed")
            return post(self._endpoint)

    def _isend(self, flat, tag, header, ready):
        _settle(ready)
        keep: list[torch.Tensor | np.ndarray] = [flat]  # the buffers UCX reads until the sends finish
        posted = _Requests(self._worker, [], keep)
        posted._requests.append(
            self._post(lambda ep: ep.tag_send(_array(flat), tag=self._tag(self._send_id, tag, _KIND_PAYLOAD)))
        )
        header_arr = np.frombuffer(header(), dtype=np.uint8).copy()  # outside the lock: it may hash the bucket
        keep.append(header_arr)
        # Refused when the connection closed meanwhile: the close cancelled the
        # payload, which `posted` hands to the worker as it goes.
        posted._requests.append(
            self._post(
                lambda ep: ep.tag_send(
                    _array(torch.from_numpy(header_arr)), tag=self._tag(self._send_id, tag, _KIND_HEADER)
                )
            )
        )
        return posted

    def _irecv(self, flat, tag, header_buf, ready):
        _settle(ready)
        posted = _Requests(self._worker, [], (header_buf, flat))

        def post(ep):
            posted._requests.append(ep.tag_recv(_array(header_buf), tag=self._tag(self._recv_id, tag, _KIND_HEADER)))
            posted._requests.append(ep.tag_recv(_array(flat), tag=self._tag(self._recv_id, tag, _KIND_PAYLOAD)))

        self._post(post)
        self._receives.add(posted)
        return posted

    def _receives_finished(self) -> bool:
        return all(r.finished for r in list(self._receives))

    def _peer_lost(self, reason: str) -> None:
        if reason == GRACEFUL and not self._receives_finished():
            # The connection fails only after the drain: until then a waiter still sees its
            # receive complete, not the error. On a thread of its own: the caller (the control
            # monitor) watches other connections too.
            threading.Thread(
                target=self._drain_then_lost, args=(reason,), daemon=True, name="replica-ucx-drain"
            ).start()
            return
        super()._peer_lost(reason)

    def _drain_then_lost(self, reason: str) -> None:
        """After the peer's goodbye: let the progress thread complete what already arrived."""
        deadline = Deadline.after(_DRAIN_AFTER_BYE)
        polls = Backoff(first=timedelta(milliseconds=1), most=timedelta(milliseconds=10))
        while not deadline.expired and not self._receives_finished():
            polls.sleep(deadline=deadline)
        super()._peer_lost(reason)

    def _release(self) -> None:
        with self._posting:
            self._released = True
            try:
                # ucxx runs both halves on the progress thread while this one waits:
                # cancel the endpoint's requests still posted (receives too, which a
                # plain close leaves posted on the worker), then close it.
                self._endpoint.close_blocking(_CLOSE_WAIT_NS, 1)
            except Exception as exc:  # noqa: BLE001 - a dead peer's endpoint may refuse to close cleanly
                logger.debug("closing UCX endpoint to %s: %s", self.peer, exc)
        self._worker.release_finished()
        self._transport._leave(self._worker)

    def _fail(self, error: TransportError, *, quiet: bool = False) -> None:
        # Retire before the error is seen, so a caller that reconnects at once
        # already gets the fresh worker.
        if self._error is None and not (isinstance(error, PeerDisconnectedError) and error.graceful):
            self._transport._retire(self._worker)
        super()._fail(error, quiet=quiet)


class UcxTransport(ControlledTransport):
    """UCX contexts, workers and progress threads of one process; many connections.

    One context for peers on this host and one for peers on other hosts (made at
    the first), each with the worker its new connections get."""

    capabilities = Capabilities(memory=MemoryKind.HOST | MemoryKind.CUDA, locality=Locality.SAME_NODE | Locality.REMOTE)

    def __init__(self, config: UcxConfig):
        super().__init__(config)
        self.config = config
        self._workers_lock = threading.Lock()
        # Per peer locality (see UcxConfig.remote_transports), made at the first such peer:
        # a context, and the worker new connections get.
        self._contexts: dict[Locality, Any] = {}
        self._current: dict[Locality, _Worker] = {}
        self._workers: list[_Worker] = []  # the current ones and retired ones still in use
        self.retired_workers = 0
        with self._workers_lock:  # fails here, not at the first peer, if UCX cannot start
            self._new_worker(Locality.SAME_NODE if config.share_memory else Locality.REMOTE)

    @property
    def _worker(self) -> _Worker:
        """The worker new connections from this host's processes get."""
        with self._workers_lock:
            return self._current.get(Locality.SAME_NODE) or self._new_worker(Locality.SAME_NODE)

    def _worker_for(self, locality: Locality) -> _Worker:
        """The current worker for ``locality`` (made if none), counted as used."""
        with self._workers_lock:
            worker = self._current.get(locality) or self._new_worker(locality)
            worker.users += 1
            return worker

    def _new_worker(self, locality: Locality) -> _Worker:
        """Under _workers_lock."""
        context = self._contexts.get(locality)
        if context is None:
            ucx = _ucx()
            tls = self.config.ucx_transports if locality is Locality.SAME_NODE else self.config.remote_transports
            context = ucx.UCXContext(
                config_dict={"TLS": tls} if tls else {}, feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP)
            )
            self._contexts[locality] = context
        worker = _Worker(context, self.config, locality)
        self._current[locality] = worker
        self._workers.append(worker)
        return worker

    def _offer(self, server, locality):
        if not self.config.share_memory:
            locality = Locality.REMOTE
        try:
            worker = self._worker_for(locality)
        except Exception as exc:  # ucxx's own errors: no device while the host's link is down, ...
            raise TransportError(f"UCX cannot make a worker for peers of locality {locality.name}: {exc}") from exc
        return worker.address, worker

    def _discard_offer(self, state):
        self._leave(state)

    def _retire(self, worker: _Worker) -> None:
        """Move new connections off ``worker``; it stops when its last one leaves."""
        with self._workers_lock:
            if worker.retired:
                return
            worker.retired = True
            self.retired_workers += 1
            if self._current.get(worker.locality) is worker:
                # The next connection makes a fresh one: made here, a failure (no network
                # device while the link is down) would be this connection's close's.
                del self._current[worker.locality]
        logger.info("a UCX peer left without a goodbye; new connections use a fresh UCX worker")

    def _leave(self, worker: _Worker) -> None:
        """A connection (or a failed handshake) stops using ``worker``."""
        with self._workers_lock:
            worker.users -= 1
            done = worker.retired and worker.users == 0 and worker in self._workers
            if done:
                self._workers.remove(worker)
        if done:
            worker.stop()

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        endpoint = state.handle.create_endpoint_from_worker_address(
            _ucx().UCXAddress.create_from_buffer(peer_offer), self.config.data_error_handling
        )
        conn = UcxConnection(
            transport=self,
            sock=sock,
            peer=peer,
            endpoint=endpoint,
            worker=state,
            send_id=send_id,
            recv_id=recv_id,
            verify=self.config.verify,
            verify_threads=self.config.verify_threads,
        )
        if self.config.data_error_handling:
            endpoint.set_close_callback(_endpoint_closed, cb_args=(weakref.ref(conn),))
        return conn

    def _shutdown(self) -> None:
        with self._workers_lock:
            workers, self._workers = self._workers, []
            self._current.clear()
        for worker in workers:
            worker.stop()
