"""The administrator's authority: a key that no task holds.

Everything a release needs (reserve, commit, reap, seal a closed window, ...) can only
ever charge more, so any worker may do it. What could let a subject lose more than its cap
(raise a cap, change a calendar, lift a quarantine, re-key the history) is an
administrator's act, and tasks run code their DAG authors wrote, with the worker's
connection, environment and chain key. So administrative acts are signed with an Ed25519
key that lives only where administrators work (the CLI host, the Airflow api-server), and
every worker checks the signature with the public half: a policy row or a clearing that
was written without the key (by SQL, or by task code calling the API) is never honoured,
and ``verify`` names it.

The same key seals refusal references (:func:`AdminPublicKey.seal`): what a task is told
of a refusal is a reference only the administrator can open, so a refusal names no
subject and no account's state to the DAG that caused it.

An administrator key is one 32-byte seed: the Ed25519 signing key, and an X25519 key
derived from it for sealing. Its public form (``dpb-admin-1:...``) is the two public keys;
it is public, and workers pin it in their connection (``admin_public_key``) so that an
insider who swaps the key stored in the ledger database is refused.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature, InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from dp_budget_provider.ledger.errors import AdminAuthorityError
from dp_budget_provider.ledger.storage import history

PUBLIC_PREFIX = "dpb-admin-1:"
REFERENCE_PREFIX = "dpb-ref-1."
# Where the CLI finds the administrator's key file unless --admin-key names one.
ADMIN_KEY_ENV = "DP_BUDGET_ADMIN_KEY_FILE"
_SEALING_INFO = b"dp-budget admin sealing key"
_REFERENCE_INFO = b"dp-budget sealed reference"
# The size of every sealed reference's plaintext (JSON, padded with spaces).
SEALED_SIZE = 2048
_NONCE = bytes(12)  # each sealing key is used once (a fresh ephemeral key per reference)
# What each act signed by an administrator is, in messages.
ACTS = {
    "policy": "setting a policy",
    "clear-quarantine": "clearing a quarantine",
    "adopt-key": "keying the history",
    "policy-set": "setting a policy",
}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    """The bytes of ``text``, which must be their one canonical encoding: base64 lets
    several texts (differing in a last character's unused bits) decode alike, and a stored
    signature or key edited that way must read as edited, not as the same value."""
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:
        raise ValueError("not a canonical base64 encoding")
    return data


def _sealing_key(seed: bytes) -> X25519PrivateKey:
    derived = HKDF(hashes.SHA256(), 32, salt=None, info=_SEALING_INFO).derive(seed)
    return X25519PrivateKey.from_private_bytes(derived)


def _reference_cipher(shared: bytes, ephemeral: bytes, recipient: bytes) -> AESGCM:
    key = HKDF(hashes.SHA256(), 32, salt=ephemeral + recipient, info=_REFERENCE_INFO)
    return AESGCM(key.derive(shared))


def message(ledger: str, act: str, fields: dict[str, Any]) -> bytes:
    """What an administrator signs: the act, its fields and the ledger it is for (a
    signature for one ledger, or one act, is worth nothing for another)."""
    return history.canonical_json({"ledger": ledger, "act": act, **fields}).encode("utf-8")


class AdminPublicKey:
    """The public half of an administrator key: checks signatures, seals references."""

    def __init__(self, text: str) -> None:
        if not isinstance(text, str) or not text.startswith(PUBLIC_PREFIX):
            raise ValueError(f"an admin public key starts with {PUBLIC_PREFIX!r}")
        try:
            raw = _unb64(text[len(PUBLIC_PREFIX) :])
        except (binascii.Error, ValueError) as error:
            raise ValueError(f"unreadable admin public key: {error}") from None
        if len(raw) != 64:
            raise ValueError("an admin public key holds two 32-byte keys")
        self.text = text
        self._verifier = Ed25519PublicKey.from_public_bytes(raw[:32])
        self._sealing = raw[32:]

    @property
    def key_id(self) -> str:
        """A short public name for the key (logs, history, the UI)."""
        return hashlib.sha256(self.text.encode("ascii")).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AdminPublicKey) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"AdminPublicKey({self.key_id})"

    def signed(self, data: bytes, signature: object) -> bool:
        """Whether ``signature`` (as stored: text) is this key's over ``data``."""
        if not isinstance(signature, str) or not signature:
            return False
        try:
            self._verifier.verify(_unb64(signature), data)
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True

    def seal(self, facts: dict[str, Any]) -> str:
        """``facts`` encrypted so that only the administrator can read them (a reference).

        Every reference has the same length: the facts are padded to
        :data:`SEALED_SIZE` bytes, never compressed (a length that varied with the
        refusal's kind, a subject's name or an eps would tell them). Facts longer than
        that are refused: the caller keeps them short.
        """
        ephemeral = X25519PrivateKey.generate()
        mine = ephemeral.public_key().public_bytes_raw()
        shared = ephemeral.exchange(X25519PublicKey.from_public_bytes(self._sealing))
        text = history.canonical_json(facts).encode("utf-8")
        if len(text) > SEALED_SIZE:
            raise ValueError(f"sealed facts are at most {SEALED_SIZE} bytes, got {len(text)}")
        plain = text + b" " * (SEALED_SIZE - len(text))
        sealed = _reference_cipher(shared, mine, self._sealing).encrypt(_NONCE, plain, None)
        return REFERENCE_PREFIX + _b64(mine + sealed)


class AdminKey:
    """An administrator's private key: signs administrative acts, opens sealed references.

    Kept in a file readable only by its owner, on the hosts where administrators run
    ``dp-budget`` and on the Airflow api-server (for the UI); never on a worker.
    """

    def __init__(self, seed: bytes) -> None:
        if not isinstance(seed, bytes) or len(seed) != 32:
            raise ValueError("an admin key is a 32-byte seed")
        self._signer = Ed25519PrivateKey.from_private_bytes(seed)
        self._opener = _sealing_key(seed)
        raw = self._signer.public_key().public_bytes_raw()
        self.public = AdminPublicKey(
            PUBLIC_PREFIX + _b64(raw + self._opener.public_key().public_bytes_raw())
        )

    @classmethod
    def generate(cls) -> AdminKey:
        """A new random key (from the OS's CSPRNG)."""
        return cls(os.urandom(32))

    @classmethod
    def from_pem(cls, data: bytes) -> AdminKey:
        """Read a PKCS#8 PEM Ed25519 private key (what :meth:`to_pem` writes)."""
        try:
            key = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError) as error:
            raise ValueError(f"not an admin key (PKCS#8 PEM Ed25519): {error}") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError("an admin key is an Ed25519 private key")
        return cls(key.private_bytes_raw())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AdminKey:
        """Read the key file at ``path``; refuse one that others may read."""
        file = Path(path)
        try:
            mode = file.stat().st_mode
            data = file.read_bytes()
        except OSError as error:
            raise ValueError(f"cannot read the admin key file {file}: {error}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(
                f"the admin key file {file} may be read by others (mode {stat.filemode(mode)}): "
                "chmod 600 it"
            )
        return cls.from_pem(data)

    def to_pem(self) -> bytes:
        """The key as PKCS#8 PEM, for its file."""
        return self._signer.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def write(self, path: str | os.PathLike[str]) -> None:
        """Write the key to a new file only its owner can read (never over an existing one)."""
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as file:
            file.write(self.to_pem())

    def sign(self, data: bytes) -> str:
        """The signature over ``data``, as stored."""
        return _b64(self._signer.sign(data))

    def open(self, reference: str) -> dict[str, Any]:
        """The facts a reference sealed to this key holds."""
        if not isinstance(reference, str) or not reference.startswith(REFERENCE_PREFIX):
            raise ValueError(f"a refusal reference starts with {REFERENCE_PREFIX!r}")
        try:
            raw = _unb64(reference[len(REFERENCE_PREFIX) :].strip())
            ephemeral, sealed = raw[:32], raw[32:]
            shared = self._opener.exchange(X25519PublicKey.from_public_bytes(ephemeral))
            mine = self._opener.public_key().public_bytes_raw()
            plain = _reference_cipher(shared, ephemeral, mine).decrypt(_NONCE, sealed, None)
            return dict(json.loads(plain))
        except (InvalidTag, binascii.Error, ValueError) as error:
            raise ValueError(
                "the reference was not sealed to this admin key, or is damaged "
                f"({type(error).__name__})"
            ) from None


