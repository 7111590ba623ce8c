"""API keys (``jobs.api.keys``) on a real PostgreSQL schema, value by value: the key's shape and
what is stored of it, the names accepted, the list's order and revocation times, revoking by id
and by name, and every way ``authenticate`` refuses a key."""

from __future__ import annotations

import hashlib
import re

import pytest
from sqlalchemy import Engine

from jobs.api.keys import KeyStore


def test_a_key_is_the_prefix_its_public_id_and_a_secret_stored_hashed(pg_engine: Engine) -> None:
    store = KeyStore(pg_engine)
    info, key = store.create("  pipeline  ")
    assert re.fullmatch(r"kvb-[0-9a-f]{12}[A-Za-z0-9_-]{43}", key), key
    assert info.id == key[4:16] and info.name == "pipeline" and info.revoked_at is None
    with pg_engine.connect() as conn:
        stored = conn.exec_driver_sql("SELECT name, secret_hash FROM api_keys").one()
    assert stored == ("pipeline", hashlib.sha256(key[16:].encode()).hexdigest())
    assert store.authenticate(key) == info.id


@pytest.mark.parametrize("name", ["", "   ", "x" * 256, "a\nb", "tab\there", "nul\x00"])
def test_names_that_are_refused(pg_engine: Engine, name: str) -> None:
    with pytest.raises(ValueError, match="1 to 255 printable characters"):
        KeyStore(pg_engine).create(name)
    assert KeyStore(pg_engine).list() == []


def test_names_at_the_bounds_are_accepted(pg_engine: Engine) -> None:
    store = KeyStore(pg_engine)
    assert store.create("x" * 255)[0].name == "x" * 255
    assert store.create(" y ")[0].name == "y"
    assert store.create("émoji ✓")[0].name == "émoji ✓"


def test_list_is_oldest_first_and_shows_revocations(pg_engine: Engine) -> None:
    store = KeyStore(pg_engine)
    made = [store.create(name)[0] for name in ("a", "b", "c", "b")]
    assert [k.id for k in store.list()] == [k.id for k in made]
    assert sorted(store.revoke("b")) == sorted([made[1].id, made[3].id])  # every key so named
    assert store.revoke(made[0].id) == [made[0].id]  # by id
    assert store.revoke("b") == [] and store.revoke(made[0].id) == []  # already revoked
    assert store.revoke("nobody") == []
    listed = {k.id: k for k in store.list()}
    for k in (made[0], made[1], made[3]):
        revoked = listed[k.id].revoked_at
        assert revoked is not None and revoked >= listed[k.id].created_at
        assert revoked.tzinfo is not None
    assert listed[made[2].id].revoked_at is None
    assert listed[made[2].id].created_at == made[2].created_at


def test_revoking_again_keeps_the_first_revocation_time(pg_engine: Engine) -> None:
    store = KeyStore(pg_engine)
    info, _ = store.create("a")
    store.revoke("a")
    [first] = store.list()
    store.create("a")
    store.revoke("a")  # the new one only
    assert {k.id: k.revoked_at for k in store.list()}[info.id] == first.revoked_at


def test_authenticate_refuses_every_other_key(pg_engine: Engine) -> None:
    store = KeyStore(pg_engine)
    alice, key = store.create("alice")
    bob, bob_key = store.create("bob")
    assert store.authenticate(key) == alice.id and store.authenticate(bob_key) == bob.id
    for wrong in ("xyz-" + key[4:],  # another prefix, the same id and secret
                  key[4:],  # no prefix
                  key[:16],  # the id with no secret
                  key[:16] + bob_key[16:],  # alice's id with bob's secret
                  key[:-1],  # a character short
                  key + "x",  # a character more
                  "kvb-000000000000" + key[16:],  # an id that names no key
                  "", "kvb-"):
        assert store.authenticate(wrong) is None, wrong
    store.revoke(alice.id)
    assert store.authenticate(key) is None and store.authenticate(bob_key) == bob.id
