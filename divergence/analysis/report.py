"""Human text for diff and bisect reports: one renderer for the CLI, the pytest plugin and the TUI."""
from __future__ import annotations

from ..core.labels import composition_text, span_text
from .cause import (CACHE_CONTAMINATION, CONFIRMED_BY, ENVIRONMENT, SAMPLER, STEP_COMPUTE, BisectReport, Finding,
                    RootCause)
from .diff import DIVERGED, MISSING, DiffReport, RequestDiff
from .step_view import StepView

KIND_TEXT = {CACHE_CONTAMINATION: "cache contamination", STEP_COMPUTE: "step compute", SAMPLER: "sampler",
             ENVIRONMENT: "environment"}


def _piece(vocab, token) -> str:
    if token is None:
        return ""
    if vocab is not None and 0 <= token < len(vocab):
        return repr(vocab[token])
    return ""


def _fmt(x) -> str:
    return "      n/a" if x is None else f"{x:.6f}"


def step_text(view: StepView) -> str:
    return f"{_rows(view.rows)} = " + composition_text(view.composition)


def _logits_differ(r: RequestDiff) -> str:
    n = r.first_numeric_divergence
    return f"logits differ from position {n.position} (max |Δlogit| {n.max_abs_delta_before_flip:.3g})"


def confirm_hint(d: DiffReport, foreign: bool | None = None) -> str:
    """The command that would confirm a lead of this pair: this engine's traces replay
    (--confirm); another engine's re-run through that engine (--confirm-cmd). foreign None:
    not known here, so both, each with the traces it works on."""
    cmd = f"divergence bisect {d.path_a} {d.path_b}"
    if foreign:
        return f"{cmd} --confirm-cmd CMD (re-runs B through the engine that recorded it, the step changed)"
    if foreign is False:
        return f"{cmd} --confirm"
    return f"{cmd} --confirm (traces of this engine) or --confirm-cmd CMD (another engine's)"


def request_lines(r: RequestDiff, label_a: str, label_b: str, vocab=None, finding: Finding | None = None,
                  confirm_requested: bool = False, not_found: str | None = None, hint: str | None = None) -> list[str]:
    """One request's lines of the report; finding: its cause, with what proving it found
    (BisectReport.finding)."""
    if r.status == MISSING:
        return [f"{r.id}  missing: {label_a} has {r.len_a} tokens, {label_b} has {r.len_b}"]
    tokens = f"{r.compared} token{'s' if r.compared != 1 else ''}"
    incomplete = "  [compared up to the end of an incomplete trace]" if r.truncated else ""
    if r.status != DIVERGED:
        if r.logits_only:  # not a divergence without --bitwise, but never a bare "identical"
            return [f"{r.id}  tokens identical ({tokens}); {_logits_differ(r)}{incomplete}"]
        return [f"{r.id}  identical ({tokens}){incomplete}"]
    w = max(len(label_a), len(label_b)) + 2
    lines = []
    t = r.first_divergent_token
    if r.logits_only:
        lines.append(f"{r.id}  tokens identical ({tokens}), but {_logits_differ(r)}")
    elif t is None:
        lines.append(f"{r.id}  same tokens up to #{r.compared}, then {label_a} has {r.len_a} and {label_b} {r.len_b}")
    else:
        lines.append(f"{r.id}  first divergent token at position {t.position} (generated #{t.generated_index})")
        for lab, c in ((label_a, t.a), (label_b, t.b)):
            margin = f"   margin {c.margin:.6f}" if c.margin is not None else ""
            lines.append(f"    {lab:<{w}}{c.token:>6} {_piece(vocab, c.token):<12} {_fmt(c.logit)}   runner-up "
                         f"{c.runner_up if c.runner_up is not None else '-':>6} {_piece(vocab, c.runner_up):<12} "
                         f"{_fmt(c.runner_up_logit)}{margin}")
    n = r.first_numeric_divergence
    if n is not None and not r.logits_only:
        if n.tokens_before_flip is not None and n.tokens_before_flip < 0:
            lines.append(f"    logits bitwise equal up to the flip; they first differ at position {n.position}, "
                         f"after it (max |Δlogit| there {n.max_abs_delta_before_flip:.3g})")
        else:
            ahead = f" ({n.tokens_before_flip} tokens earlier)" if n.tokens_before_flip else ""
            lines.append(f"    first numeric difference at position {n.position}{ahead}, "
                         f"max |Δlogit| before the flip {n.max_abs_delta_before_flip:.3g}")
    if finding is not None:
        lines += cause_lines(r, finding, label_a, label_b, confirm_requested, hint)
    elif not_found:
        lines.append(f"    root cause: {not_found}")
    if r.truncated:
        lines.append("    (compared up to the end of an incomplete trace)")
    return lines


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _op(c: RootCause) -> str:
    return f" ({c.op})" if c.op else ""


