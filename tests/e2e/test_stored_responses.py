"""Stored responses on a real server (two API processes, two API keys, a four-response store), through
the openai SDK: a follow-up by ``previous_response_id`` sends no image, is answered as the whole history
resent would be, and hits the caches; ``GET`` and ``DELETE``; ``store`` false; another key's id is not
found; the least recently used response goes first; a follow-up after an API process reset every
multimodal cache it uses is processed again from the store; both API processes serve one stored
conversation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import data_url, make_image
from tests.e2e.metrics import delta
from tests.e2e.server import API_PROCESS_HEADER, Server, api_process, serving, wait_api_processes

pytestmark = pytest.mark.slow

KEYS = ("sk-store-a", "sk-store-b")
MAX_RESPONSES = 4
MAX_MODEL_LEN = 2048  # three turns with an image each fit, four do not
BLOCK_SIZE = 16  # the KV cache's default: a prefix is cached in whole blocks


@pytest.fixture(scope="module")
def store_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    flags = ["--api-key", KEYS[0], "--api-key", KEYS[1], "--api-server-count", "2"]
    flags += ["--mm-preprocess-processes", "0", "--responses-store-entries", str(MAX_RESPONSES)]
    flags += ["--max-model-len", str(MAX_MODEL_LEN)]
    with serving(tiny_model_dir, tmp_path_factory.mktemp("response-store"), *flags) as srv:
        # the first healthy answer speaks for one process: the other may not listen yet, and until it
        # does every new connection goes to the first
        wait_api_processes(srv, 2)
        yield srv


def client(server: Server, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0)


def looking_at(seed: int) -> list[dict[str, Any]]:
    image = {"type": "input_image", "image_url": data_url(make_image(seed))}
    return [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"}, image]}]


def ask(server: Server, key: str = KEYS[0], sdk: openai.OpenAI | None = None, **fields: Any) -> Any:
    """On a new connection unless ``sdk`` (whose keep-alive connection stays with one API process)."""
    sdk = sdk if sdk is not None else client(server, key)
    return sdk.responses.create(model="tiny-llava", max_output_tokens=5, temperature=0, **fields)


def post(server: Server, body: dict[str, Any], key: str = KEYS[0]) -> httpx.Response:
    """On a new connection: the kernel picks the API process anew."""
    fields = {"model": "tiny-llava", "max_output_tokens": 5, "temperature": 0, **body}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{server.base_url}/v1/responses", json=fields, headers=headers, timeout=120)


def test_a_follow_up_sends_no_image_and_is_the_whole_history_answered(store_server: Server) -> None:
    one_process = client(store_server)  # each API process has its own processor cache: stay with one
    first = ask(store_server, sdk=one_process, input=looking_at(7101))
    before = store_server.metrics()
    follow_up = ask(store_server, sdk=one_process, input="And the colours?", previous_response_id=first.id)
    after = store_server.metrics()
    resent = [
        *looking_at(7101),
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And the colours?"},
    ]
    whole = ask(store_server, input=resent, store=False)
    assert follow_up.output_text == whole.output_text
    assert follow_up.usage is not None and whole.usage is not None and first.usage is not None
    assert follow_up.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 0  # the stored image is a hit
    # and the first turn's KV, image included, is the follow-up's cached prefix (the engine's counters are
    # read through either API process, each with its own copy, so the encoder is checked through this)
    assert follow_up.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - BLOCK_SIZE
    assert follow_up.store and follow_up.previous_response_id == first.id and not whole.store
    assert client(store_server).responses.retrieve(follow_up.id) == follow_up


def test_delete_and_store_false_leave_nothing_to_get_or_follow(store_server: Server) -> None:
    sdk = client(store_server)
    unstored = ask(store_server, input="Hello", store=False)
    stored = ask(store_server, input="Hello")
    assert sdk.responses.retrieve(stored.id, include_obfuscation=False).id == stored.id
    # streaming a response again is for background responses: refused by name, not answered whole
    for query, param in (({"stream": "true"}, "stream"), ({"include[]": "x"}, "include")):
        again = httpx.get(
            f"{store_server.base_url}/v1/responses/{stored.id}",
            params=query,
            headers={"Authorization": f"Bearer {KEYS[0]}"},
        )
        assert again.status_code == 400 and again.json()["error"]["param"] == param, again.text
    deleted = httpx.delete(
        f"{store_server.base_url}/v1/responses/{stored.id}", headers={"Authorization": f"Bearer {KEYS[0]}"}
    )
    assert deleted.status_code == 200 and deleted.json() == {
        "id": stored.id,
        "object": "response",
        "deleted": True,
    }
    for gone in (unstored.id, stored.id):
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(gone)
        resp = post(store_server, {"input": "Go on", "previous_response_id": gone})
        assert resp.status_code == 404
        error = resp.json()["error"]
        assert error["param"] == "previous_response_id" and error["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        sdk.responses.delete(stored.id)


def test_another_keys_response_is_not_found(store_server: Server) -> None:
    mine = ask(store_server, input="Mine")
    other = client(store_server, KEYS[1])
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    assert post(store_server, {"input": "?", "previous_response_id": mine.id}, KEYS[1]).status_code == 404
    assert client(store_server).responses.retrieve(mine.id).id == mine.id


def test_the_least_recently_used_response_goes_first(store_server: Server) -> None:
    before = store_server.metrics()
    made = [ask(store_server, input=f"Number {k}") for k in range(MAX_RESPONSES + 1)]
    after = store_server.metrics()
    assert delta(before, after, "mmserve_responses_evicted_total") >= 1  # at least made[0]
    assert after["mmserve_responses_stored"] == MAX_RESPONSES
    assert after["mmserve_responses_stored_bytes"] > 0
    sdk = client(store_server)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(made[0].id)
    assert [sdk.responses.retrieve(r.id).id for r in made[1:]] == [r.id for r in made[1:]]


def test_after_every_cache_was_reset_a_follow_up_is_processed_again_from_the_store(
    store_server: Server,
) -> None:
    first = ask(store_server, input=looking_at(7102))
    warm = ask(store_server, input="Again?", previous_response_id=first.id)
    # one keep-alive connection, so one API process resets its caches (processor cache, IPC mirror and its
    # receiver-cache partition, the encoder cache) and then answers the follow-up
    with openai.DefaultHttpxClient(timeout=120) as http:
        sdk = openai.OpenAI(
            base_url=f"{store_server.base_url}/v1", api_key=KEYS[0], max_retries=0, http_client=http
        )
        reset = http.post(
            f"{store_server.base_url}/reset_mm_cache", headers={"Authorization": f"Bearer {KEYS[0]}"}
        )
        assert reset.status_code == 200, reset.text
        before = store_server.metrics()
        cold = sdk.responses.with_raw_response.create(
            model="tiny-llava",
            max_output_tokens=5,
            temperature=0,
            input="Again?",
            previous_response_id=first.id,
        )
        after = store_server.metrics()
    answered_by = cold.headers[API_PROCESS_HEADER]
    assert (
        answered_by == reset.headers[API_PROCESS_HEADER]
    )  # the connection stayed with the process that reset
    assert cold.parse().output_text == warm.output_text
    assert delta(before, after, "mmserve_mm_processor_seconds_count") == 1  # processed from stored bytes


def test_both_api_processes_serve_one_stored_conversation(store_server: Server) -> None:
    first = post(store_server, {"input": looking_at(7103)})
    assert first.status_code == 200, first.text
    answers: dict[int, str] = {}
    for _ in range(60):  # follow-ups on new connections until both processes answered one
        resp = post(store_server, {"input": "More?", "previous_response_id": first.json()["id"]})
        assert resp.status_code == 200, resp.text
        answers.setdefault(api_process(resp), resp.json()["output"][0]["content"][0]["text"])
        if len(answers) == 2:
            break
    assert set(answers) == {0, 1} and len(set(answers.values())) == 1


def test_input_items_list_what_a_response_was_made_from(store_server: Server) -> None:
    sdk = client(store_server)
    first = ask(store_server, input=looking_at(7104), instructions="Be brief.")
    follow_up = ask(store_server, input="And now?", previous_response_id=first.id)
    # pages of two, oldest first: the first turn's input and answer, then the follow-up's input (the
    # instructions are no item, and the follow-up's own answer is its output, not its input)
    listed = list(sdk.responses.input_items.list(follow_up.id, order="asc", limit=2))
    assert [(item.type, getattr(item, "role", None)) for item in listed] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert listed[1].id == first.output[0].id and listed[2].content[0].text == "And now?"  # type: ignore[union-attr]
    image = listed[0].content[1]  # type: ignore[union-attr]
    assert image.type == "input_image" and image.image_url is None  # URLs only when asked for
    newest_first = list(sdk.responses.input_items.list(follow_up.id))
    assert [item.id for item in newest_first] == [item.id for item in reversed(listed)]  # ids kept
    with_urls = sdk.responses.input_items.list(
        follow_up.id, order="asc", include=["message.input_image.image_url"]
    )
    assert with_urls.data[0].content[1].image_url == looking_at(7104)[0]["content"][1]["image_url"]  # type: ignore[union-attr]
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    refused = (
        ({"include[]": "nothing.real"}, "include"),
        ({"after": "msg_x"}, "after"),
        ({"limit": "0"}, "limit"),
        ({"order": "up"}, "order"),
        ({"before": "msg_x"}, "before"),
    )
    for query, param in refused:
        resp = httpx.get(
            f"{store_server.base_url}/v1/responses/{follow_up.id}/input_items", params=query, headers=headers
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    with pytest.raises(openai.NotFoundError):
        client(store_server, KEYS[1]).responses.input_items.list(follow_up.id)
    # the listing goes back as input as it is (its null fields, file_id included), or as the SDK dumps it
    raw_items = httpx.get(
        f"{store_server.base_url}/v1/responses/{follow_up.id}/input_items",
        params={"order": "asc", "include[]": "message.input_image.image_url"},
        headers=headers,
    ).json()["data"]
    dumped = [item.model_dump() for item in with_urls.data]
    for again in (raw_items, dumped):
        resp = post(store_server, {"input": again, "store": False})
        assert resp.status_code == 200, resp.text


def test_an_item_reference_is_answered_as_the_item_it_names(store_server: Server) -> None:
    sdk = client(store_server)
    first = ask(store_server, input=looking_at(7105))
    (question,) = sdk.responses.input_items.list(first.id)
    follow_up = ask(store_server, input="And now?", previous_response_id=first.id)
    references = [{"type": "item_reference", "id": question.id}, {"id": first.output[0].id}]  # type optional
    by_reference = ask(
        store_server, input=[*references, {"role": "user", "content": "And now?"}], store=False
    )
    assert by_reference.output_text == follow_up.output_text
    assert by_reference.usage is not None and follow_up.usage is not None
    assert by_reference.usage.input_tokens == follow_up.usage.input_tokens
    # an item the conversation holds already, referred to or sent again: a duplicate, refused
    twice = [{"id": question.id}, {"role": "user", "content": "Again?", "id": question.id}]
    for dup, where in (([{"id": question.id}], 0), (twice, 1)):
        fields = {"previous_response_id": first.id} if where == 0 else {}
        resp = post(store_server, {"input": dup, **fields})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == f"input[{where}].id", resp.text
    for key, item_id in ((KEYS[0], "msg_unknown"), (KEYS[1], question.id)):  # another key's item: not found
        resp = post(store_server, {"input": [{"type": "item_reference", "id": item_id}]}, key)
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "input[0].id", resp.text


def test_input_tokens_count_what_the_response_is_made_of(store_server: Server) -> None:
    one_process = client(store_server)
    first = ask(store_server, sdk=one_process, input=looking_at(7106), instructions="Be brief.")
    counted = one_process.responses.input_tokens.count(
        model="tiny-llava",
        input=looking_at(7106),
        instructions="Be brief.",  # type: ignore[arg-type]
    )
    assert first.usage is not None and counted.input_tokens == first.usage.input_tokens
    counted = one_process.responses.input_tokens.count(input="And now?", previous_response_id=first.id)
    follow_up = ask(store_server, sdk=one_process, input="And now?", previous_response_id=first.id)
    assert follow_up.usage is not None and counted.input_tokens == follow_up.usage.input_tokens
    # no input at all after a stored response: the model answers again, after its own answer
    again = ask(store_server, sdk=one_process, previous_response_id=first.id)
    assert again.usage is not None and again.usage.input_tokens > first.usage.input_tokens
    resp = post(store_server, {"input": None})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "input", resp.text


def test_a_stored_response_cannot_be_cancelled(store_server: Server) -> None:
    stored = ask(store_server, input="Hello")
    assert stored.temperature == 0 and stored.top_p is not None  # the values in effect, not null
    with pytest.raises(openai.BadRequestError):
        client(store_server).responses.cancel(stored.id)
    with pytest.raises(openai.NotFoundError):
        client(store_server).responses.cancel("resp_unknown")


def test_truncation_auto_drops_the_oldest_turns_to_fit(store_server: Server) -> None:
    one_process = client(store_server)  # (the turns' images stay in one processor cache)
    response_id = None
    for k in range(3):
        fields = {"previous_response_id": response_id} if response_id else {}
        response_id = ask(store_server, sdk=one_process, input=looking_at(7110 + k), **fields).id
    fourth = {"input": looking_at(7113), "previous_response_id": response_id}
    too_long = post(store_server, fourth)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    error = too_long.json()["error"]
    assert (
        error["param"] == "input"
        and "the input is" in error["message"]
        and "messages" not in error["message"]
    )
    fitted = ask(store_server, sdk=one_process, truncation="auto", **fourth)
    assert fitted.truncation == "auto" and fitted.usage is not None
    # the first turn (its question and answer) dropped: as the later turns sent alone
    urls = ["message.input_image.image_url"]
    whole = list(one_process.responses.input_items.list(fitted.id, order="asc", include=urls))
    assert len(whole) == 7  # the stored conversation stays whole: four questions, three answers
    resent = [item.model_dump(exclude_none=True) for item in whole[2:]]
    counted = one_process.responses.input_tokens.count(input=resent)  # type: ignore[arg-type]
    assert fitted.usage.input_tokens == counted.input_tokens < MAX_MODEL_LEN
    assert (
        one_process.responses.input_tokens.count(truncation="auto", **fourth).input_tokens
        == counted.input_tokens
    )  # type: ignore[arg-type]