class LedgerAuthority:
    """What one open ledger knows of its administrator: the key whose signatures it
    honours, and (only where an administrator opened it) the key it signs with.

    ``trusted`` is the key recorded in the ledger when it was opened, checked against the
    opener's pin; it is not re-read per release, so a key swapped in the database later is
    not honoured by ledgers already open either. None: the ledger has no administrator
    yet, so nothing can be signed and no policy can change.
    """

    def __init__(
        self, ledger: str, trusted: AdminPublicKey | None, signer: AdminKey | None
    ) -> None:
        self.ledger = ledger
        self.trusted = trusted
        self.signer = signer
        self._checked: dict[tuple[str, str, str], bool] = {}

    def _signed(self, act: str, fields: dict[str, Any], signature: object) -> bool:
        if self.trusted is None:
            return False
        data = message(self.ledger, act, fields)
        memo = (act, data.decode("utf-8"), str(signature))
        known = self._checked.get(memo)
        if known is None:
            if len(self._checked) > 10_000:
                self._checked.clear()
            known = self._checked[memo] = self.trusted.signed(data, signature)
        return known

    def policy_honoured(self, record: dict[str, Any], signature: object) -> bool:
        """Whether a stored policy may be applied: signed by the administrator, or the
        ledger has none (then no policy was ever changed: see :meth:`sign`)."""
        return self.trusted is None or self._signed("policy", record, signature)

    def policy_set_honoured(self, records: list[dict[str, Any]], signature: object) -> bool:
        """Whether the set of policies is the one the administrator signed last (or the
        ledger has none): a row deleted so that a looser policy applies, or one added, is
        not."""
        return self.trusted is None or self._signed("policy-set", {"policies": records}, signature)

    def sign_policy_set(self, records: list[dict[str, Any]]) -> str:
        """The signature over the whole set of policies, kept in ``dp_ledger_config``."""
        return self.sign("policy-set", {"policies": records})

    def cleared(self, epoch: int, clearance: object) -> bool:
        """Whether the ledger's ``epoch``-th quarantine was lifted by the administrator
        (epoch 0: it was never quarantined)."""
        return epoch == 0 or self._signed("clear-quarantine", {"epoch": epoch}, clearance)

    def sign(self, act: str, fields: dict[str, Any]) -> str:
        """The administrator's signature over ``act`` on this ledger; refused unless the
        ledger was opened with its administrator's key."""
        if self.trusted is None:
            raise AdminAuthorityError(
                f"{ACTS[act]}: this ledger has no administrator key yet; record one with "
                "`dp-budget admin init --admin-key FILE`"
            )
        if self.signer is None:
            raise AdminAuthorityError(
                f"{ACTS[act]} is an administrator's act: open the ledger with its administrator "
                f"key (`dp-budget --admin-key FILE`, or ${ADMIN_KEY_ENV}); key "
                f"{self.trusted.key_id}"
            )
        return self.signer.sign(message(self.ledger, act, fields))

    def sign_policy(self, record: dict[str, Any]) -> str:
        """The signature a policy row and its history entry carry."""
        return self.sign("policy", record)
