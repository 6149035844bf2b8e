"""Who may speak for what: credentials derived from the one secret a run's sidecars share (their token).

- The shared token (the secret itself) is the operator's: it steers the run (control, cancel, the
  Alertmanager webhook) and reads it (status, decisions). Node sidecars hold it too, to check their
  ranks' credentials. It can mint every credential below, so the sidecar takes it wherever they are taken.
- A run key, HMAC(secret, run id), mints the rank credentials of one run and of no other: it is what a
  job script puts in the environment of torchrun's workers (PARWATCH_RUN_KEY), where one environment
  serves every rank of a node, so the ranks never hold the secret.
- A rank credential, HMAC(run key, rank), speaks for one rank of one run: its step summaries and its
  activity reports, nothing else. The launcher (`parwatch train`) mints one per rank in the parent and
  hands each spawned rank its own; a collector given the secret or a run key mints its own and keeps
  only that (parwatch.collector.attach).
- A node credential, HMAC(secret, node name), speaks for one node sidecar: its digests and cross-node
  instances at the leader, under that node's name only.

A credential names what it speaks for in its text ("pwr1.RANK.RUN.MAC", "pwn1.NODE.MAC", run id and
node name base64url), so the sidecar checks it from the request's head, before any body is read, and
then that the body speaks for the same rank and run. Below both the collector and the sidecar.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass

from parwatch.vocabulary import Speaker

RUN_KEY_ENV = "PARWATCH_RUN_KEY"
"""A run key for torchrun's workers: each mints its own rank's credential from it (`parwatch credential`)."""
RANK_PREFIX, NODE_PREFIX, RUN_KEY_PREFIX = "pwr1", "pwn1", "pwk1"
MAX_CACHED = 8192
"""Credentials already verified, kept so that a hot post costs a dict lookup, not an HMAC."""


class CredentialError(ValueError):
    """A credential does not fit what it is used for; the message names it and the fix."""


@dataclass(frozen=True)
class Identity:
    """What a request's credential speaks for."""

    speaker: Speaker
    run_id: str | None = None
    """A rank credential's run."""
    rank: int | None = None
    """A rank credential's rank."""
    node: str | None = None
    """A node credential's node name."""

    def describe(self) -> str:
        if self.speaker == Speaker.RANK:
            return f"rank {self.rank} of run {self.run_id!r}"
        if self.speaker == Speaker.NODE:
            return f"node {self.node!r}"
        return "the operator (shared token)"


OPERATOR = Identity(Speaker.OPERATOR)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, *parts: str) -> bytes:
    return hmac.digest(key, "\0".join(parts).encode("utf-8"), hashlib.sha256)


def _run_key_bytes(secret: str, run_id: str) -> bytes:
    return _mac(secret.encode("utf-8"), "parwatch run", run_id)


def run_key(secret: str, run_id: str) -> str:
    """The key that mints run `run_id`'s rank credentials (and nothing else)."""
    return f"{RUN_KEY_PREFIX}.{_b64(run_id.encode('utf-8'))}.{_b64(_run_key_bytes(secret, run_id))}"


def _rank_from_key(key: bytes, run_id: str, rank: int) -> str:
    mac = _mac(key, "parwatch rank", str(rank))
    return f"{RANK_PREFIX}.{rank}.{_b64(run_id.encode('utf-8'))}.{_b64(mac)}"


def rank_credential(secret: str, run_id: str, rank: int) -> str:
    """Rank `rank` of run `run_id`'s credential, from the shared secret."""
    return _rank_from_key(_run_key_bytes(secret, run_id), run_id, rank)


def node_credential(secret: str, node: str) -> str:
    """Node sidecar `node`'s credential (its digests name it `node`)."""
    return f"{NODE_PREFIX}.{_b64(node.encode('utf-8'))}.{_b64(_mac(secret.encode('utf-8'), 'parwatch node', node))}"


def for_rank(given: str, run_id: str, rank: int) -> str:
    """The credential a rank sends, from what it was given: the shared secret or its run's key (minted
    here, so the caller can drop what it was given), or its own credential (checked to be its own).
    CredentialError names a credential of another rank or run."""
    if given.startswith(RANK_PREFIX + "."):
        claimed = _parse_rank(given)
        if claimed is None or claimed[:2] != (rank, run_id):
            raise CredentialError(
                f"the credential given is not the one of rank {rank} of run {run_id!r}"
                + (f" (it is rank {claimed[0]}'s, of run {claimed[1]!r})" if claimed else " (it cannot be read)")
                + "; give each rank its own, or the run's key ($"
                + RUN_KEY_ENV
                + ")"
            )
        return given
    if given.startswith(RUN_KEY_PREFIX + "."):
        key = _parse_run_key(given)
        if key is None or key[0] != run_id:
            raise CredentialError(
                f"${RUN_KEY_ENV} is not the key of run {run_id!r}"
                + (f" (it is the key of run {key[0]!r})" if key else " (it cannot be read)")
                + f"; mint it for this run: parwatch credential --run-id {run_id}"
            )
        return _rank_from_key(key[1], run_id, rank)
    return rank_credential(given, run_id, rank)


def _parse_rank(text: str) -> tuple[int, str, bytes] | None:
    parts = text.split(".")
    if len(parts) != 4 or parts[0] != RANK_PREFIX or not parts[1].isdigit() or len(parts[1]) > 9:
        return None
    try:
        return int(parts[1]), _unb64(parts[2]).decode("utf-8"), _unb64(parts[3])
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def _parse_run_key(text: str) -> tuple[str, bytes] | None:
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != RUN_KEY_PREFIX:
        return None
    try:
        return _unb64(parts[1]).decode("utf-8"), _unb64(parts[2])
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


class Verifier:
    """The sidecar's side: who a bearer credential speaks for, or None when it is not one of this secret's."""

    def __init__(self, secret: str):
        self._secret = secret.encode("utf-8")
        self._known: dict[str, Identity] = {}

    def identify(self, given: str) -> Identity | None:
        known = self._known.get(given)
        if known is not None:
            return known
        if hmac.compare_digest(given.encode("utf-8"), self._secret):
            identity: Identity | None = OPERATOR
        elif given.startswith(RANK_PREFIX + "."):
            identity = self._rank(given)
        elif given.startswith(NODE_PREFIX + "."):
            identity = self._node(given)
        else:
            identity = None
        if identity is not None:
            if len(self._known) >= MAX_CACHED:
                self._known.clear()
            self._known[given] = identity
        return identity

    def _rank(self, given: str) -> Identity | None:
        parsed = _parse_rank(given)
        if parsed is None:
            return None
        rank, run_id, mac = parsed
        expected = _mac(_mac(self._secret, "parwatch run", run_id), "parwatch rank", str(rank))
        return Identity(Speaker.RANK, run_id=run_id, rank=rank) if hmac.compare_digest(mac, expected) else None

    def _node(self, given: str) -> Identity | None:
        parts = given.split(".")
        if len(parts) != 3:
            return None
        try:
            node, mac = _unb64(parts[1]).decode("utf-8"), _unb64(parts[2])
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        expected = _mac(self._secret, "parwatch node", node)
        return Identity(Speaker.NODE, node=node) if hmac.compare_digest(mac, expected) else None


def from_environment(environ=os.environ) -> str | None:
    """$PARWATCH_RUN_KEY, when a job script minted one for torchrun's workers."""
    return environ.get(RUN_KEY_ENV) or None
