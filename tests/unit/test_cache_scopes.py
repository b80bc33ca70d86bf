"""Cache scopes and media-id bindings without processes: which salt a request gets, and the bindings'
keys and least-recently-used order."""

from __future__ import annotations

from pathlib import Path

from app.inputs.media_ids import CacheScope, LocalMediaIds, MediaBinding, binding_key
from app.inputs.shared_media_ids import SharedMediaIds, media_ids_for
from app.settings import Settings
from wire.hashing import mm_hash
from workers.families.processing import ItemLayout


def test_a_salt_gives_the_same_media_another_key() -> None:
    def key(salt: str | None) -> str:
        return mm_hash(model_id="m", modality="image", data=b"png", options={}, salt=salt)

    assert key(None) == mm_hash(model_id="m", modality="image", data=b"png", options={})
    assert len({key(None), key("a"), key("b"), key("")}) == 4
    assert key("a") == key("a")


def test_scopes_by_salt_and_with_isolation_by_tenant() -> None:
    def scope(tenant: str, salt: str | None, isolate: bool) -> CacheScope:
        return CacheScope.of(tenant=tenant, cache_salt=salt, isolate_tenants=isolate)

    assert scope("", None, False).salt is None and scope("t1", None, False).salt is None
    assert scope("t1", "s", False).salt == scope("t2", "s", False).salt  # one salt shares, as in vLLM
    assert scope("t1", "s", False).salt != scope("t1", "r", False).salt
    isolated = {scope(t, s, True).salt for t in ("t1", "t2") for s in (None, "s")}
    assert len(isolated) == 4 and None not in isolated
    assert scope("t1", "s", False).salt not in isolated  # a tenant's salt is not anybody's plain salt
    assert scope("", "s", True).salt == scope("", "s", False).salt  # no keys: nothing to isolate


def test_bindings_are_per_tenant_and_salt_and_least_recently_used_go_first() -> None:
    ids = LocalMediaIds(max_entries=2)
    plain, salted, other = CacheScope("t1", None), CacheScope("t1", "x"), CacheScope("t2", None)
    ids.bind(binding_key(plain, "u"), MediaBinding("h1", "image", {}))
    assert ids.get(binding_key(salted, "u")) is None and ids.get(binding_key(other, "u")) is None
    ids.bind(binding_key(other, "u"), MediaBinding("h2", "image", {}))
    assert ids.get(binding_key(plain, "u")) == MediaBinding("h1", "image", {})  # now the most recent
    ids.bind(binding_key(salted, "u"), MediaBinding("h3", "image", {}))  # evicts other's
    assert ids.get(binding_key(other, "u")) is None and len(ids) == 2
    ids.bind(binding_key(plain, "u"), MediaBinding("h4", "image", {}))  # rebinds
    assert ids.get(binding_key(plain, "u")) == MediaBinding("h4", "image", {}) and len(ids) == 2
    off = LocalMediaIds(max_entries=0)
    off.bind(binding_key(plain, "u"), MediaBinding("h1", "image", {}))
    assert off.get(binding_key(plain, "u")) is None


def test_a_shared_store_serves_every_process_that_opens_it(tmp_path: Path) -> None:
    path = tmp_path / "ids.sqlite"
    one, two = SharedMediaIds(path, max_entries=2), SharedMediaIds(path, max_entries=2)
    scope = CacheScope("t1", None)
    layout = ItemLayout(576, (1, 24, 24))
    one.bind(binding_key(scope, "a"), MediaBinding("h1", "image", {"size": {"height": 2}}, layout))
    assert two.get(binding_key(scope, "a")) == MediaBinding("h1", "image", {"size": {"height": 2}}, layout)
    assert two.get(binding_key(CacheScope("t2", None), "a")) is None
    two.bind(binding_key(scope, "b"), MediaBinding("h2", "video", {}))
    assert one.get(binding_key(scope, "a")) is not None  # a is now more recent than b
    one.bind(binding_key(scope, "c"), MediaBinding("h3", "image", {}))  # b goes
    assert two.get(binding_key(scope, "b")) is None and len(one) == len(two) == 2
    two.bind(binding_key(scope, "a"), MediaBinding("h4", "image", {}))  # a rebind adds no entry
    assert one.get(binding_key(scope, "a")) == MediaBinding("h4", "image", {}) and len(one) == 2
    one.close()
    two.close()


def test_settings_pick_the_store(tmp_path: Path) -> None:
    assert isinstance(media_ids_for(Settings()), LocalMediaIds)
    shared = media_ids_for(Settings(mm_uuid_store=str(tmp_path / "ids.sqlite")))
    assert isinstance(shared, SharedMediaIds)
