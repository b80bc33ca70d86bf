"""The proxy's Responses API pieces (app/proxy/responses.py) without upstreams: a Responses body's
images as the chat image parts an encoder takes (distinct by URL, media ids kept, nothing else), and the
bounded memory of which LM instance made each response."""

from __future__ import annotations

from app.proxy.responses import ResponseHolders, responses_media_parts


def test_input_images_are_the_chat_parts_an_encoder_takes() -> None:
    body = {
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "https://a.example/1.png", "detail": "high"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "uuid": "shot-1"},
                ],
            },
            {"type": "function_call", "call_id": "c", "name": "click", "arguments": "{}"},
            {"role": "user", "content": [{"type": "input_image", "image_url": "https://a.example/1.png"}]},
            {"role": "user", "content": [{"type": "input_image", "uuid": "named-before"}]},  # no URL: nothing
            {"role": "user", "content": "a string"},
        ]
    }
    assert responses_media_parts(body) == [
        {"type": "image_url", "image_url": {"url": "https://a.example/1.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}, "uuid": "shot-1"},
    ]
    assert responses_media_parts({"input": "a string"}) == responses_media_parts({}) == []


def test_the_memory_of_makers_is_bounded_least_recently_used_first() -> None:
    holders = ResponseHolders(max_ids=2)
    holders.learn("resp_a", "http://lm-1")
    holders.learn("resp_b", "http://lm-2")
    assert holders.get("resp_a") == "http://lm-1"  # now the most recent
    holders.learn("resp_c", "http://lm-1")
    assert (holders.get("resp_a"), holders.get("resp_b"), holders.get("resp_c")) == (
        "http://lm-1",
        None,
        "http://lm-1",
    )
