"""Background responses in the response store and their tasks (app/api/response_store.py,
app/api/responses_background.py), without a server: a running response's event log is read from any
cursor and ends with its final object in one write, numbered after its last event; an end comes once (a
cancel is not overwritten by the answer, a second cancel changes nothing); neither a running response
nor one that just ended is evicted; the log's bytes are the response's; a task stopped by the process's
end leaves its response failed, and readers stop with it; a shared store file tells one process's task
of another's cancel; a response whose maker process died (its pid reused or not) ends failed; readers
leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from app.api.response_store import ResponseStore
from app.api.responses_background import SHUTTING_DOWN, BackgroundResponses, maker_alive, process_identity
from app.api.responses_object import closing_event

ITEMS = [{"type": "message", "role": "user", "content": "Hi", "id": "msg_1"}]


def response(response_id: str, status: str, output: list[Any] | None = None) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "status": status, "output": output or []}


def event(number: int, kind: str, **fields: Any) -> tuple[int, str]:
    payload = json.dumps({"type": kind, "sequence_number": number, **fields})
    return number, f"event: {kind}\ndata: {payload}\n\n"


def test_a_log_is_read_from_any_cursor_and_ends_with_the_final_object() -> None:
    store = ResponseStore(None, 10, 1 << 20)
    store.put("", "resp_1", ITEMS, response("resp_1", "queued"), [event(0, "created"), event(1, "queued")])
    assert store.has_event_log("", "resp_1")
    assert store.set_status("", "resp_1", "in_progress")["status"] == "in_progress"  # type: ignore[index]
    assert store.append_events("", "resp_1", [event(2, "delta", delta="a"), event(3, "delta", delta="b")])
    events, status = store.read_events("", "resp_1", 1)
    assert [number for number, _ in events] == [2, 3] and status == "in_progress"
    final = response("resp_1", "completed", [{"type": "message", "content": "ab"}])
    answer = [*ITEMS, {"type": "message", "role": "assistant", "content": "ab", "id": "msg_out"}]
    assert store.finish("", "resp_1", answer, final, closing_event) == 0
    events, status = store.read_events("", "resp_1", 3)
    assert status == "completed" and [number for number, _ in events] == [4]  # numbered next
    closing = json.loads(events[0][1].split("data: ")[1])
    assert closing["type"] == "response.completed" and closing["response"] == final
    stored = store.get("", "resp_1")
    assert stored is not None and stored.response == final and stored.items == answer
    # the log's bytes are the response's: deleting it leaves nothing counted
    assert store.delete("", "resp_1") and store.totals() == (0, 0)
    assert store.read_events("", "resp_1", -1) == ([], None)


def test_an_end_comes_once() -> None:
    store = ResponseStore(None, 10, 1 << 20)
    store.put("", "resp_1", ITEMS, response("resp_1", "in_progress"))
    cancelled = store.set_status("", "resp_1", "cancelled")
    assert cancelled is not None and cancelled["status"] == "cancelled"
    # the answer that comes after is not stored, nor logged; a second cancel or a failure changes nothing
    assert store.finish("", "resp_1", ITEMS, response("resp_1", "completed"), None) is None
    assert not store.append_events("", "resp_1", [event(0, "late")])
    assert store.set_status("", "resp_1", "failed", SHUTTING_DOWN) == cancelled
    assert store.status("", "resp_1") == "cancelled"
    assert store.set_status("", "resp_unknown", "cancelled") is None


def test_a_running_response_is_not_evicted_nor_the_one_just_written() -> None:
    store = ResponseStore(None, 2, 1 << 20)
    store.put("", "resp_running", ITEMS, response("resp_running", "in_progress"))
    for k in range(3):
        store.put("", f"resp_{k}", ITEMS, response(f"resp_{k}", "completed"))
    assert store.status("", "resp_running") == "in_progress"  # the oldest, yet kept
    assert [store.status("", f"resp_{k}") for k in range(3)] == [None, None, "completed"]
    store.finish("", "resp_running", ITEMS, response("resp_running", "completed"))  # (a write: a use)
    for k in (3, 4):
        store.put("", f"resp_{k}", ITEMS, response(f"resp_{k}", "completed"))
    assert store.status("", "resp_running") is None and store.totals()[0] == 2  # now it may go
    # running ones fill the bound: one that ends (or a new one) stays, past the bound, with its end
    full = ResponseStore(None, 2, 1 << 20)
    for name in ("a", "b", "c"):
        log = [event(0, "created")]
        full.put("", f"resp_{name}", ITEMS, response(f"resp_{name}", "in_progress"), log)
    assert full.finish("", "resp_a", ITEMS, response("resp_a", "completed"), closing_event) == 0
    assert full.status("", "resp_a") == "completed"
    assert [n for n, _ in full.read_events("", "resp_a", -1)[0]] == [0, 1]  # its last event written
    full.put("", "resp_d", ITEMS, response("resp_d", "completed"))
    assert full.status("", "resp_d") == "completed" and full.status("", "resp_a") is None


def test_an_answer_over_the_byte_bound_ends_failed() -> None:
    store = ResponseStore(None, 10, 2000)
    store.put("", "resp_1", ITEMS, response("resp_1", "in_progress"))
    huge = response("resp_1", "completed", [{"type": "message", "content": "x" * 5000}])
    assert store.finish("", "resp_1", ITEMS, huge, None) == 0
    stored = store.get("", "resp_1")
    assert stored is not None and stored.response["status"] == "failed" and stored.response["output"] == []
    assert stored.response["error"]["code"] == "server_error"


def test_a_task_stopped_by_the_process_end_leaves_its_response_failed() -> None:
    async def scenario() -> tuple[Any, list[str]]:
        store = ResponseStore(None, 10, 1 << 20)
        store.put("", "resp_1", ITEMS, response("resp_1", "queued"), [event(0, "created")])
        background = BackgroundResponses(store, None)
        background.run(("", "resp_1"), asyncio.sleep(3600))  # an answer that would take an hour
        read = asyncio.create_task(collect(background.events(("", "resp_1"), -1)))
        await asyncio.sleep(0.05)
        assert background.busy
        await background.close()
        texts = await asyncio.wait_for(read, 5)  # the reader stopped with it
        return store.get("", "resp_1"), texts

    stored, texts = asyncio.run(scenario())
    assert stored.response["status"] == "failed" and stored.response["error"] == SHUTTING_DOWN
    assert [json.loads(text.split("data: ")[1])["type"] for text in texts] == ["created", "response.failed"]


def test_a_shared_file_tells_a_task_of_another_process_cancel(tmp_path: Path) -> None:
    async def scenario() -> bool:
        path = tmp_path / "responses.sqlite"
        maker, other = ResponseStore(path, 10, 1 << 20), ResponseStore(path, 10, 1 << 20)
        maker.put("", "resp_1", ITEMS, response("resp_1", "in_progress"))
        background = BackgroundResponses(maker, 0.01)
        stopped = asyncio.Event()

        async def answer() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                stopped.set()
                raise

        background.run(("", "resp_1"), answer())
        await asyncio.sleep(0.05)
        other.set_status("", "resp_1", "cancelled")  # the cancel reaches the other API process
        await asyncio.wait_for(stopped.wait(), 5)
        return maker.status("", "resp_1") == "cancelled"

    assert asyncio.run(scenario())


async def collect(events: Any) -> list[str]:
    return [text async for text in events]


def test_a_response_whose_maker_process_died_ends_failed() -> None:
    store = ResponseStore(None, 10, 1 << 20)
    dead = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while process_identity(dead.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # exited, not yet waited for: a zombie, which runs no more
    assert process_identity(dead.pid) is None
    dead.wait()
    mine = process_identity(os.getpid())
    assert mine is not None and maker_alive(mine)
    boot, _, _ = mine.split(":")
    makers = {
        "orphan": f"{boot}:{dead.pid}:1",
        "reused": f"{boot}:{os.getpid()}:1",  # this pid, started at another time: a reused pid
        "mine": mine,
        "elsewhere": f"another-boot:{dead.pid}:1",  # a process of another host: not told, kept
    }
    for name, maker in makers.items():
        store.put("", f"resp_{name}", ITEMS, response(f"resp_{name}", "in_progress"), [event(0, "x")], maker)
    store.put("", "resp_done", ITEMS, response("resp_done", "completed"))
    assert store.fail_orphans(maker_alive, closing_event) == 2
    statuses = [store.status("", f"resp_{name}") for name in (*makers, "done")]
    assert statuses == ["failed", "failed", "in_progress", "in_progress", "completed"]
    last = store.read_events("", "resp_orphan", 0)[0][0][1]
    assert json.loads(last.split("data: ")[1])["type"] == "response.failed"  # its followers stop there
    # an ended response has no maker left to outlive
    store.set_status("", "resp_mine", "cancelled")
    store.set_status("", "resp_elsewhere", "cancelled")
    assert store.fail_orphans(lambda maker: False, closing_event) == 0


def test_a_reader_leaves_nothing_behind() -> None:
    async def scenario() -> int:
        store = ResponseStore(None, 10, 1 << 20)
        store.put("", "resp_1", ITEMS, response("resp_1", "completed"), [event(0, "created")])
        background = BackgroundResponses(store, 0.01)
        for _ in range(3):
            await collect(background.events(("", "resp_1"), -1))
        return len(background._changed) + len(background._readers)

    assert asyncio.run(scenario()) == 0
