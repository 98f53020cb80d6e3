"""NIXL backend: the transfer library vLLM, torchft, verl and NeMo-RL move tensors with,
one API over UCX, libfabric (AWS EFA) and more (``NixlConfig.plugin``).

The control channel is the one every backend has (``replica.transport.control``): the
token handshake, which here also swaps the two agents' connection info, and the socket
whose close says the peer died. The data goes as NIXL's one-sided writes into memory
the receiver registered:

* A receive announces its buffer (a WANT frame: tag, index, address, bytes), with the
  metadata of its storage's registration the first time the peer hears of it; storages
  are registered once and kept (``replica.transport.nixl_agent``).
* A send under a tag is matched with the peer's receive of the same index under that
  tag (both count their messages per tag); it writes its bytes into the announced
  buffer as soon as both are there (from whichever thread sees the second), hashes the
  bucket while the write runs, and once NIXL reports the write complete (its UCX
  backend flushes first: the bytes are in the peer's memory) sends the header in a
  PUSHED frame. The receive is complete when that frame arrives.
* Small messages (under ``INLINE_BYTES``: the mirror protocol's layouts, replies)
  ride the control socket whole (INLINE), without waiting for the receive, as UCX
  sends them eagerly: no protocol has to post its receives first.

A send whose size is not its receive's writes nothing and sends its header alone,
so the receiver raises the mismatch as every backend does.
"""

from __future__ import annotations

import collections
import logging
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from replica.errors import PeerDisconnectedError, TransportError
from replica.transport.base import Capabilities, Locality, MemoryKind
from replica.transport.control import ControlledConnection, ControlledTransport, EndpointConfig
from replica.transport.framing import MAX_FRAME_BYTES
from replica.transport.nixl_agent import (
    DEFAULT_PLUGIN,
    PROGRESS_WAKEUP,
    Agent,
    Region,
    check_plugin_name,
    shared_agent,
)
from replica.transport.wire import HEADER_BYTES

__all__ = ["INLINE_BYTES", "NixlConfig", "NixlConnection", "NixlTransport"]

logger = logging.getLogger(__name__)

#: Messages below this many bytes ride the control socket; larger ones are written by NIXL.
INLINE_BYTES = 64 << 10

_WANT, _PUSHED, _INLINE = 1, 2, 3
# tag, index, region id (0: no region: send it inline), address, bytes, memory (0 DRAM, 1 VRAM), device
_WANT_FIXED = struct.Struct("<QQQQQBI")
_KEY = struct.Struct("<QQ")  # tag, index
_MEM_TYPES = ("DRAM", "VRAM")
assert INLINE_BYTES + _KEY.size + HEADER_BYTES <= MAX_FRAME_BYTES


# repr=False keeps EndpointConfig.__repr__, which leaves the token out.
@dataclass(kw_only=True, frozen=True, slots=True, repr=False)
class NixlConfig(EndpointConfig):
    """Settings of one process's NIXL transport: which NIXL backend plugin moves the data
    ("UCX", the default; "LIBFABRIC" on AWS EFA) and its init parameters, as NIXL names
    them (UCX: ``ucx_error_handling_mode``, ``num_workers``, ``ucx_devices``). The plugin's
    own environment (``UCX_TLS``, ``FI_PROVIDER``, ...) is read by NIXL as usual."""

    plugin: str = DEFAULT_PLUGIN
    plugin_params: tuple[tuple[str, str], ...] = ()
    # How often the agent's idle progress thread wakes (work wakes it at once). NIXL's own
    # default spins: a core per process, which trainers sharing their cores cannot spare.
    progress_wakeup: timedelta = PROGRESS_WAKEUP

    def __post_init__(self) -> None:
        super(NixlConfig, self).__post_init__()
        check_plugin_name(self.plugin)
        if not isinstance(self.progress_wakeup, timedelta) or self.progress_wakeup <= timedelta(0):
            raise ValueError(f"progress_wakeup must be a positive timedelta, got {self.progress_wakeup!r}")
        for pair in self.plugin_params:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(s, str) for s in pair)):
                raise ValueError(f"plugin_params holds (name, value) pairs of str, got {pair!r}")


class WriteFailed(RuntimeError):
    """NIXL could not start or finish a write; ``Transfer.wait`` reports it as the
    connection's error (PeerDisconnectedError when the control socket says the peer died)."""


@dataclass(eq=False)
class _Want:
    """A receive the peer announced."""

    region: int
    addr: int
    nbytes: int
    mem_type: str
    device: int


