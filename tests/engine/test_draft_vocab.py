"""A draft whose vocabulary differs from the target's (larger: it can propose ids the target
lacks; smaller: it never proposes some) is refused when the engine is made: one line, exit 2."""
from __future__ import annotations

import pytest

from divergence.cli.main import main
from divergence.errors import ModelLoadError
from divergence.testing.models import make_random_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {n: make_random_model(root / f"v{n}", vocab_size=n, seed=n) for n in (1024, 2048, 512)}


@pytest.mark.parametrize("draft", [2048, 512])
def test_cli_refuses_a_draft_of_another_vocabulary(models, tmp_path, capsys, draft):
    out = tmp_path / "out"
    rc = main(["run", "--model", str(models[1024]), "--draft", str(models[draft]), "--spec-k", "2",
               "--max-tokens", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("divergence run: error: the draft ") and f"vocabulary of {draft} ids" in err[0]
    assert not list(out.glob("*.h5"))


def test_engine_refuses_it_and_takes_a_matching_draft(models):
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import load_cached

    target = load_cached(models[1024])
    with pytest.raises(ModelLoadError, match="share the target's vocabulary"):
        Engine(target, load_cached(models[2048]), spec_k=2)
    with pytest.raises(ModelLoadError, match="vocabulary of 512 ids"):
        Engine(target, load_cached(models[512]), spec_k=2)
    assert Engine(target, load_cached(models[1024]), spec_k=2).vocab == 1024
