"""The media-affinity router's bookkeeping and the ingress's media keys, without a cluster
(docs/architecture.md, "Replicas on Ray Serve"); tests/e2e/test_ray_serve.py runs them on one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.ray_serve.affinity import AffinityTable, Placement
from app.ray_serve.media_keys import media_keys

REPO = Path(__file__).resolve().parents[2]


def chat(*parts: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, *parts]}],
        **fields,
    }


def image(url: str | None, uuid: str | None = None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url} if url is not None else None}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def keys(body: Any, tenant: str = "", isolate: bool = False) -> tuple[str, ...]:
    return media_keys(body, tenant=tenant, isolate_tenants=isolate)


def test_media_keys_follow_the_caches_identities() -> None:
    one, two = "data:image/png;base64,AAAA", "https://example.com/a.png"
    assert len(keys(chat(image(one), image(two), image(one)))) == 2  # distinct, first appearance first
    assert keys(chat(image(one))) == keys(chat(image(one)))[:1] == keys(chat(image(one), image(two)))[:1]
    assert keys(chat(image(one))) != keys(chat({"type": "video_url", "video_url": {"url": one}}))
    salted = keys(chat(image(one), cache_salt="s"))
    assert salted != keys(chat(image(one))) and salted == keys(chat(image(one), cache_salt="s"))
    assert keys(chat(image(one), mm_processor_kwargs={"x": 1})) != keys(chat(image(one)))
    # tenant isolation: each key's own salt, as the API process's cache scope
    assert keys(chat(image(one)), "t1", isolate=True) != keys(chat(image(one)), "t2", isolate=True)
    assert keys(chat(image(one)), "t1") == keys(chat(image(one)), "t2")


def test_a_media_id_is_its_tenants_and_a_binding_part_has_both_keys() -> None:
    url = "data:image/png;base64,AAAA"
    by_url, by_id = keys(chat(image(url)), "t1"), keys(chat(image(None, uuid="doc")), "t1")
    assert keys(chat(image(url, uuid="doc")), "t1") == by_url + by_id  # binding: both
    assert by_id != keys(chat(image(None, uuid="doc")), "t2")


def test_responses_input_images_and_bodies_without_media() -> None:
    item = {"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}
    assert keys({"input": [item]}) == keys(chat(image("https://example.com/a.png")))
    for body in (
        None,
        [],
        "text",
        {"messages": "no"},
        {"input": "hello"},
        chat({"type": "text"}),
        {"messages": [1]},
    ):
        assert keys(body) == ()


def test_a_follow_up_is_keyed_by_the_response_it_follows() -> None:
    from app.ray_serve.media_keys import response_key

    follow_up = {"input": "And?", "previous_response_id": "resp_1"}
    assert keys(follow_up, "t1") == (response_key("t1", "resp_1"),) != keys(follow_up, "t2")


def test_a_stored_response_is_fetched_and_deleted_where_it_was_made() -> None:
    from app.ray_serve.media_keys import response_key, stored_response_keys

    for method in ("GET", "DELETE"):
        assert stored_response_keys(method, "/v1/responses/resp_1", "t1") == (response_key("t1", "resp_1"),)
    assert stored_response_keys("GET", "/v1/responses/resp_1", "t2") != (response_key("t1", "resp_1"),)
    for method, below in (("GET", "/input_items"), ("POST", "/cancel")):
        assert stored_response_keys(method, f"/v1/responses/resp_1{below}", "t1") == (
            response_key("t1", "resp_1"),
        )
    others = [("POST", "/v1/responses/resp_1"), ("GET", "/v1/responses/"), ("GET", "/v1/models")]
    others += [("GET", "/v1/responses/resp_1/"), ("POST", "/v1/responses/resp_1/input_items")]
    others += [("GET", "/v1/responses/resp_1/cancel"), ("GET", "/v1/responses/resp_1/input_items/x")]
    others += [("POST", "/v1/responses/input_tokens"), ("GET", "/v1/responses//input_items")]
    for method, path in others:
        assert stored_response_keys(method, path, "t1") == (), path


def test_an_item_reference_is_keyed_by_the_response_that_made_the_item() -> None:
    from app.api.response_ids import followed_responses
    from app.api.response_items import output_item_id, with_ids
    from app.ray_serve.media_keys import response_key

    made, other = "resp_" + "ab" * 16, "resp_" + "cd" * 16
    (question,) = with_ids([{"role": "user", "content": "?"}], made)
    references = [{"type": "item_reference", "id": question["id"]}, {"id": output_item_id("message", other)}]
    references += [{"type": "item_reference", "id": "msg_client_given"}]
    body = {"input": [*references, {"role": "user", "content": "And?"}]}
    assert followed_responses(body) == [made, other]
    assert keys(body, "t1") == (response_key("t1", made), response_key("t1", other)) != keys(body, "t2")
    body = {
        "input": [{"role": "user", "content": "?", "id": question["id"]}],
        "previous_response_id": "resp_1",
    }
    assert followed_responses(body) == ["resp_1"]  # an item sent whole is no reference


def test_a_body_that_is_not_strict_json_has_no_keys() -> None:
    """As the API process reads bodies: a lone surrogate escape (no Unicode text, which no key could be
    made of), NaN or a syntax error give no keys; the replica answers the 400."""
    from app.api.response_ids import json_or_none

    url = "data:image/png;base64,AAAA"
    assert keys(json_or_none(json.dumps(chat(image(url))).encode())) == keys(chat(image(url)))
    for bad in (
        b'{"messages": [{"content": [{"type": "image_url", "image_url": {"url": "\\ud800"}}]}]}',
        b'{"temperature": NaN}',
        b'{"messages": [',
    ):
        assert json_or_none(bad) is None and keys(json_or_none(bad)) == ()


def test_a_response_s_id_is_found_in_a_stream_s_first_event_or_a_whole_json_answer() -> None:
    from app.api.response_ids import ResponseIdWatch

    learnt: list[str] = []
    watch = ResponseIdWatch(learnt.append, streamed=True)
    event = b'event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_9"}}\n\n'
    watch.feed(event[:20])
    assert not watch.done and not learnt
    watch.feed(event[20:] + b"event: more")
    assert watch.done and learnt == ["resp_9"]
    watch.feed(b'data: {"response": {"id": "resp_other"}}\n\n')  # only the first event counts
    silent = ResponseIdWatch(learnt.append, streamed=True)
    silent.feed(b"data: [DONE]\n\n")
    assert silent.done and learnt == ["resp_9"]

    whole = ResponseIdWatch(learnt.append, streamed=False)
    answer = b'{"id": "resp_10", "object": "response", "output": []}'
    whole.feed(answer[:9])
    whole.feed(answer[9:])
    assert learnt == ["resp_9"]  # not before the answer ends
    whole.finish()
    assert learnt == ["resp_9", "resp_10"]
    refused = ResponseIdWatch(learnt.append, streamed=False)
    refused.feed(b"not json")
    refused.finish()
    huge = ResponseIdWatch(learnt.append, streamed=False)
    huge.feed(b'{"id": "resp_11", "pad": "' + b"x" * ResponseIdWatch.MAX_BYTES + b'"}')
    huge.finish()
    assert learnt == ["resp_9", "resp_10"]


def test_repeats_go_where_the_media_is_held_within_the_imbalance_bound() -> None:
    table = AffinityTable()
    idle = {"a": 0, "b": 0}
    first = table.choose(["k1"], idle, imbalance_threshold=2)
    assert first.placement(first.preferred[0]) is Placement.NEW
    table.place(["k1"], "a")
    second = table.choose(["k2"], idle, imbalance_threshold=2)
    assert second.preferred == ("b",)  # new media spreads: b holds fewer keys
    assert table.choose(["k1"], {"a": 2, "b": 0}, 2).preferred == ("a",)  # within the bound
    over = table.choose(["k1"], {"a": 3, "b": 0}, 2)
    assert over.preferred == ("b",) and over.placement("b") is Placement.FALLBACK
    assert table.choose(["k1"], idle, 2).placement("a") is Placement.AFFINITY


def test_a_stored_response_only_its_holder_has_goes_there_whatever_the_queues() -> None:
    """Without a shared response store only the replica that made a response can serve its follow-ups,
    GET and DELETE: no imbalance fallback for them (another replica would answer 404)."""
    table = AffinityTable()
    table.place(["resp"], "a")
    assert table.choose(["resp"], {"a": 50, "b": 0}, 2).preferred == ("b",)  # media alone: balanced
    holder = table.choose(["resp", "img"], {"a": 50, "b": 0}, 2, holder_only=True)
    assert holder.preferred == ("a",) and holder.placement("a") is Placement.AFFINITY
    nowhere = table.choose(["other"], {"a": 0, "b": 0}, 2, holder_only=True)
    assert nowhere.holders == ()  # held nowhere known: the least loaded (the router then places nothing)


def test_reports_count_and_a_dead_replica_takes_its_keys() -> None:
    table = AffinityTable()
    table.report("b", ["k1", "k2"])
    table.place(["k3"], "a")
    assert table.choose(["k1", "k3", "k2"], {"a": 0, "b": 0}, 0).preferred == ("b",)  # holds two of three
    table.forget("b")
    assert table.held_by(["k1", "k2"], "b") == 0
    assert table.choose(["k1", "k3"], {"a": 0}, 0).preferred == ("a",)


def test_placements_are_bounded() -> None:
    table = AffinityTable(max_placements=3)
    for k in range(5):
        table.place([f"k{k}"], "a")
    assert table.num_placements() == 3 and table.held_by(["k0", "k1"], "a") == 0
    assert table.num_keys("a") == 3


def test_the_serve_config_file_builds_the_application() -> None:
    pytest.importorskip("ray.serve")
    from ray.serve.schema import ServeDeploySchema

    from app.ray_serve.app import RayAppArgs, build_app

    config = ServeDeploySchema.model_validate(yaml.safe_load((REPO / "deploy/ray-serve.yaml").read_text()))
    (application,) = config.applications
    assert application.import_path == "app.ray_serve.app:build_app"
    assert RayAppArgs.model_validate(application.args).replicas == 2
    assert build_app(application.args) is not None


def test_each_replica_reserves_the_cpus_and_gpus_asked() -> None:
    pytest.importorskip("ray.serve")
    from app.ray_serve.app import build_app

    application = build_app(
        {"replicas": 3, "replica_cpus": 4, "replica_gpus": 1, "settings": {"model": "/m"}}
    )
    # the ingress is bound to the replicas' deployment (Ray 2.60's Application keeps both bindings)
    ingress = application._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    assert replica.num_replicas == 3
    assert replica.ray_actor_options["num_cpus"] == 4 and replica.ray_actor_options["num_gpus"] == 1
    assert replica.ray_actor_options["runtime_env"]["env_vars"]["MMSERVE_MODEL"] == "/m"
    assert ingress.ray_actor_options["num_cpus"] == 0 and not ingress.ray_actor_options.get("num_gpus")


def test_every_placement_is_exported_at_0_before_the_first() -> None:
    """As an instance's counters: ``rate()`` then shows the first fallback."""
    from prometheus_client import generate_latest

    from app.ray_serve import router_state

    exported = generate_latest(router_state.PLACEMENTS).decode()
    for placement in Placement:
        assert f'mmserve_ray_placements_total{{placement="{placement}"}}' in exported
