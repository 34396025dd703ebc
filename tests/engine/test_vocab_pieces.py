"""The vocabulary a trace stores: each id decoded alone, built once per loaded model."""
from __future__ import annotations

from divergence.engine.engine import Engine


def test_engines_over_one_model_share_one_vocabulary(target):
    a = Engine(target, None, policy="native")
    b = Engine(target, None, policy="batch-invariant")
    pieces = a.vocab_pieces()
    assert b.vocab_pieces() is pieces  # built once, not once per engine
    assert len(pieces) == a.vocab
    assert all(pieces[i] == target.decode([i]) for i in range(0, a.vocab, 7))
