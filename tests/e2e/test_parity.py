"""Greedy output of the served pipeline equals transformers' ``generate`` on the same checkpoint."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import Oracle, make_image
from tests.e2e.parity import assert_matches_oracle, greedy_request
from tests.e2e.server import Server

pytestmark = pytest.mark.slow


def test_one_image_greedy_equals_generate(server: Server, oracle: Oracle) -> None:
    images = [make_image(1)]
    text = "What is in this image?"
    assert_matches_oracle(greedy_request(server, text, images), oracle, text, images)


def test_two_images_greedy_equals_generate(server: Server, oracle: Oracle) -> None:
    images = [make_image(2, (500, 300)), make_image(3, (200, 400))]
    text = "Compare these two pictures."
    assert_matches_oracle(greedy_request(server, text, images), oracle, text, images)


def test_text_only_greedy_equals_generate(server: Server, oracle: Oracle) -> None:
    text = "Tell me a story about a cat."
    assert_matches_oracle(greedy_request(server, text, []), oracle, text, [])
