"""`divergence redact A.h5 B.h5 --out DIR`: a copy of a pair without its text, to attach to a bug report."""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import DivergenceInputError
from .paths import check_output_dir, remember_outputs, same_file

HELP = ("copy a pair of traces without its text: token ids through one random permutation of the vocabulary "
        "(kept by nobody), the vocabulary removed, content hashes keyed; diff and bisect give the same cause, "
        "step and op (docs/privacy.md says what the copy still reveals)")


def add_arguments(p) -> None:
    p.add_argument("a", metavar="A.h5")
    p.add_argument("b", metavar="B.h5")
    p.add_argument("--out", metavar="DIR", required=True, help="a directory: the two copies go there under the "
                   "inputs' names (a- and b- before them where the names are equal); an existing file there is "
                   "replaced only if it is redact's own earlier output, unchanged since")


def output_names(a, b) -> tuple[str, str]:
    na, nb = Path(a).name, Path(b).name
    return (na, nb) if na != nb else (f"a-{na}", f"b-{nb}")


def main(args) -> int:
    from ..trace.reader import Trace  # (lazy: loads numpy and h5py; the parser imports every command)
    from ..trace.redact import redact_pair  # (lazy: loads numpy and h5py; the parser imports every command)

    for p in (args.a, args.b):
        Trace.open(p).close()  # not a trace: one line, before anything is written
    if same_file(args.a, args.b):
        raise DivergenceInputError(f"A and B are one file ({args.a}): redact a pair, so that both share one "
                                   f"permutation")
    names = output_names(args.a, args.b)
    check_output_dir(args.out, files=names, inputs=[args.a, args.b], command="redact")
    out_a, out_b = redact_pair(args.a, args.b, args.out, names=names)
    remember_outputs([out_a, out_b], command="redact")
    with Trace.open(out_a) as ra, Trace.open(out_b) as rb:
        hashed = ra.has_kv_hashes and rb.has_kv_hashes
    print(f"redacted -> {out_a}, {out_b}")
    print("token ids permuted (one permutation for both, kept by nobody), vocabulary removed, KV and routing "
          "hashes keyed; still there: logits, lengths, timings, settings, the model's description (docs/privacy.md)")
    if not hashed:
        print(f"note: {'A' if not ra.has_kv_hashes else 'B'} has no KV hashes, so bisect would find the cause by "
              f"replaying, which a redacted pair cannot do (replay needs the real tokens): diff still works",
              file=sys.stderr)
    print(f"next: divergence bisect {out_a} {out_b}")
    return 0
