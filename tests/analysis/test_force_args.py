"""A child's replay is told its forcing on the command line: force_args writes the `--force`
arguments that parse_force reads back as the same forcing, every kind of it."""
from __future__ import annotations

from divergence.analysis.force_spec import force_args, parse_force


def test_force_args_read_back_as_the_forcing():
    items = ["7:gemv", "12:gemm:4", "9:lm_head=gemv", "8:solo", "3:unsharded", "4:o_proj=unsharded",
             "4:down_proj=unsharded", "5:attention=batched", "6:batch-invariant"]
    forced = parse_force(items)
    args = force_args(forced)
    assert args[0::2] == ["--force"] * len(items)
    assert parse_force(args[1::2]) == forced
    assert force_args({}) == []
