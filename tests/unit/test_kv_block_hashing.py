"""What a KV block's hash covers: every field of ``hash_block``, the images a block overlaps (and where),
and the request's cache salt; so a prefix-cache hit needs the same tokens, images and salt."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager, block_extra_keys, hash_block
from tests.unit.kv_cache_support import IMG, Req, admit, image


def test_hash_block_separates_every_field() -> None:
    base = hash_block(None, [1, 2, 3], ())
    assert len(base) == 32 and base == hash_block(None, [1, 2, 3], ())
    variants = [
        hash_block(base, [1, 2, 3], ()),
        hash_block(None, [1, 2], ()),
        hash_block(None, [1, 2, 3, 0], ()),
        hash_block(None, [3, 2, 1], ()),
        hash_block(None, [1, 2, 3], (("a", 0),)),
        hash_block(None, [1, 2, 3], (("a", 1),)),
        hash_block(None, [1, 2, 3], (("a", -1),)),
        hash_block(None, [1, 2, 3], (("b", 0),)),
        hash_block(None, [1, 2, 3], (("a", 0), ("b", 0))),
        hash_block(None, [1, 2, 3], (("b", 0), ("a", 0))),
        hash_block(None, [1, 2, 3], (("ab", 0),)),
        hash_block(b"", [1, 2, 3], ()),  # an empty parent is not "no parent"
        hash_block(None, [1, 2, 3], (), cache_salt="s"),  # a salted first block
        hash_block(None, [1, 2, 3], (), cache_salt="t"),
        hash_block(None, [1, 2, 3], (), cache_salt=""),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_block_extra_keys_overlap_and_relative_offsets() -> None:
    feats = [image("a", 2, 3), image("b", 5, 10), image("c", 20, 0)]
    assert block_extra_keys(feats, 0, 4) == (("a", 2),)
    assert block_extra_keys(feats, 4, 8) == (("a", -2), ("b", 1))
    assert block_extra_keys(feats, 8, 12) == (("b", -3),)
    assert block_extra_keys(feats, 15, 20) == ()  # b ends at 15; c has no tokens
    assert block_extra_keys(feats, 0, 2) == ()  # a starts at the block end


def test_requests_of_other_salts_share_no_block() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    admit(m, Req("a", list(range(10)), cache_salt="one"))
    assert m.get_computed_blocks(Req("b", list(range(10)), cache_salt="one")) == (m.block_ids("a")[:2], 8)
    for salt in ("two", None):
        assert m.get_computed_blocks(Req("c", list(range(10)), cache_salt=salt)) == ([], 0)


def test_different_image_behind_same_placeholders_never_hits() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6] + [IMG] * 8 + [7, 8, 9]  # image at [6, 14)
    admit(m, Req("a", prompt, [image("cat", 6, 8)]))
    # the text block before the image hits; block 1 holds text and the image's start: no hit
    assert m.get_computed_blocks(Req("b", prompt, [image("dog", 6, 8)])) == (m.block_ids("a")[:1], 4)
    assert m.get_computed_blocks(Req("c", prompt, [image("cat", 6, 8)])) == (m.block_ids("a")[:4], 16)


def test_same_image_at_another_offset_never_hits_image_blocks() -> None:
    m = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = Req("a", [1, 2, 3, 4] + [IMG] * 8 + [5, 6], [image("cat", 4, 8)])
    admit(m, a)
    # same tokens, but the image starts one token later (the first placeholder is text here)
    b = Req("b", [1, 2, 3, 4] + [IMG] * 8 + [5, 6], [image("cat", 5, 7)])
    assert m.get_computed_blocks(b) == (m.block_ids("a")[:1], 4)
    # the same image placed at 8: its blocks hash by their offset into the image, unlike a's
    c = Req("c", [1, 2, 3, 4, 0, 0, 0, 0] + [IMG] * 8 + [5], [image("cat", 8, 8)])
    admit(m, c)
    d = Req("d", [1, 2, 3, 4] + [IMG] * 8 + [5, 6], [image("cat", 4, 8)])
    assert m.get_computed_blocks(d) == (m.block_ids("a")[:3], 12)
