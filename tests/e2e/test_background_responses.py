"""Background responses on a real server with two API processes sharing one response store, through the
openai SDK as its users poll, cancel and stream them: ``background: true`` returns the ``queued``
response at once and it ends ``completed`` with the answer a foreground request gives; a cancel stops it
(its engine request aborted) from whichever API process it reaches; a streamed one is followed again
from any event by ``GET ?stream=true&starting_after=N`` on either process, to the same events; a follow-up
waits for its previous response to end; and what cannot be is a 400 naming its field."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from app.api.response_store import ResponseStore
from app.api.responses_background import process_identity
from tests.e2e.conftest import data_url, make_image
from tests.e2e.server import Server, api_process, role_pid, serving, start_serve, wait_api_processes
from tests.paused import paused

pytestmark = pytest.mark.slow

KEY = "sk-background"
HEADERS = {"Authorization": f"Bearer {KEY}"}
ENDED = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # one sequence at a time: a second request waits in the engine's queue while the first runs, and a
    # third finds the engine too busy to take it
    flags = ["--api-key", KEY, "--api-server-count", "2", "--mm-preprocess-processes", "0"]
    flags += ["--max-num-seqs", "1", "--max-waiting-requests", "1"]
    with serving(tiny_model_dir, tmp_path_factory.mktemp("background"), *flags) as srv:
        wait_api_processes(srv, 2)
        yield srv


def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)


def looking_at(seed: int) -> list[dict[str, Any]]:
    image = {"type": "input_image", "image_url": data_url(make_image(seed))}
    return [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, image]}]


def create(server: Server, **fields: Any) -> httpx.Response:
    """On a new connection (the kernel picks the API process anew)."""
    body = {"model": "tiny-llava", "temperature": 0, "max_output_tokens": 8, **fields}
    return httpx.post(f"{server.base_url}/v1/responses", json=body, headers=HEADERS, timeout=120)


def on_each_process(server: Server, method: str, path: str, **kwargs: Any) -> dict[int, httpx.Response]:
    """The same request on new connections until each API process answered one (bounded)."""
    answers: dict[int, httpx.Response] = {}
    for _ in range(60):
        resp = httpx.request(method, f"{server.base_url}{path}", headers=HEADERS, timeout=120, **kwargs)
        answers.setdefault(api_process(resp), resp)
        if len(answers) == 2:
            return answers
    raise AssertionError(f"one API process answered all 60 of {method} {path}")


def polled(client: openai.OpenAI, response_id: str, timeout_s: float = 120.0) -> Any:
    """As a client polls: until the response left queued and in_progress."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status in ENDED:
            return response
        time.sleep(0.05)
    raise AssertionError(f"{response_id} still {response.status} after {timeout_s} s")


