"""The response store (app/api/response_store.py) without a server: exact eviction orders under both
bounds, data URLs kept once however many conversations hold them, tenants apart, and one file shared by
two connections (two API processes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.api.response_store import BLOB_PREFIX, ResponseStore

IMAGE_A = "data:image/png;base64," + "A" * 5000
IMAGE_B = "data:image/png;base64," + "B" * 5000


def user(text: str, *images: str) -> dict[str, Any]:
    parts = [{"type": "input_text", "text": text}] + [
        {"type": "input_image", "image_url": url} for url in images
    ]
    return {"type": "message", "role": "user", "content": parts}


def response(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "output": []}


def test_a_stored_conversation_comes_back_with_its_images_in_place() -> None:
    store = ResponseStore(None, 10, 1 << 20)
    items = [user("look", IMAGE_A, "https://example.com/a.png"), user("and this", IMAGE_B)]
    items[1]["content"].append({"type": "input_image", "uuid": "named-before"})  # a media id, no URL
    assert store.put("", "resp_1", items, response("resp_1")) == 0  # stored, nothing evicted
    stored = store.get("", "resp_1")
    assert stored is not None
    assert stored.items == items and stored.response == response("resp_1")
    assert store.get("", "resp_2") is None


def test_an_image_is_kept_once_however_many_conversations_hold_it() -> None:
    store = ResponseStore(None, 10, 1 << 20)
    first = [user("look", IMAGE_A)]
    store.put("", "resp_1", first, response("resp_1"))
    _, one_image = store.totals()
    second = [*first, {"type": "message", "role": "assistant", "content": "ok"}, user("again", IMAGE_A)]
    store.put("", "resp_2", second, response("resp_2"))
    _, both = store.totals()
    assert both - one_image < len(IMAGE_A)  # the second conversation added its text, not the image
    row = store._db.execute("SELECT items FROM responses WHERE id = 'resp_2'").fetchone()
    assert IMAGE_A not in row[0] and BLOB_PREFIX in row[0]
    assert store.delete("", "resp_1")
    stored = store.get("", "resp_2")
    assert stored is not None and stored.items == second  # still held by resp_2
    assert store.delete("", "resp_2") and not store.delete("", "resp_2")
    assert store.totals() == (0, 0)
    assert store._db.execute("SELECT COUNT(*) FROM blobs").fetchone() == (0,)


def test_the_least_recently_used_goes_first_past_the_entry_bound() -> None:
    store = ResponseStore(None, 3, 1 << 20)
    for k in range(3):
        store.put("", f"resp_{k}", [user(str(k))], response(f"resp_{k}"))
    assert store.get("", "resp_0") is not None  # now the most recent: resp_1 is the oldest
    assert store.put("", "resp_3", [user("3")], response("resp_3")) == 1
    assert [store.get("", f"resp_{k}") is not None for k in range(4)] == [True, False, True, True]
    assert store.totals()[0] == 3


def test_the_byte_bound_counts_images_and_evicts_until_it_holds() -> None:
    store = ResponseStore(None, 100, 12_000)  # room for two images, not three
    store.put("", "resp_a", [user("a", IMAGE_A)], response("resp_a"))
    store.put("", "resp_b", [user("b", IMAGE_B)], response("resp_b"))
    assert (
        store.put("", "resp_c", [user("c", "data:image/png;base64," + "C" * 5000)], response("resp_c")) == 1
    )
    assert store.get("", "resp_a") is None
    assert store.get("", "resp_b") is not None and store.get("", "resp_c") is not None
    assert store.totals()[1] <= 12_000
    # one conversation over the whole bound is not stored, and evicts nothing (nor said to be stored)
    assert store.holds([user("big", IMAGE_A)]) and not store.holds([user("big", "data:," + "D" * 20_000)])
    assert None is store.put("", "resp_big", [user("big", "data:," + "D" * 20_000)], response("resp_big"))
    assert store.totals()[0] == 2


def test_another_tenants_id_is_not_found() -> None:
    store = ResponseStore(None, 10, 1 << 20)
    store.put("tenant-a", "resp_1", [user("a")], response("resp_1"))
    assert store.get("tenant-b", "resp_1") is None
    assert not store.delete("tenant-b", "resp_1")
    assert store.get("tenant-a", "resp_1") is not None


@pytest.mark.parametrize(("entries", "megabytes"), [(0, 1), (10, 0)])
def test_a_store_bounded_to_nothing_stores_nothing(entries: int, megabytes: int) -> None:
    store = ResponseStore(None, entries, megabytes << 20)
    assert not store.enabled
    assert store.put("", "resp_1", [user("a")], response("resp_1")) is None
    assert store.get("", "resp_1") is None


def test_two_connections_to_one_file_share_the_store(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite"
    one, other = ResponseStore(path, 2, 1 << 20), ResponseStore(path, 2, 1 << 20)
    one.put("", "resp_1", [user("a", IMAGE_A)], response("resp_1"))
    other.put("", "resp_2", [user("b", IMAGE_A)], response("resp_2"))
    stored = other.get("", "resp_1")
    assert stored is not None and stored.items == [user("a", IMAGE_A)]
    one.put("", "resp_3", [user("c")], response("resp_3"))  # resp_2 is now the least recently used
    assert other.get("", "resp_2") is None and one.totals() == other.totals()
    one.close()
    other.close()
    reopened = ResponseStore(path, 2, 1 << 20)  # a file outlives the server that wrote it
    assert reopened.get("", "resp_3") is not None


def with_id(item: dict[str, Any], item_id: str) -> dict[str, Any]:
    return {**item, "id": item_id}


def test_an_item_is_found_by_its_id_while_any_conversation_that_holds_it_is_stored() -> None:
    store = ResponseStore(None, 10, 1 << 20)
    first = [with_id(user("look", IMAGE_A), "msg_u1")]
    answer = {"type": "message", "role": "assistant", "content": "a cat", "id": "msg_a1"}
    store.put("", "resp_1", [*first, answer], response("resp_1"))
    second = [*first, answer, with_id(user("and now?"), "msg_u2")]
    store.put("", "resp_2", second, response("resp_2"))
    found = store.get_items("", ["msg_u1", "msg_u2", "msg_a1", "msg_unknown"])
    assert found == {"msg_u1": first[0], "msg_u2": second[2], "msg_a1": answer}  # its image in place
    assert store.get_items("other-tenant", ["msg_u1"]) == {}
    assert store.delete("", "resp_2")  # the only holder of msg_u2: gone with it
    assert store.get_items("", ["msg_u2"]) == {}
    assert store.get_items("", ["msg_u1", "msg_a1"]) == {"msg_u1": first[0], "msg_a1": answer}  # in resp_1
    holders = "SELECT COUNT(*) FROM item_holders WHERE response_id = 'resp_2'"
    assert store._db.execute(holders).fetchone() == (0,)


def test_an_evicted_conversations_items_are_not_found() -> None:
    store = ResponseStore(None, 1, 1 << 20)
    store.put("", "resp_1", [with_id(user("one"), "msg_1")], response("resp_1"))
    store.put("", "resp_2", [with_id(user("two"), "msg_2")], response("resp_2"))  # evicts resp_1
    assert store.get_items("", ["msg_1", "msg_2"]).keys() == {"msg_2"}
    assert store._db.execute("SELECT COUNT(*) FROM item_holders").fetchone() == (1,)


def test_many_references_read_each_conversation_once() -> None:
    """Thousands of ids held by one conversation: one read of it, not one per id."""
    store = ResponseStore(None, 10, 64 << 20)
    items = [with_id(user(f"turn {k}"), f"msg_{k}") for k in range(3000)]
    store.put("", "resp_1", items, response("resp_1"))
    reads: list[str] = []
    read = store._get

    def counted(tenant: str, response_id: str) -> Any:
        reads.append(response_id)
        return read(tenant, response_id)

    store._get = counted  # type: ignore[method-assign]
    found = store.get_items("", [f"msg_{k}" for k in range(3000)])
    assert len(found) == 3000 and found["msg_7"] == items[7] and reads == ["resp_1"]
