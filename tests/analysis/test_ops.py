"""The first op whose output bits differ, from two recordings of one step (pure numpy)."""
from __future__ import annotations

import numpy as np

from divergence.analysis.ops import OpRows, first_op_difference

OPS = ("input_layernorm", "q_proj", "k_proj", "v_proj", "attention")


def _side(step, rows, delta_at=None, scale=1e-3):
    r = OpRows(step, rows)
    for layer in range(2):
        for op in OPS:  # the same values on both sides for a (layer, op, position)
            out = {p: np.random.default_rng([layer, OPS.index(op), p]).standard_normal(4).astype(np.float32)
                   for p in sorted(rows)}
            r.outputs[(layer, op)] = out
            r.order.append((layer, op))
    if delta_at is not None:
        layer, op, positions = delta_at
        i = r.order.index((layer, op))
        for key in r.order[i:]:  # a difference propagates to everything after it
            for p in positions:
                r.outputs[key][p] = r.outputs[key][p] + np.float32(scale)
    return r


def test_names_the_first_differing_op_and_the_equal_ones_before_it():
    a = _side(3, {120: 0, 121: 1, 122: 2, 123: 3})
    b = _side(7, {120: 9, 121: 10, 122: 11, 123: 12, 124: 13}, delta_at=(0, "k_proj", [120, 121, 122, 123]),
              scale=3.1e-3)
    d = first_op_difference(a, b)
    assert (d.layer, d.op) == (0, "k_proj") and d.rows_b == [9, 10, 11, 12] and d.rows_a == [0, 1, 2, 3]
    assert d.text().startswith("layer 0 k_proj rows 9-12 differ first (max |Δ| 0.0031); "
                               "input_layernorm and q_proj equal")
    assert d.compared_positions == [120, 121, 122, 123]  # position 124 only B computed


def test_a_later_layer_says_the_earlier_layers_were_equal_and_none_when_all_equal():
    a = _side(3, {5: 0})
    b = _side(4, {5: 2}, delta_at=(1, "attention", [5]))
    d = first_op_difference(a, b)
    assert (d.layer, d.op) == (1, "attention") and "every op of layers 0-0 equal" in d.text()
    assert first_op_difference(a, _side(4, {5: 2})) is None