def _kernel(view: StepView, op: str = "") -> str:
    """', kernel gemm/8 (k_proj)', or nothing where the trace records no kernels (another engine's)."""
    return "" if view.kernel == "?" else f", kernel {view.kernel}{op}"


def native_lines(c: RootCause) -> list[str]:
    """What the probed native kernel classes say about the cause step (native runs only)."""
    if c.kind == SAMPLER or not (c.a.native and c.b.native):
        return []
    changes = c.native_class_changes
    if not changes:
        return ["      native kernel classes: no linear op changed class between these steps; the row-count",
                "      dependence is in another op (attention, norms, elementwise)"]
    by_rows: dict[tuple, list[str]] = {}
    for op, rows in changes.items():
        by_rows.setdefault(rows, []).append(op)
    parts = [f"{', '.join(ops)} ({ra} -> {rb} rows)" for (ra, rb), ops in by_rows.items()]
    return [f"      native kernel class changed: {'; '.join(parts)}"]


def tp_lines(c: RootCause) -> list[str]:
    """A TP=1 vs TP=N cause: the sharded ops, their shard shapes and the step's all-reduces."""
    t = c.tensor_parallel
    if not t:
        return []
    da, db = t["degrees"]
    ar = t.get("allreduce") or {}
    side = "B" if db > 1 else "A"
    red = (f"{ar['count']} all-reduces in {side}'s step ({ar['backend']}, {ar['ranks']} ranks, "
           f"{ar['bytes']} bytes per rank)") if ar else "all-reduces"
    shapes = [f"{op} {sb[0]}x{sb[1]} vs {sa[0]}x{sa[1]}" for op, sb in t["shapes_b"].items()
              if (sa := t["shapes_a"].get(op)) and sa != sb]
    lines = [f"      tensor parallel: TP={da} vs TP={db}: {', '.join(t['sharded_to_all'])} sum partial products "
             f"over their split inputs, added by {red}"]
    if shapes:
        lines.append(f"      sharded shapes (B vs A, NxK): {'; '.join(shapes[:7])}")
    return lines


def cause_lines(r: RequestDiff, f: Finding, label_a: str, label_b: str, confirm_requested: bool,
                hint: str | None = None) -> list[str]:
    c = f.cause
    kind = KIND_TEXT.get(c.kind, c.kind)
    out = []
    if c.kind == CACHE_CONTAMINATION:
        word = "position" if len(c.positions) == 1 else "positions"
        layer = f"layer {c.layer}, " if c.layer is not None else ""
        out.append(f"    root cause: {kind}, {layer}{word} {span_text(c.positions)}:")
        out.append(f"      written in {label_b} step {c.b.step}: {step_text(c.b)}{_kernel(c.b, _op(c))}")
        out.append(f"      the same {word} in {label_a} step {c.a.step}: {_rows(c.a.rows)}{_kernel(c.a)}")
    elif c.kind == ENVIRONMENT:
        what = ", ".join(f"{k} {va} vs {vb}" for k, (va, vb) in c.env_diff.items())
        where = (f"layer {c.layer}, {'position' if len(c.positions) == 1 else 'positions'} "
                 f"{span_text(c.positions)}" if c.layer is not None else "the step's logits")
        out.append(f"    root cause: {kind}: the same step, with the same rows, computed other bits ({what})")
        out.append(f"      first differing write: {where}, step {c.b.step} in both: {step_text(c.b)}")
    elif c.kind == STEP_COMPUTE:
        if c.layer is not None:  # a write of this very step differs: it diverged inside the step
            out.append(f"    root cause: {kind}: the cache written before this step was identical; inside the step "
                       f"the rows differ from layer {c.layer} on")
        else:
            out.append(f"    root cause: {kind}: the cache it read was identical;")
        out.append(f"      {label_b} step {c.b.step}: {step_text(c.b)}{_kernel(c.b, _op(c))}")
        out.append(f"      {label_a} step {c.a.step}: {_rows(c.a.rows)}{_kernel(c.a)}")
    elif c.model == "draft":  # the draft's q moved the sampler: its step is the lead
        out.append(f"    root cause: {kind}: the target's logits are bitwise equal up to the flip; the draft's q differs:")
        out.append(f"      {c.sampler.text}")
        where = (f"layer {c.layer}, {'position' if len(c.positions) == 1 else 'positions'} {span_text(c.positions)} "
                 f"of the draft's cache, written" if c.layer is not None else "computed")
        out.append(f"      {where} in {label_b} draft step {c.b.step}: {step_text(c.b)}{_kernel(c.b, _op(c))}")
        out.append(f"      {label_a} draft step {c.a.step}: {_rows(c.a.rows)}{_kernel(c.a)}")
    else:
        out.append(f"    root cause: {kind}: the logits are bitwise equal but the sampled token differs")
        if c.sampler is not None:
            out.append(f"      {c.sampler.text}")
    if c.sampler is not None and c.kind != SAMPLER:
        out.append(f"      sampler: {c.sampler.text}")
    first_op = f.first_op
    if first_op is not None and first_op.difference is not None:
        out.append(f"      first op that differed: {first_op.difference.text()}")
    elif first_op is not None and first_op.detail:
        out.append(f"      first op: {first_op.detail}")
    else:
        out += native_lines(c)  # the probed classes are the lead only until the ops were compared
    if c.routing_flip is not None:
        out += c.routing_flip.lines(label_a, label_b)
    out += tp_lines(c)
    for rid, step in sorted(c.finished_before_divergence.items()):
        out.append(f"      {rid} finished at step {step}, before the divergence")
    proof = f.confirmation
    how = CONFIRMED_BY.get(proof.by, proof.by) if proof is not None and proof.by else None
    if confirm_requested and f.confirmed is not None:
        if proof.confirmed:
            out.append(f"    confirmed: {proof.detail}")
        else:
            out.append(f"    NOT confirmed: {proof.detail}")
        if how:
            out.append(f"      {'confirmed by' if proof.confirmed else 'tried'}: {how}")
    elif confirm_requested:
        out.append(f"    not confirmed ({(proof.detail if proof is not None else '') or 'no replay'}): a lead only")
    else:  # (no "confirmed" here: a report that asked for no confirmation does not speak of one)
        out.append("    a lead only, not proved by a re-run" + (f"; to prove it: {hint}" if hint else ""))
    return out


