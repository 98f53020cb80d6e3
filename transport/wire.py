"""Fixed-layout wire records of replica.transport. No pickle crosses the wire.

A connection starts with a handshake on its control socket (challenge and
response over the job token, so the token itself never travels), then every
bucket travels as a 64-byte :class:`BucketHeader` followed by its raw bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

__all__ = [
    "BucketHeader",
    "CHALLENGE_BYTES",
    "HEADER_BYTES",
    "Hello",
    "PROTOCOL_VERSION",
    "Welcome",
    "decode_challenge",
    "encode_challenge",
    "new_nonce",
    "proof",
]

MAGIC = b"RPLC"
PROTOCOL_VERSION = 2  # 2: a bucket digest keys its words from the bucket's offset (ops.checksum word_offset)
HEADER_BYTES = 64
NONCE_BYTES = 32
PROOF_BYTES = 32

# magic, version, step, bucket, offset, nbytes, digest, fingerprint, padding
_HEADER = struct.Struct("<4sHxxqqqqqq8x")
assert _HEADER.size == HEADER_BYTES


@dataclass(kw_only=True, frozen=True, slots=True)
class BucketHeader:
    """What a receiver learns about a bucket before trusting its bytes."""

    step: int
    bucket: int
    offset: int
    nbytes: int
    digest: int
    fingerprint: int = 0

    def encode(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            self.step,
            self.bucket,
            self.offset,
            self.nbytes,
            self.digest,
            self.fingerprint,
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> BucketHeader:
        magic, version, step, bucket, offset, nbytes, digest, fingerprint = _HEADER.unpack(data)
        if magic != MAGIC or version != PROTOCOL_VERSION:
            raise ValueError(f"not a replica bucket header (magic {magic!r}, version {version})")
        return cls(step=step, bucket=bucket, offset=offset, nbytes=nbytes, digest=digest, fingerprint=fingerprint)


def proof(token: bytes, nonce: bytes, role: bytes) -> bytes:
    """HMAC-SHA256 of a nonce under the job token: shows the token without sending it."""
    return hmac.new(token, role + nonce, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


# Server -> client, first: magic, version, the nonce the client must prove the token over.
_CHALLENGE = struct.Struct(f"<4sH{NONCE_BYTES}s")


def encode_challenge(nonce: bytes) -> bytes:
    return _CHALLENGE.pack(MAGIC, PROTOCOL_VERSION, nonce)


def decode_challenge(data: bytes) -> bytes:
    magic, version, nonce = _CHALLENGE.unpack(data)
    _check_magic(magic, version)
    return nonce


CHALLENGE_BYTES = _CHALLENGE.size


# Client -> server: magic, version, proof of the token over the server's nonce,
# the client's own nonce, the tag prefix the server must use when sending to
# the client, and the length of the client's data address that follows.
_HELLO = struct.Struct(f"<4sH{PROOF_BYTES}s{NONCE_BYTES}sII")


@dataclass(kw_only=True, frozen=True, slots=True)
class Hello:
    proof: bytes
    nonce: bytes
    inbound_id: int
    address: bytes

    def encode(self) -> bytes:
        return (
            _HELLO.pack(MAGIC, PROTOCOL_VERSION, self.proof, self.nonce, self.inbound_id, len(self.address))
            + self.address
        )

    @staticmethod
    def fixed_size() -> int:
        return _HELLO.size

    @classmethod
    def decode(cls, fixed: bytes, read_rest) -> Hello:
        magic, version, prf, nonce, inbound_id, length = _HELLO.unpack(fixed)
        _check_magic(magic, version)
        return cls(proof=prf, nonce=nonce, inbound_id=inbound_id, address=read_rest(length))


# Server -> client: status (1 accepted, 0 refused), proof of the token over the
# client's nonce, the tag prefix for the client's sends, its address length.
_WELCOME = struct.Struct(f"<4sHB{PROOF_BYTES}sII")


@dataclass(kw_only=True, frozen=True, slots=True)
class Welcome:
    accepted: bool
    proof: bytes
    inbound_id: int
    address: bytes

    def encode(self) -> bytes:
        return (
            _WELCOME.pack(MAGIC, PROTOCOL_VERSION, int(self.accepted), self.proof, self.inbound_id, len(self.address))
            + self.address
        )

    @staticmethod
    def fixed_size() -> int:
        return _WELCOME.size

    @classmethod
    def decode(cls, fixed: bytes, read_rest) -> Welcome:
        magic, version, accepted, prf, inbound_id, length = _WELCOME.unpack(fixed)
        _check_magic(magic, version)
        return cls(accepted=bool(accepted), proof=prf, inbound_id=inbound_id, address=read_rest(length))


def _check_magic(magic: bytes, version: int) -> None:
    if magic != MAGIC:
        raise ValueError("peer does not speak the replica protocol")
    if version != PROTOCOL_VERSION:
        raise ValueError(f"peer speaks replica protocol {version}, this side {PROTOCOL_VERSION}")
