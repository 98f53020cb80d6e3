"""Joining a job: every role process presents the job's secret token to the
coordinator, which admits it into the membership table or refuses it.

The job store (a torch.distributed ``TCPStore``) has no authentication of its
own, so the token never goes into it: a joiner writes its request (role, rank,
host, pid, a fresh nonce) with an HMAC-SHA256 of it keyed by the token. The
coordinator recomputes the HMAC, refuses a wrong one (logging who asked, never
the token) and refuses a replayed nonce. Keys: ``replica/join/seq`` counts
requests, ``replica/join/{n}`` is request n, ``replica/join/{n}/reply`` the answer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from replica.errors import JoinRefusedError

__all__ = ["Admission", "JoinRequest", "answer", "join", "pending_requests"]

_SEQ = "replica/join/seq"


@dataclass(kw_only=True, frozen=True, slots=True)
class JoinRequest:
    role: str
    rank: int
    host: str
    pid: int
    nonce: str

    def encode(self, token: bytes) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True)
        return f"{body}\n{_mac(token, body)}".encode()

    @classmethod
    def decode(cls, raw: bytes, token: bytes) -> JoinRequest:
        """Parse and authenticate a request; ``JoinRefusedError`` says why not."""
        try:
            body, mac = raw.decode().rsplit("\n", 1)
            fields = json.loads(body)
            request = cls(role=str(fields["role"]), rank=int(fields["rank"]), host=str(fields["host"]),
                          pid=int(fields["pid"]), nonce=str(fields["nonce"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise JoinRefusedError(f"malformed join request: {exc}") from exc
        if not hmac.compare_digest(mac, _mac(token, body)):
            raise JoinRefusedError(f"wrong job token from {request.role} rank {request.rank} "
                                   f"(pid {request.pid} on {request.host})")
        return request


@dataclass(kw_only=True, frozen=True, slots=True)
class Admission:
    member: int  # the member's id (its join number): its heartbeat key is replica/hb/{member}
    generation: int


def _mac(token: bytes, body: str) -> str:
    return hmac.new(token, body.encode(), hashlib.sha256).hexdigest()


def join(store: dist.Store, *, role: str, rank: int, token: bytes, timeout: timedelta) -> Admission:
    """Ask the coordinator to admit this process; raises JoinRefusedError if refused."""
    request = JoinRequest(role=role, rank=rank, host=socket.gethostname(), pid=os.getpid(), nonce=secrets.token_hex(16))
    seq = store.add(_SEQ, 1)
    store.set(f"replica/join/{seq}", request.encode(token))
    reply_key = f"replica/join/{seq}/reply"
    try:
        store.wait([reply_key], timeout)
    except RuntimeError as exc:  # DistStoreError: "Wait timeout"
        raise JoinRefusedError(f"no coordinator answered the join of {role} rank {rank} within {timeout}") from exc
    reply = json.loads(store.get(reply_key))
    if not reply["admitted"]:
        raise JoinRefusedError(f"the coordinator refused {role} rank {rank}: {reply['reason']}")
    return Admission(member=seq, generation=int(reply["generation"]))


def pending_requests(store: dist.Store, after: int) -> list[tuple[int, bytes | None]]:
    """Requests numbered above ``after``: (n, raw request, or None while its writer is mid-way)."""
    last = store.add(_SEQ, 0)
    return [(n, store.get(f"replica/join/{n}") if store.check([f"replica/join/{n}"]) else None)
            for n in range(after + 1, last + 1)]


def answer(store: dist.Store, seq: int, *, generation: int, refused: str | None = None) -> None:
    reply = {"admitted": refused is None, "reason": refused, "generation": generation}
    store.set(f"replica/join/{seq}/reply", json.dumps(reply))