@dataclass(eq=False)
class _Send:
    """One piece on its way: waits for its WANT, then for its write."""

    conn: NixlConnection
    flat: torch.Tensor
    key: tuple[int, int]
    header: Callable[[], bytes]
    region: Region | None = None
    handle: Any = None
    matched: bool = False
    head: bytes | None = None
    error: BaseException | None = None
    done: bool = False

    def poll(self) -> bool:
        if self.done:
            return True
        if self.error is not None:
            raise self.error
        if not self.matched:
            return False
        if self.head is None:
            self.head = self.header()  # hashed while the write runs
        if self.handle is not None:
            state = self.conn._agent.state(self.handle)
            if state == "PROC":
                return False
            self.conn._finish_send(self)
            if state != "DONE":  # not a TransportError: the connection first hears whether the peer died
                raise WriteFailed(f"NIXL write of tag {self.key[0]} to {self.conn.peer} failed ({state})")
        self.conn._send_control(_PUSHED, _KEY.pack(*self.key) + self.head)
        self.done = True
        return True


@dataclass(eq=False)
class _Recv:
    flat: torch.Tensor
    header_buf: torch.Tensor
    region: Region | None
    completion: threading.Event = field(default_factory=threading.Event)
    head: bytes | None = None
    payload: bytes | None = None
    done: bool = False

    def poll(self) -> bool:
        if self.done:
            return True
        if self.head is None:
            return False
        self.header_buf.copy_(torch.frombuffer(bytearray(self.head), dtype=torch.uint8))
        if self.payload is not None and len(self.payload) == self.flat.numel() and self.payload:
            self.flat.copy_(torch.frombuffer(bytearray(self.payload), dtype=torch.uint8))
        self.payload = None
        self.done = True
        return True


