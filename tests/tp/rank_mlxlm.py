"""One rank of the mlx-lm reference check (run by tests/tp through the launcher):
our engine at TP=N vs mlx-lm's own Model.shard under the same group, generate_step."""
import json
import sys

from divergence.parallel import group as tpmod


def main(out: str, model_dir: str, dtype: str, max_tokens: int) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load

    from divergence import Request
    from divergence.engine.engine import Engine
    from divergence.engine.model.loading import DTYPES, load_model

    tp = tpmod.init_from_env()
    prompts = ["def add(a, b):", "Return the number of", "class Parser:\n    \"\"\"", "import os"]
    loaded = load_model(model_dir, dtype=dtype)
    engine = Engine(loaded, tp=tp, stop_at_eos=False)
    reqs = [Request(f"r{i}", tuple(loaded.encode(p)), max_tokens=max_tokens) for i, p in enumerate(prompts)]
    ours = {s: {k: v.tokens for k, v in engine.run(reqs, s).outputs.items()} for s in ("serial", "concurrent")}
    model, _ = load(model_dir)
    model.set_dtype(DTYPES[dtype])
    model.shard(tp.group)
    ref = {}
    for r in reqs:
        toks = []
        for tok, _ in generate_step(mx.array(r.prompt_tokens), model, max_tokens=max_tokens):
            toks.append(int(tok))
        ref[r.id] = toks
    if tp.rank == 0:
        with open(out, "w") as f:
            json.dump({"ours": ours, "mlx_lm": ref, "size": tp.size, "backend": tp.backend}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
