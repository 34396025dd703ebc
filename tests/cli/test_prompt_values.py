"""Valid input is taken (issue 49): a prompt holding a NUL character, and any integer seed, in a
prompt file, on run's command line and in a server request. A seed is mapped into the engine's
seed space by seed mod 2**63 (docs/prompts.md), the mapped seed is what the trace records, and
a re-run of the trace draws what the run drew."""
from __future__ import annotations

import json

import pytest

from divergence import Trace
from divergence.cli.main import main
from divergence.core.request import SEED_SPACE, Sampling, engine_seed
from divergence.serve.openai_schema import CHAT, COMPLETION, parse
from divergence.workloads.prompts import load_prompts

SEEDS = [0, 7, 2**63 - 1, -1, -7, 2**63, 2**64 + 5, -(2**70) - 3, 10**40]


@pytest.mark.parametrize("seed", SEEDS)
def test_any_integer_seed_maps_into_the_engines_seed_space(seed):
    got = engine_seed(seed)
    assert 0 <= got < SEED_SPACE and (got - seed) % 2**63 == 0
    assert Sampling(0.5, 1.0, seed).seed == got
    assert engine_seed(got) == got, "a mapped seed maps to itself: a trace's seed re-runs as it is"


def test_the_mapping_is_the_documented_table():
    assert [engine_seed(s) for s in (5, -1, -7, 2**63, 2**64 + 5)] == [5, 2**63 - 1, 2**63 - 7, 0, 5]


def test_a_prompt_file_takes_a_nul_and_any_seed(tmp_path):
    f = tmp_path / "p.jsonl"
    lines = [{"id": "nul", "prompt": "a\u0000b"}, {"id": "ctl", "prompt": "\u0001\u001f\u007f", "seed": -1},
             {"id": "big", "prompt": "x", "seed": 2**70}]
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    reqs = load_prompts(f, lambda text: [ord(c) + 1 for c in text])
    assert reqs[0].prompt_text == "a\x00b" and reqs[0].prompt_tokens == (98, 1, 99)
    assert [r.sampling.seed for r in reqs] == [0, 2**63 - 1, 2**70 % 2**63]


def test_an_id_still_holds_no_nul(tmp_path):
    from divergence.errors import PromptError

    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "r\\u0000x", "prompt": "x"}\n')
    with pytest.raises(PromptError, match="'id' holds a NUL character"):
        load_prompts(f, lambda text: [1])


def test_run_records_the_mapped_seed_and_replays_its_draws(tmp_path, capsys):
    """Seeds -1 and 2**63 - 1 are one seed: the same tokens; the trace records 2**63 - 1 for both, and
    a replay of the trace (which reads the seed back) is faithful, draws included."""
    f = tmp_path / "p.jsonl"
    rows = [{"id": "a", "prompt": "The socket module\u0000 provides", "temperature": 0.9, "seed": -1},
            {"id": "b", "prompt": "The socket module\u0000 provides", "temperature": 0.9, "seed": 2**63 - 1},
            {"id": "c", "prompt": "The socket module\u0000 provides", "temperature": 0.9, "seed": 2**64 + 11}]
    f.write_text("".join(json.dumps(x) + "\n" for x in rows))
    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(["run", "--prompts", str(f), "--out", str(out), "--schedules", "serial", "--max-tokens", "8", "--json"])
    err = capsys.readouterr()
    assert rc == 0, err.err
    tokens = {r["id"]: r["tokens"]["serial"] for r in json.loads(err.out)["requests"]}
    assert tokens["a"] == tokens["b"]
    with Trace.open(out / "serial.h5") as t:
        assert {r.id: r.sampling.seed for r in t.requests} == {"a": 2**63 - 1, "b": 2**63 - 1, "c": 11}
    rc = main(["replay", str(out / "serial.h5"), "--json"])
    rep = json.loads(capsys.readouterr().out)
    assert rc == 0 and rep["faithful"], rep


def test_runs_seed_flag_takes_a_negative_seed(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "r1", "prompt": "Create a new", "temperature": 0.7}\n')
    rc = main(["run", "--prompts", str(f), "--out", str(tmp_path / "o"), "--schedules", "serial", "--max-tokens",
               "2", "--seed", "-5", "--json"])
    assert rc == 0, capsys.readouterr().err
    with Trace.open(tmp_path / "o" / "serial.h5") as t:
        assert t.requests[0].sampling.seed == 2**63 - 5


@pytest.mark.parametrize("seed", SEEDS)
def test_the_server_takes_any_integer_seed(seed):
    p = parse({"model": "m", "prompt": "x", "seed": seed, "temperature": 0.5}, COMPLETION, model_ids=("m",), top_k=8)
    assert p.sampling.seed == engine_seed(seed)


def test_the_server_takes_a_nul_in_a_prompt_and_a_message():
    p = parse({"model": "m", "prompt": "a\u0000b"}, COMPLETION, model_ids=("m",), top_k=8)
    assert p.prompt == "a\x00b"
    c = parse({"model": "m", "messages": [{"role": "user", "content": "x\u0000y"}]}, CHAT, model_ids=("m",), top_k=8)
    assert c.messages[0]["content"] == "x\x00y"
