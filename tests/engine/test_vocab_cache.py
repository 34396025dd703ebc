"""engine/vocab.py: the vocabulary's pieces are decoded once per tokenizer and read back
from the user cache dir, equal to a fresh decode, keyed on the tokenizer's files."""
from __future__ import annotations

import shutil
from dataclasses import replace

import pytest

from divergence.engine import vocab
from divergence.engine.kernels.backend_proofs import CACHE_ENV, OFF_ENV
from divergence.engine.model.loading import load_model
from divergence.fixtures import TARGET


@pytest.fixture(scope="module")
def loaded():
    return load_model(TARGET)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(OFF_ENV, raising=False)
    return tmp_path / "cache"


def _n(loaded) -> int:
    return loaded.tokenizer.vocab_size if hasattr(loaded.tokenizer, "vocab_size") else 256


def test_a_second_process_reads_the_pieces_back(loaded, cache, monkeypatch):
    n = _n(loaded)
    fresh = vocab.decode_each(loaded, n)
    assert vocab.pieces(loaded, n) == fresh
    assert len(list(cache.glob("vocab-*.json"))) == 1

    def refuse(*a):
        raise AssertionError("decoded again although the cache holds the pieces")

    monkeypatch.setattr(vocab, "decode_each", refuse)
    assert vocab.pieces(loaded, n) == fresh


def test_another_tokenizer_or_size_is_another_entry(loaded, cache, tmp_path):
    n = _n(loaded)
    vocab.pieces(loaded, n)
    vocab.pieces(loaded, n - 1)
    other = tmp_path / "other"
    shutil.copytree(TARGET, other)
    cfg = other / "tokenizer_config.json"
    cfg.write_text(cfg.read_text().rstrip().rstrip("}") + ', "x_edited": true}')
    vocab.pieces(replace(loaded, path=other), n)
    assert len(list(cache.glob("vocab-*.json"))) == 3


def test_a_corrupt_entry_is_decoded_again(loaded, cache):
    n = _n(loaded)
    want = vocab.pieces(loaded, n)
    (entry,) = cache.glob("vocab-*.json")
    entry.write_text('["truncated')
    assert vocab.pieces(loaded, n) == want
    entry.write_text('["a", "b"]')  # a list of the wrong length
    assert vocab.pieces(loaded, n) == want


def test_off_keeps_nothing_on_disk(loaded, cache, monkeypatch):
    monkeypatch.setenv(OFF_ENV, "off")
    assert vocab.pieces(loaded, _n(loaded)) == vocab.decode_each(loaded, _n(loaded))
    assert not cache.exists() or not list(cache.glob("vocab-*"))


def test_lone_surrogates_survive_the_cache(loaded, cache, monkeypatch):
    odd = ["a", "\udc80", "\ud800x", "é"]
    monkeypatch.setattr(vocab, "decode_each", lambda lm, n: odd[:n])
    assert vocab.pieces(loaded, 4) == odd
    monkeypatch.setattr(vocab, "decode_each", lambda lm, n: pytest.fail("not read back"))
    assert vocab.pieces(loaded, 4) == odd