def engine_idle(server: Server, timeout_s: float = 30.0) -> bool:
    """Whether the engine runs and queues no request within ``timeout_s`` (its gauges come each step)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if metrics["mmserve_num_requests_running"] == metrics["mmserve_num_requests_waiting"] == 0:
            return True
        time.sleep(0.1)
    return False


def events(resp: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: ")]


def test_a_background_response_is_queued_then_ends_with_the_foreground_answer(server: Server) -> None:
    client = sdk(server)
    queued = client.responses.create(
        model="tiny-llava", input=looking_at(8101), background=True, temperature=0, max_output_tokens=8
    )
    assert queued.status == "queued" and queued.background is True and queued.output == []
    ended = polled(client, queued.id)
    foreground = client.responses.create(
        model="tiny-llava", input=looking_at(8101), temperature=0, max_output_tokens=8, store=False
    )
    assert ended.status == foreground.status and ended.background is True
    assert ended.output_text == foreground.output_text and ended.output_text
    assert ended.usage is not None and foreground.usage is not None
    assert ended.usage.output_tokens == foreground.usage.output_tokens
    # every API process reads the same ended response, and it is followed as any stored one
    for resp in on_each_process(server, "GET", f"/v1/responses/{queued.id}").values():
        assert resp.status_code == 200
        assert resp.json()["output"] == ended.model_dump(exclude_none=True)["output"]
    follow_up = client.responses.create(
        model="tiny-llava", input="And now?", previous_response_id=queued.id, max_output_tokens=2
    )
    assert follow_up.status == "incomplete" and follow_up.usage is not None  # (its 2 tokens)
    assert follow_up.usage.input_tokens > ended.usage.input_tokens
    # cancelling an ended background response returns it as it is (OpenAI's: idempotent)
    assert client.responses.cancel(queued.id).model_dump() == ended.model_dump()


def test_a_cancel_from_either_process_stops_the_answer(server: Server) -> None:
    client = sdk(server)
    for target in (0, 1):  # the cancel reaches the process that makes it, then the other one
        queued = create(server, input="Tell me a story.", background=True, max_output_tokens=4000)
        assert queued.status_code == 200, queued.text
        response_id, maker = queued.json()["id"], api_process(queued)
        cancel = None
        for _ in range(60):
            resp = httpx.post(f"{server.base_url}/v1/responses/{response_id}/cancel", headers=HEADERS)
            if api_process(resp) == (maker if target == 0 else 1 - maker):
                cancel = resp
                break
        assert cancel is not None and cancel.status_code == 200, cancel and cancel.text
        assert cancel.json()["status"] == "cancelled" and cancel.json()["output"] == []
        assert polled(client, response_id).status == "cancelled"
        assert engine_idle(server)  # aborted: a 4000-token answer takes minutes
        again = client.responses.cancel(response_id)
        assert again.status == "cancelled"


def test_a_streamed_background_response_is_followed_again_from_any_event(server: Server) -> None:
    client = sdk(server)
    with client.responses.stream(
        model="tiny-llava", input=looking_at(8102), background=True, temperature=0, max_output_tokens=8
    ) as stream:
        live = [event.model_dump(exclude_none=True) for event in stream]
    kinds = [event["type"] for event in live]
    assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds  # its 8 tokens
    assert [event["sequence_number"] for event in live] == list(range(len(live)))
    assert live[0]["response"]["status"] == "queued"
    final = live[-1]["response"]
    assert polled(client, final["id"]).output_text == final["output"][0]["content"][0]["text"]
    # again, whole and from a cursor, on each API process: the same events
    path = f"/v1/responses/{final['id']}"
    answers = on_each_process(server, "GET", path, params={"stream": "true"})
    again = [events(resp) for resp in answers.values()]
    assert again[0] == again[1]
    assert [(e["type"], e["sequence_number"]) for e in again[0]] == [
        (e["type"], e["sequence_number"]) for e in live
    ]
    assert again[0][-1]["response"] == polled(client, final["id"]).model_dump(exclude_none=True) | {
        key: value for key, value in again[0][-1]["response"].items() if value is None
    }
    cursor = 4
    with client.responses.stream(response_id=final["id"], starting_after=cursor) as resumed:
        rest = [event.model_dump(exclude_none=True) for event in resumed]
    assert rest == live[cursor + 1 :]


def test_a_client_that_dropped_the_stream_picks_it_up_on_the_other_process(server: Server) -> None:
    body = {"model": "tiny-llava", "input": "Tell me a story.", "background": True, "stream": True}
    body |= {"temperature": 0, "max_output_tokens": 1000}
    seen: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{server.base_url}/v1/responses", json=body, headers=HEADERS) as live:
        maker = api_process(live)
        for line in live.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
            if len(seen) == 8:
                break  # the client leaves: the answer goes on
    response_id = seen[0]["response"]["id"]
    rest: list[dict[str, Any]] = []
    for _ in range(60):  # the other API process follows it from the last event seen
        params = {"stream": "true", "starting_after": str(seen[-1]["sequence_number"])}
        url = f"{server.base_url}/v1/responses/{response_id}"
        with httpx.stream("GET", url, params=params, headers=HEADERS, timeout=120) as again:
            if api_process(again) != maker:
                rest = [json.loads(line[6:]) for line in again.iter_lines() if line.startswith("data: ")]
                break
    whole = seen + rest
    assert [event["sequence_number"] for event in whole] == list(range(len(whole)))
    assert whole[-1]["type"] == "response.incomplete"  # its 1000 tokens, none lost
    text = "".join(event["delta"] for event in whole if event["type"] == "response.output_text.delta")
    assert text == whole[-1]["response"]["output"][0]["content"][0]["text"] != ""
    assert polled(sdk(server), response_id).output_text == text


def test_what_a_background_response_cannot_be_is_a_400(server: Server) -> None:
    broken = [
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}
    ]
    cases = [
        ({"input": "Hi", "background": True, "store": False}, "store"),
        (
            {"input": "Hi", "background_options": {"completion_window": "2h"}},
            "background_options.completion_window",
        ),
        # what input processing refuses is refused before the response is queued, as in the foreground
        ({"input": broken, "background": True}, "input[0].content[0].image_url"),
        ({"input": "Hi " * 5000, "background": True}, "input"),
        ({"input": "Hi " * 5000, "background": True, "truncation": "auto"}, "input"),  # no cut fits
    ]
    for fields, param in cases:
        resp = create(server, **fields)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.text
    finished = create(server, input="Hi")
    response_id = finished.json()["id"]
    cancel = httpx.post(f"{server.base_url}/v1/responses/{response_id}/cancel", headers=HEADERS)
    assert cancel.status_code == 400 and "background" in cancel.json()["error"]["message"]
    again = httpx.get(f"{server.base_url}/v1/responses/{response_id}?stream=true", headers=HEADERS)
    assert again.status_code == 400 and again.json()["error"]["param"] == "stream"
    cursor = httpx.get(f"{server.base_url}/v1/responses/{response_id}?starting_after=2", headers=HEADERS)
    assert cursor.status_code == 400 and cursor.json()["error"]["param"] == "starting_after"


def test_a_follow_up_of_a_running_response_waits_for_it_to_end(server: Server) -> None:
    queued = create(server, input="Tell me a story.", background=True, max_output_tokens=4000)
    response_id = queued.json()["id"]
    follow_up = create(server, input="And then?", previous_response_id=response_id)
    assert follow_up.status_code == 400, follow_up.text
    assert follow_up.json()["error"]["param"] == "previous_response_id"
    assert "wait" in follow_up.json()["error"]["message"]
    deleted = httpx.delete(f"{server.base_url}/v1/responses/{response_id}", headers=HEADERS)
    assert deleted.status_code == 200
    gone = httpx.get(f"{server.base_url}/v1/responses/{response_id}", headers=HEADERS)
    assert gone.status_code == 404
    assert engine_idle(server)  # its task stopped, and its request was aborted


def test_a_drain_waits_for_background_responses_and_ends_the_rest_failed(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM: a background response that ends within ``--shutdown-timeout`` is stored whole; one still
    running at the deadline ends ``failed`` (read from the store file after the server exited), never
    ``in_progress`` for ever; so does one whose API process was killed, once a server opens the file."""
    path = tmp_path / "responses.sqlite"
    flags = ("--responses-store", str(path), "--shutdown-timeout", "2")
    draining = start_serve(tiny_model_dir, tmp_path, *flags)
    assert draining.process.proc is not None
    try:
        soon = create(draining, input="Say it.", background=True, max_output_tokens=60).json()["id"]
        never = create(draining, input="Never stop.", background=True, max_output_tokens=4000).json()["id"]
        draining.process.proc.send_signal(signal.SIGTERM)
        assert draining.process.proc.wait(60) == 0, draining.process.log()[-3000:]
    finally:
        draining.process.interrupt()
    store = ResponseStore(path, 10, 1 << 20)
    ended = {rid: store.get("", rid) for rid in (soon, never)}
    assert ended[soon] is not None and ended[soon].response["status"] == "incomplete"  # its 60 tokens
    assert ended[soon].response["output"][0]["content"][0]["text"]
    assert ended[never] is not None and ended[never].response["status"] == "failed"
    assert "shut down" in ended[never].response["error"]["message"]
    # a response an API process was making when it was killed (no drain ran): the next start ends it,
    # even where its pid is a live process's now (the maker is this test's pid with another start time)
    orphan = {**ended[never].response, "id": "resp_orphan", "status": "in_progress", "error": None}
    boot, pid, _ = str(process_identity(os.getpid())).split(":")
    store.put("", "resp_orphan", ended[never].items, orphan, maker=f"{boot}:{pid}:1")
    store.close()
    with serving(tiny_model_dir, tmp_path, *flags) as restarted:
        found = httpx.get(f"{restarted.base_url}/v1/responses/resp_orphan", timeout=30).json()
    assert found["status"] == "failed" and "stopped" in found["error"]["message"]