def _tp_note(d: DiffReport) -> list[str]:
    da, db = d.tp_degrees
    if da == db:
        return []
    return [f"note: tensor-parallel degrees differ: A TP={da}, B TP={db} (sharded ops see "
            f"1/{max(da, db)} of their features; o_proj / down_proj partial sums are added by an all-reduce)"]


def _environment_note(d: DiffReport) -> list[str]:
    if not d.environment:
        return []
    what = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in d.environment.items())
    return [f"note: the runs' environments differ ({what}): that alone changes numbers, whatever the schedules"]


def _subset_note(d: DiffReport) -> list[str]:
    if d.selected:
        some = ", ".join(d.selected[:5]) + (f" and {len(d.selected) - 5} more" if len(d.selected) > 5 else "")
        if len(d.selected) == 1:
            return [f"note: only the request chosen is compared ({some})"]
        return [f"note: only the {len(d.selected)} requests chosen are compared ({some})"]
    if not d.subset:
        return []
    return [f"note: a partial rerun: only the {len(d.subset)} requests it re-ran are compared"]


def render_diff(d: DiffReport, vocab=None) -> str:
    lines = ([f"{d.label_a}: {d.path_a}", f"{d.label_b}: {d.path_b}"] + _tp_note(d) + _environment_note(d)
             + _subset_note(d))
    for p in d.incomplete:
        lines.append(f"note: {p} is incomplete (the run did not finish); compared up to where it ends")
    for r in d.requests:
        lines += request_lines(r, d.label_a, d.label_b, vocab)
    lines.append(_summary(d))
    return "\n".join(lines)


def render_bisect(b: BisectReport, vocab=None, *, foreign: bool | None = None) -> str:
    """foreign: the traces are another engine's (the hint to confirm a lead is then
    --confirm-cmd); None where the caller does not say (the hint names both)."""
    d = b.diff
    hint = confirm_hint(d, foreign)
    lines = ([f"{d.label_a}: {d.path_a}", f"{d.label_b}: {d.path_b}"] + _tp_note(d) + _environment_note(d)
             + _subset_note(d))
    if b.mode != "kv-hashes":
        lines.append(f"note: bisect mode: {b.mode}")
    for p in d.incomplete:
        lines.append(f"note: {p} is incomplete (the run did not finish); compared up to where it ends")
    for r in d.requests:
        lines += request_lines(r, d.label_a, d.label_b, vocab, b.finding(r.id), b.confirm_requested,
                               b.unexplained.get(r.id), hint)
    groups = [(k, v) for k, v in b.groups().items() if len(v) > 1]
    for (kind, step), ids in groups:
        lines.append(f"shared root cause: {', '.join(sorted(ids))} trace back to the same {d.label_b} step {step}")
    lines.append(_summary(d))
    return "\n".join(lines)


def _summary(d: DiffReport) -> str:
    n = len(d.requests)
    bad = d.diverged
    drift = [r for r in d.requests if r.status != DIVERGED and r.logits_only]
    note = ""
    if drift:
        ids = ", ".join(r.id for r in drift[:8]) + (" ..." if len(drift) > 8 else "")
        them = "it" if len(drift) == 1 else "them"
        note = (f"; logits differ in {len(drift)} ({ids}): --bitwise counts {them} as diverged" if not bad else
                f"; {len(drift)} more with identical tokens but other logits ({ids}): --bitwise counts {them}")
    if not bad:
        return f"{'identical tokens' if drift else 'identical'}: {n} of {n} requests{note}"
    mode = " (bitwise: logits included)" if d.bitwise else ""
    return f"diverged{mode}: {len(bad)} of {n} requests ({', '.join(r.id for r in bad)}){note}"
