"""probe --tp N: with two ranks a + b = b + a, so the all-reduce cannot depend on the
message size; with three, the ring's segments follow the buffer size and so does the
order of each element's sum."""
from __future__ import annotations

import json

from .conftest import cli


def _probe(n):
    r = cli("probe", "--tp", n, "--rows", "1,2,3,5,8,16,33", "--json")
    assert r.returncode == 0, r.stderr
    return {o["dtype"]: o for o in json.loads(r.stdout)["allreduce"]}


def test_two_ranks_all_reduce_is_size_invariant():
    got = _probe(2)
    assert set(got) == {"float32", "bfloat16"}
    for o in got.values():
        assert o["ranks"] == 2 and o["backend"] == "ring"
        assert o["size_invariant"] and set(o["classes"]) == {0}
        assert all(o["equals_rank_order"])


def test_three_ranks_all_reduce_depends_on_the_message_size():
    got = _probe(3)
    for o in got.values():
        assert o["ranks"] == 3 and not o["size_invariant"], o
        assert o["classes"][0] == 0 and any(c != 0 for c in o["classes"][1:])