def test_a_background_response_is_returned_before_the_engine_takes_it(server: Server) -> None:
    client = sdk(server)
    busy = create(server, input="Tell me a story.", background=True, max_output_tokens=4000).json()["id"]
    waiting = create(server, input=looking_at(8103), background=True)  # the engine runs the other one
    assert waiting.status_code == 200 and waiting.json()["status"] == "queued"
    deadline = time.monotonic() + 30  # its task submits it after the 200: then the engine's queue holds it
    while server.metrics()["mmserve_num_requests_waiting"] < 1:
        assert time.monotonic() < deadline, "the queued response never reached the engine"
        time.sleep(0.05)
    # a third: the engine's queue is full (a foreground request gets 429), so it stays queued and waits
    refused = create(server, input="Hi")
    assert refused.status_code == 429, refused.text
    third = create(server, input="And a third.", background=True, max_output_tokens=3)
    assert third.status_code == 200
    assert server.process.proc is not None
    with paused(role_pid(server.process.proc.pid, "worker")):  # the one running cannot end meanwhile
        time.sleep(0.5)
        for response_id in (waiting.json()["id"], third.json()["id"]):
            assert client.responses.retrieve(response_id).status == "queued"  # not yet taken by the engine
    client.responses.cancel(busy)
    assert polled(client, waiting.json()["id"]).status == "incomplete"  # its 8 tokens, once taken
    assert polled(client, third.json()["id"]).status == "incomplete"
