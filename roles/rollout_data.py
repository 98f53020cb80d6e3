"""The rollouts' data path: a request's prompts and a shard's completions travel as blobs
between the trainers and the engines' desks (``replica.transport.desk``), never through the
job store.

The store keeps only small signed records (``replica.roles.rollouts``): a request names its
prompts' digest and size, a shard's result names the engine that holds its completions, their
digest, size and token count. The trainers' leader uploads a request's prompts to every
engine's desk before it posts the request (and again to an engine that joined meanwhile); an
engine keeps the prompts and the completions of its last ``KEPT_REQUESTS`` requests, so a
step redone after a trainer's failover fetches its completions again, generating nothing.
Every blob read is checked against the digest its signed record names."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy as np

from replica.errors import TransportError
from replica.jobstore import JobStore, keys
from replica.transport.desk import DeskClient, blob_digest

__all__ = ["DeskBook", "KEPT_REQUESTS", "decode_tokens", "encode_tokens", "kept_blob", "prompts_blob", "result_blob"]

logger = logging.getLogger(__name__)

#: An engine keeps the blobs of this many requests back from the newest it saw (a redone step
#: takes its rollouts from a request at most a few failovers old: ``rollouts.KEPT_GENERATIONS``).
KEPT_REQUESTS = 16
_DTYPE = np.dtype("<i4")


def encode_tokens(seqs: Sequence[Sequence[int]]) -> bytes:
    """Token-id lists as a blob: their count (u32), their lengths (u32 each), then every token
    (i32, little-endian). No pickle: a blob is plain numbers."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    if len(seqs) and int(lengths.max(initial=0)) >= 1 << 32:
        raise ValueError("a token list over 2**32 tokens")
    flat = (
        np.concatenate([np.asarray(s, dtype=np.int64).reshape(-1) for s in seqs])
        if len(seqs)
        else np.zeros(0, dtype=np.int64)
    )
    if flat.size and (flat.min() < -(1 << 31) or flat.max() >= 1 << 31):
        raise ValueError("a token id outside int32")
    return b"".join(
        (np.uint32(len(seqs)).astype("<u4").tobytes(), lengths.astype("<u4").tobytes(), flat.astype(_DTYPE).tobytes())
    )


def decode_tokens(blob: bytes) -> list[list[int]]:
    """``encode_tokens``' inverse; ValueError for a blob that is not one."""
    if len(blob) < 4:
        raise ValueError("a token blob of under 4 bytes")
    count = int(np.frombuffer(blob, dtype="<u4", count=1)[0])
    if len(blob) < 4 + 4 * count:
        raise ValueError(f"a token blob of {len(blob)} bytes cannot hold {count} lengths")
    lengths = np.frombuffer(blob, dtype="<u4", count=count, offset=4).astype(np.int64)
    body = 4 + 4 * count
    if len(blob) != body + 4 * int(lengths.sum()):
        raise ValueError(f"a token blob of {len(blob)} bytes does not hold {int(lengths.sum())} tokens")
    flat = np.frombuffer(blob, dtype=_DTYPE, offset=body).tolist()
    out, at = [], 0
    for n in lengths.tolist():
        out.append(flat[at : at + n])
        at += n
    return out


def prompts_blob(n: int) -> str:
    return f"prompts/{n}"


def result_blob(n: int, shard: int) -> str:
    return f"result/{n}/{shard}"


def kept_blob(name: str, newest: int) -> bool:
    """Whether a desk keeps blob ``name`` once request ``newest`` was seen."""
    try:
        n = int(name.split("/")[1])
    except (IndexError, ValueError):
        return False
    return n > newest - KEPT_REQUESTS


class DeskBook:
    """The engines' desks as a trainer, the driver or an engine reaches them: each one's
    address from the store (an engine publishes it signed, ``keys.engine_desk``; a replacement
    at the same index publishes its own), one connection kept to each."""

    def __init__(self, store: JobStore, *, token: bytes, num_engines: int, timeout: timedelta = timedelta(seconds=30)):
        self.store = store
        self.num_engines = num_engines
        self._token = token
        self._timeout = timeout
        self._clients: dict[str, DeskClient] = {}

    def __repr__(self) -> str:  # never the token
        return f"DeskBook({self.num_engines} engines)"

    def addresses(self, engines: Iterable[int] | None = None) -> dict[int, str]:
        """The published desks of ``engines`` (default: all)."""
        wanted = list(range(self.num_engines) if engines is None else engines)
        found = self.store.get_many([keys.engine_desk(i) for i in wanted])
        return {i: text.value for i, text in zip(wanted, found, strict=False) if text is not None}

    def fetch(self, name: str, digest: str, holders: Sequence[int]) -> bytes | None:
        """Blob ``name`` from the first of ``holders`` whose desk serves it with ``digest``;
        None if none does (gone, or never had it)."""
        for engine, address in self.addresses(holders).items():
            if (blob := self._checked(self._client(address), engine, name, digest)) is not None:
                return blob
        return None

    def fetch_each(self, wanted: Sequence[tuple[str, str, int]]) -> list[bytes | None]:
        """Each ``(name, digest, holder)``'s blob from its holder's desk (None where it does not
        serve it with that digest): the desks in parallel, each one's blobs in turn over its
        connection."""
        addresses = self.addresses({holder for _, _, holder in wanted})
        by_engine: dict[int, list[int]] = {}
        for i, (_, _, holder) in enumerate(wanted):
            by_engine.setdefault(holder, []).append(i)
        out: list[bytes | None] = [None] * len(wanted)
        clients = {engine: self._client(addresses[engine]) for engine in by_engine if engine in addresses}

        def from_desk(engine: int) -> None:
            for i in by_engine[engine]:
                name, digest, _ = wanted[i]
                out[i] = self._checked(clients[engine], engine, name, digest)

        if clients:
            with ThreadPoolExecutor(max_workers=min(len(clients), 16), thread_name_prefix="replica-desk-get") as pool:
                list(pool.map(from_desk, clients))
        return out

    @staticmethod
    def _checked(client: DeskClient, engine: int, name: str, digest: str) -> bytes | None:
        try:
            blob = client.get(name)
        except TransportError as exc:
            logger.info("the desk of engine %d (%s) did not serve %s: %s", engine, client.address, name, exc)
            return None
        if blob is not None and blob_digest(blob) != digest:
            logger.warning("the desk of engine %d served %s with another digest than its record: ignored", engine, name)
            return None
        return blob

    def upload(self, name: str, blob: bytes, addresses: dict[int, str]) -> set[str]:
        """Put ``blob`` on each desk of ``addresses`` at once; returns the addresses that took it
        (an engine that died or is frozen does not hold the caller up past ``timeout``)."""
        if not addresses:
            return set()

        def put(address: str) -> str | None:
            try:
                self._client(address).put(name, blob)
                return address
            except TransportError as exc:
                logger.info("could not put %s on the desk at %s: %s", name, address, exc)
                return None

        with ThreadPoolExecutor(max_workers=min(len(addresses), 16), thread_name_prefix="replica-desk-put") as pool:
            return {a for a in pool.map(put, addresses.values()) if a is not None}

    def _client(self, address: str) -> DeskClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = DeskClient(address, token=self._token, timeout=self._timeout)
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
