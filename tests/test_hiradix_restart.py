"""HiRadixCache's saved index: a restarted cache finds its tier's nodes and loads them; a
smaller tier keeps what fits; another model's tier, a corrupted page or an unreadable index
is discarded with a warning; the index is saved while the tier changes."""

from __future__ import annotations

import json
import logging

from test_hiradix_cache import LAYOUT, SEQ_A, SEQ_B, _cache, _computed, _expected, _kv_values, _load

from radixserve.cache.hiradix_cache import INDEX_FILE, HiRadixCache


def _saved(tmp_path, fingerprint="m"):
    cache = _cache(folder=str(tmp_path), fingerprint=fingerprint)
    _computed(cache, SEQ_A)
    _computed(cache, SEQ_A[:8] + SEQ_B[:8])
    cache.close()


def test_a_restarted_cache_finds_its_tier_and_loads_it(tmp_path):
    _saved(tmp_path)
    cache = _cache(folder=str(tmp_path))
    match = cache.match_prefix(SEQ_A, max_tokens=16)
    assert (match.num_tokens, match.host_tokens) == (0, 16)
    cache.check_integrity()
    loaded = _load(cache, SEQ_A[:8] + SEQ_B[:8])
    assert _kv_values(cache, loaded.pages) == _expected(SEQ_A[:8] + SEQ_B[:8])


def test_a_smaller_tier_keeps_the_saved_nodes_it_has_slots_for(tmp_path, caplog):
    _saved(tmp_path)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    b_entry = next(e for e in index["entries"] if e[2][0] == SEQ_B[0])
    assert max(b_entry[3]) == max(s for e in index["entries"] for s in e[3])
    with caplog.at_level(logging.WARNING):
        cache = _cache(folder=str(tmp_path), tier_slots=min(b_entry[3]))
    assert "1 lie past the end of this" in caplog.text
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 16
    assert cache.match_prefix(SEQ_A[:8] + SEQ_B[:8], max_tokens=16).host_tokens == 8
    cache.check_integrity()
    loaded = _load(cache, SEQ_A)
    assert _kv_values(cache, loaded.pages) == _expected(SEQ_A)


def restarted_without_its_tier(tmp_path, caplog, warning: str) -> HiRadixCache:
    """A cache restarted over tmp_path's saved tier that discards all of it (index removed),
    saying `warning`."""
    with caplog.at_level(logging.WARNING):
        cache = _cache(folder=str(tmp_path))
    assert warning in caplog.text
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 0
    assert not (tmp_path / INDEX_FILE).exists()
    cache.check_integrity()
    return cache


def test_a_tier_of_another_model_is_discarded_with_a_warning(tmp_path, caplog):
    _saved(tmp_path, fingerprint="other")
    restarted_without_its_tier(tmp_path, caplog, "another setup (differs in: model)")


def test_a_corrupted_page_drops_its_node_and_what_hangs_below(tmp_path, caplog):
    _saved(tmp_path)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    top = next(e for e in index["entries"] if e[0] == -1)  # the shared first 2 pages
    with open(tmp_path / "kv_tier.bin", "r+b") as f:
        f.seek(top[3][1] * LAYOUT.page_nbytes + 5)
        f.write(b"\x7f")
    with caplog.at_level(logging.WARNING):
        cache = _cache(folder=str(tmp_path))
    assert "failed their checksums" in caplog.text
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 0
    assert cache.tier.num_free == cache.tier.num_slots
    cache.check_integrity()


def test_the_index_is_saved_while_the_tier_changes(tmp_path, monkeypatch):
    import radixserve.cache.hiradix_cache as hiradix

    monkeypatch.setattr(hiradix, "PERSIST_INTERVAL_S", 0.0)
    cache = _cache(folder=str(tmp_path))
    _computed(cache, SEQ_A)  # write-through: saved at once, no close needed
    entries = json.loads((tmp_path / INDEX_FILE).read_text())["entries"]
    assert [e[2] for e in entries] == [SEQ_A]


def test_an_unreadable_index_is_discarded(tmp_path, caplog):
    _saved(tmp_path)
    (tmp_path / INDEX_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        cache = _cache(folder=str(tmp_path))
    assert "unreadable index" in caplog.text
    assert cache.match_prefix(SEQ_A, max_tokens=16).host_tokens == 0