class NixlConnection(ControlledConnection):
    def __init__(self, *, agent: Agent, peer_agent: str, **kwargs: Any):
        super().__init__(memory=NixlTransport.capabilities.memory, **kwargs)
        self._agent = agent
        self._peer_agent = peer_agent
        self._state_lock = threading.Lock()
        self._sent: collections.Counter = collections.Counter()  # next index per tag
        self._received: collections.Counter = collections.Counter()
        self._wants: dict[tuple[int, int], _Want] = {}
        self._waiting: dict[tuple[int, int], _Send] = {}
        self._writing: set[_Send] = set()
        self._recvs: dict[tuple[int, int], _Recv] = {}
        self._early: dict[tuple[int, int], tuple[bytes, bytes]] = {}  # INLINE before its receive
        self._told: set[int] = set()  # regions whose metadata the peer has
        self._released = False

    @property
    def registered(self) -> int:
        """Storages this process's agent holds registered (all its connections')."""
        return self._agent.registered

    # --- sending ---

    def _isend(self, flat, tag, header, ready):
        if ready is not None:  # the bucket's producers, not whatever the stream ran since
            ready.synchronize()
        with self._state_lock:
            key = (tag, self._sent[tag])
            self._sent[tag] += 1
            if flat.numel() < INLINE_BYTES:
                self._wants.pop(key, None)
                inline = True
            else:
                inline = False
                send = _Send(self, flat, key, header)
                want = self._wants.pop(key, None)
                if want is None:
                    self._waiting[key] = send
        if inline:
            self._send_control(_INLINE, _KEY.pack(*key) + header() + flat.cpu().numpy().tobytes())
            return _Done()
        if want is not None:
            self._write(send, want)
        return send

    def _write(self, send: _Send, want: _Want) -> None:
        """Start ``send`` into the buffer ``want`` announced (any thread)."""
        try:
            if want.nbytes == send.flat.numel() and want.region:
                send.region = self._agent.use(send.flat)
                with self._state_lock:
                    if self._released:
                        raise self._error or PeerDisconnectedError(f"connection to {self.peer} is closed")
                    self._writing.add(send)
                send.handle = self._agent.write(send.flat, self._peer_agent, want.addr, want.mem_type, want.device)
        except BaseException as exc:  # noqa: BLE001 - the sender's poll raises it
            self._finish_send(send)
            send.error = exc if isinstance(exc, TransportError) else WriteFailed(f"NIXL write failed: {exc}")
        send.matched = True

    def _finish_send(self, send: _Send) -> None:
        with self._state_lock:
            self._writing.discard(send)
            handle, send.handle = send.handle, None
            region, send.region = send.region, None
        if handle is not None:
            self._agent.release(handle)
        if region is not None:
            self._agent.done_with(region)

    # --- receiving ---

    def _irecv(self, flat, tag, header_buf, ready):
        if ready is not None:
            ready.synchronize()
        region = self._agent.use(flat) if flat.numel() >= INLINE_BYTES else None
        recv = _Recv(flat, header_buf, region)
        with self._state_lock:
            if self._released:
                self._drop_region(recv)
                raise self._error or PeerDisconnectedError(f"connection to {self.peer} is closed")
            key = (tag, self._received[tag])
            self._received[tag] += 1
            early = self._early.pop(key, None)
            if early is None:
                self._recvs[key] = recv
            metadata = b""
            if region is not None and region.id not in self._told:
                self._told.add(region.id)
                metadata = region.metadata
        if early is not None:
            self._deliver(recv, *early)
            return recv
        mem = _MEM_TYPES.index(region.mem_type) if region else 0
        self._send_control(
            _WANT,
            _WANT_FIXED.pack(
                tag,
                key[1],
                region.id if region else 0,
                flat.data_ptr(),
                flat.numel(),
                mem,
                region.device if region else 0,
            )
            + metadata,
        )
        return recv

    def _deliver(self, recv: _Recv, head: bytes, payload: bytes | None) -> None:
        recv.payload = payload
        recv.head = head
        self._drop_region(recv)
        recv.completion.set()

    def _drop_region(self, recv: _Recv) -> None:
        region, recv.region = recv.region, None
        if region is not None:
            self._agent.done_with(region)

    # --- the control socket (the monitor thread) ---

    def _on_control(self, kind: int, payload: bytes) -> None:
        if kind == _WANT:
            tag, index, region, addr, nbytes, mem, device = _WANT_FIXED.unpack_from(payload)
            if payload[_WANT_FIXED.size :]:
                self._agent.load(self._peer_agent, payload[_WANT_FIXED.size :])
            want = _Want(region=region, addr=addr, nbytes=nbytes, mem_type=_MEM_TYPES[mem], device=device)
            with self._state_lock:
                send = self._waiting.pop((tag, index), None)
                if send is None and index >= self._sent[tag]:  # else its send went inline already
                    self._wants[(tag, index)] = want
            if send is not None:
                self._write(send, want)
        elif kind in (_PUSHED, _INLINE):
            key = _KEY.unpack_from(payload)
            head = payload[_KEY.size : _KEY.size + HEADER_BYTES]
            data = payload[_KEY.size + HEADER_BYTES :] if kind == _INLINE else None
            with self._state_lock:
                recv = self._recvs.pop(key, None)
                if recv is None:
                    if data is None:  # a _PUSHED (an _INLINE carries its bytes)
                        raise TransportError(f"a write for tag {key[0]} that no receive asked for")
                    self._early[key] = (head, data)
                    return
            self._deliver(recv, head, data)
        else:
            super()._on_control(kind, payload)

    # --- closing ---

    def _release(self) -> None:
        with self._state_lock:
            self._released = True
            writing, self._writing = list(self._writing), set()
            recvs = list(self._recvs.values())
            self._recvs.clear()
            self._waiting.clear()
            self._early.clear()
        for send in writing:
            self._finish_send(send)
        for recv in recvs:
            self._drop_region(recv)
            recv.completion.set()  # waiters wake and see the connection's error
        self._agent.drop_peer(self._peer_agent)


class _Done:
    """A send already complete (it went whole on the control socket)."""

    def poll(self) -> bool:
        return True


class NixlTransport(ControlledTransport):
    """The ``"nixl"`` backend: host memory, and device memory where NIXL's plugin moves it
    (its UCX plugin does), to peers on this host or others. Its agent is this process's,
    made by the first NixlTransport (see ``replica.transport.nixl_agent``)."""

    capabilities = Capabilities(memory=MemoryKind.HOST | MemoryKind.CUDA, locality=Locality.SAME_NODE | Locality.REMOTE)

    def __init__(self, config: NixlConfig):
        # Fails before anything listens; made once per process (see nixl_agent).
        self._agent = shared_agent(config.plugin, config.plugin_params, config.progress_wakeup)
        super().__init__(config)
        self.config = config

    @property
    def agent(self) -> Agent:
        return self._agent

    def _offer(self, server, locality):
        return self._agent.connection_info, None

    def _open(self, *, sock, peer, peer_offer, send_id, recv_id, server, state, timeout_s):
        peer_agent = self._agent.add_peer(peer_offer)
        try:
            return NixlConnection(
                transport=self,
                sock=sock,
                peer=peer,
                agent=self._agent,
                peer_agent=peer_agent,
                verify=self.config.verify,
                verify_threads=self.config.verify_threads,
            )
        except BaseException:
            self._agent.drop_peer(peer_agent)
            raise

    def _shutdown(self) -> None:
        pass  # the agent is the process's, kept for the next transport
