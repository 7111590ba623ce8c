"""API keys: ``kvb-<id><secret>``. The id (12 hex digits) is public and names the row; only the
SHA-256 of the secret is stored, and a presented key is checked against it in constant time.
The key itself is shown once, when it is made."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, or_, select, update
from sqlalchemy.orm import Session

from jobs.models import ApiKey
from jobs.store import db_now
from jobs.store.transitions import aware

KEY_PREFIX = "kvb-"
ID_CHARS = 12
# Compared against when the id names no key, so that a miss costs what a hit costs.
_NO_KEY_HASH = hashlib.sha256(b"no such key").hexdigest()


@dataclass(frozen=True)
class KeyInfo:
    """A key as listed: never its secret."""

    id: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class KeyStore:
    """Make, list, revoke and check API keys."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(self, name: str) -> tuple[KeyInfo, str]:
        """A new key named ``name``: its row, and the key (shown to the caller once)."""
        name = name.strip()
        if not name or len(name) > 255 or not name.isprintable():
            raise ValueError("a key name is 1 to 255 printable characters")
        key_id, secret = secrets.token_hex(ID_CHARS // 2), secrets.token_urlsafe(32)
        with Session(self.engine) as session, session.begin():
            row = ApiKey(id=key_id, name=name, secret_hash=_hash(secret),
                         created_at=db_now(session))
            session.add(row)
            info = _info(row)
        return info, f"{KEY_PREFIX}{key_id}{secret}"

    def list(self) -> list[KeyInfo]:
        """Every key, oldest first, revoked ones included."""
        with Session(self.engine) as session:
            return [_info(k) for k in session.scalars(
                select(ApiKey).order_by(ApiKey.created_at, ApiKey.id))]

    def revoke(self, id_or_name: str) -> list[str]:
        """Revoke the key with this id (or every key with this name); return the ids revoked
        now (already revoked keys are left as they are)."""
        with Session(self.engine) as session, session.begin():
            return list(session.scalars(
                update(ApiKey)
                .where(or_(ApiKey.id == id_or_name, ApiKey.name == id_or_name),
                       ApiKey.revoked_at.is_(None))
                .values(revoked_at=db_now(session)).returning(ApiKey.id)))

    def authenticate(self, key: str) -> str | None:
        """The id of the live key ``key`` is; None for a malformed, unknown or revoked key."""
        if not key.startswith(KEY_PREFIX) or len(key) <= len(KEY_PREFIX) + ID_CHARS:
            return None
        key_id = key[len(KEY_PREFIX):len(KEY_PREFIX) + ID_CHARS]
        secret = key[len(KEY_PREFIX) + ID_CHARS:]
        with Session(self.engine) as session:
            row = session.execute(select(ApiKey.secret_hash, ApiKey.revoked_at)
                                  .where(ApiKey.id == key_id)).first()
        stored = row.secret_hash if row is not None else _NO_KEY_HASH
        matches = hmac.compare_digest(stored.encode(), _hash(secret).encode())
        return key_id if matches and row is not None and row.revoked_at is None else None


def _info(row: ApiKey) -> KeyInfo:
    created = aware(row.created_at)
    assert created is not None
    return KeyInfo(id=row.id, name=row.name, created_at=created,
                   revoked_at=aware(row.revoked_at))
