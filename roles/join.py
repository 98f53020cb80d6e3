"""Joining a job: every role process presents the job's secret token to the
coordinator, which admits it into the membership table or refuses it.

The job store has no authentication of its own, so the token never goes into
it: a joiner writes its request (role, rank, host, pid, a fresh nonce) with an
HMAC-SHA256 of it keyed by the token, raw under ``join/{n}`` (``n`` from the
counter ``join/seq``). The coordinator recomputes the HMAC, refuses a wrong one
(logging who asked, never the token) and refuses a replayed nonce. Its answer,
``join/{n}/reply``, is a signed ``JoinReply`` bound to the request's nonce: a
reply written by anyone else is never taken for an admission. A process with
the wrong token cannot verify even a genuine refusal; the coordinator writes
that one unsigned, and the joiner reports its reason after a short grace.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

from replica import envvars
from replica.errors import JobStateError, JoinRefusedError, ReplicaError, StoreWaitTimeoutError
from replica.jobstore import JobStore, JoinReply, keys
from replica.roles import timing
from replica.roles.env import domain_name, host_name

__all__ = ["Admission", "JoinRequest", "answer", "join", "pending_requests", "post_request", "refuse_unsigned"]

#: At most this many requests are read per call: a forged counter cannot make a poll endless.
_MAX_PENDING = 64


@dataclass(kw_only=True, frozen=True, slots=True)
class JoinRequest:
    role: str
    rank: int
    host: str
    pid: int
    nonce: str
    domain: str = ""  # its failure domain ("": its host; decode() fills it in)

    def encode(self, token: bytes) -> bytes:
        body = json.dumps(asdict(self), sort_keys=True)
        return f"{body}\n{_mac(token, body)}".encode()

    @classmethod
    def decode(cls, raw: bytes, token: bytes) -> JoinRequest:
        """Parse and authenticate a request; ``JoinRefusedError`` says why not."""
        try:
            body, mac = raw.decode().rsplit("\n", 1)
            fields = json.loads(body)
            request = cls(
                role=str(fields["role"]),
                rank=int(fields["rank"]),
                host=str(fields["host"]),
                pid=int(fields["pid"]),
                nonce=str(fields["nonce"]),
                domain=str(fields.get("domain") or fields["host"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise JoinRefusedError(f"malformed join request: {exc}") from exc
        if not hmac.compare_digest(mac, _mac(token, body)):
            raise JoinRefusedError(
                f"wrong job token from {request.role} rank {request.rank} (pid {request.pid} on {request.host})"
            )
        return request


@dataclass(kw_only=True, frozen=True, slots=True)
class Admission:
    member: int  # the member's id (its join number): its heartbeat key is hb/{member}
    generation: int


@dataclass(slots=True)
class _Unsigned:
    """The last reply to a join that could not be verified (``raw``) and since when (``at``,
    ``time.monotonic()``) such replies came."""

    raw: bytes | None = None
    at: float | None = None


def _mac(token: bytes, body: str) -> str:
    return hmac.new(token, body.encode(), hashlib.sha256).hexdigest()


def post_request(store: JobStore, request: JoinRequest, token: bytes) -> int:
    """Number ``request`` and write it, signed, for the coordinator; returns its number
    (its reply comes under ``keys.join_reply`` of it)."""
    seq = store.count(keys.join_seq(), 1)
    # (torch's stub types a store's values as str; the binding takes bytes, as every store here stores them)
    store.raw.set(store.full(keys.join_request(seq)), request.encode(token))  # pyright: ignore[reportArgumentType]
    return seq


def join(store: JobStore, *, role: str, rank: int, token: bytes, timeout: timedelta) -> Admission:
    """Ask the coordinator to admit this process; raises JoinRefusedError if refused."""
    request = JoinRequest(
        role=role, rank=rank, host=host_name(), pid=os.getpid(), nonce=secrets.token_hex(16), domain=domain_name()
    )
    seq = post_request(store, request, token)
    key = keys.join_reply(seq)
    unsigned = _Unsigned()

    def answered(own: JobStore) -> Admission | None:
        full = own.full(key)
        if not own.raw.check([full]):
            return None
        raw = own.raw.get(full)
        try:
            reply = own.verify(key, raw)
        except JobStateError:  # a refusal for a wrong token (unsigned), or a forgery: wait for a signed one a while
            unsigned.raw = raw
            if unsigned.at is None:
                unsigned.at = time.monotonic()
            if time.monotonic() - unsigned.at > timing.UNSIGNED_GRACE.total_seconds():
                raise _unsigned(role, rank, raw) from None
            return None
        if reply.seq != seq or reply.nonce != request.nonce:
            raise JoinRefusedError(f"the reply to the join of {role} rank {rank} answers another request")
        if not reply.admitted:
            raise JoinRefusedError(f"the coordinator refused {role} rank {rank}: {reply.reason}")
        return Admission(member=seq, generation=reply.generation)

    try:  # blocks in the store until the reply is written
        return store.wait_for(
            answered,
            wake=lambda: [key],
            timeout=timeout,
            what=f"answer to the join of {role} rank {rank}",
            poll=timing.UNSIGNED_POLL,
        )
    except StoreWaitTimeoutError:
        raise JoinRefusedError(f"no coordinator answered the join of {role} rank {rank} within {timeout}") from None
    except ReplicaError:
        raise
    except RuntimeError as exc:  # the store went away (the job ended) while this waited
        if unsigned.raw is not None:
            raise _unsigned(role, rank, unsigned.raw) from exc
        raise JoinRefusedError(
            f"the job store went away before the join of {role} rank {rank} was answered: {exc}"
        ) from exc


def _unsigned(role: str, rank: int, raw: bytes) -> JoinRefusedError:
    return JoinRefusedError(
        f"{role} rank {rank} was not admitted: the only reply is not signed with this "
        f"process's token ({_reason(raw)}); is {envvars.TOKEN} the job's?"
    )


def _reason(raw: bytes) -> str:
    try:
        return str(json.loads(raw.rpartition(b"\n")[0] or raw)["reason"])[:200]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "unreadable"


def pending_requests(store: JobStore, after: int) -> list[tuple[int, bytes | None]]:
    """Requests numbered above ``after`` (at most _MAX_PENDING): (n, raw request,
    or None while its writer is mid-way)."""
    last = min(store.count(keys.join_seq()), after + _MAX_PENDING)
    out = []
    for n in range(after + 1, last + 1):
        out.append((n, store.read_raw(store.full(keys.join_request(n)))))
    return out


def answer(store: JobStore, seq: int, request: JoinRequest, *, generation: int, refused: str | None = None) -> None:
    store.put(
        keys.join_reply(seq),
        JoinReply(seq=seq, nonce=request.nonce, admitted=refused is None, reason=refused or "", generation=generation),
    )


def refuse_unsigned(store: JobStore, seq: int, reason: str) -> None:
    """Refuse a request this coordinator cannot authenticate (its writer may hold a
    wrong token and could not verify a signed answer). Never an admission."""
    refusal = json.dumps({"admitted": False, "reason": reason}).encode()
    store.raw.set(store.full(keys.join_reply(seq)), refusal)  # pyright: ignore[reportArgumentType] (as in post_request)
