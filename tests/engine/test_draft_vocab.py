"""Which drafts can serve a target. One tokenizer is required (every token the same id);
heads may differ in padding past the tokenizer's tokens (Qwen2.5 0.5B has 151,936 rows and
7B 152,064, for one tokenizer of 151,665 tokens): such a draft proposes from the columns
both heads have. A head that misses some of the tokenizer's tokens, or another tokenizer,
is refused when the engine is made: one line, exit 2."""
from __future__ import annotations

import json
import shutil

import pytest

from divergence.cli.main import main
from divergence.cli.common import default_model_dirs
from divergence.core.request import Request
from divergence.errors import ModelLoadError
from divergence.testing.models import make_random_model

TOKENS = 1024  # the fixture tokenizer's


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    out = {n: make_random_model(root / f"v{n}", vocab_size=n, seed=n) for n in (1024, 2048, 512)}
    # another tokenizer of as many tokens: two of them trade ids
    other = root / "other-tokenizer"
    other.mkdir()
    src = default_model_dirs()[0]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        if (src / name).exists():
            shutil.copy(src / name, other / name)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    vocab["ent"], vocab["am"] = vocab["am"], vocab["ent"]
    (other / "tokenizer.json").write_text(json.dumps(tj))
    out["other"] = make_random_model(root / "vother", vocab_size=1024, seed=5, tokenizer_from=other)
    return out


@pytest.mark.parametrize("draft, words", [(512, "vocabulary of 512 ids and its tokenizer 1024 tokens"),
                                          ("other", "another tokenizer than the target")])
def test_cli_refuses_a_draft_that_cannot_serve(models, tmp_path, capsys, draft, words):
    out = tmp_path / "out"
    rc = main(["run", "--model", str(models[1024]), "--draft", str(models[draft]), "--spec-k", "2",
               "--max-tokens", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("divergence run: error: the ") and words in err[0], err[0]
    assert not list(out.glob("*.h5"))


def test_a_padded_draft_head_serves_and_greedy_decoding_keeps_the_targets_tokens(models):
    """The draft of 2048 rows (the tokenizer's 1024 + padding) proposes from the 1024 columns
    both heads have; greedy speculative decoding then gives the target's own tokens."""
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import load_cached

    target = load_cached(models[1024])
    padded = load_cached(models[2048])
    with pytest.raises(ModelLoadError, match="vocabulary of 512 ids"):
        Engine(target, load_cached(models[512]), spec_k=2)
    spec = Engine(target, padded, spec_k=3, stop_at_eos=False)
    assert spec.draft_width == TOKENS and spec.vocab == TOKENS
    reqs = [Request(f"r{i}", tuple(target.encode(p)), max_tokens=12)
            for i, p in enumerate(["Return the number of", "Open file and return a stream."])]
    alone = Engine(target, stop_at_eos=False).run(reqs, "serial")
    got = spec.run(reqs, "concurrent")
    for r in reqs:
        assert got.outputs[r.id].tokens == alone.outputs[r.id].tokens, r.id
        assert all(t < TOKENS for t in got.outputs[r.id].tokens)


def test_a_padded_draft_head_samples_within_the_shared_columns(models):
    """Sampled speculative decoding with the padded draft: its q (1024 columns) meets the
    target's p (1024) in the accept test and the residual, and no id past the tokenizer comes out."""
    from divergence.core.request import Sampling
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import load_cached

    target = load_cached(models[1024])
    big = load_cached(make_random_model(models[1024].parent / "t2048", vocab_size=2048, seed=9))
    # the wider head now the target's: the draft's q is narrower than p and padded with zeros
    for tgt, dft, tgt_ids in ((target, load_cached(models[2048]), 1024), (big, target, 2048)):
        spec = Engine(tgt, dft, spec_k=3, stop_at_eos=False)
        req = Request("s", tuple(tgt.encode("Return the number of")), max_tokens=16,
                      sampling=Sampling(temperature=1.0, seed=4))
        out = spec.run([req], "serial").outputs["s"]
        assert len(out.tokens) == 16 and all(0 <= t < tgt_ids for t in out.tokens), out.tokens
