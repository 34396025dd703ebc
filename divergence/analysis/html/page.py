"""One self-contained HTML page of a diverged pair: CSS inline, figures inline SVG,
no script, no external resource, so it opens offline from a CI artifact.

The root-cause facts come from the bisect report's JSON (`BisectReport.to_json()`),
read with .get() so keys added later render when present and missing ones don't
break the page; the prose is analysis.report's, the same lines the CLI prints.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from ...core.labels import span_text
from ..cause import BY_COMMAND, BY_ENVIRONMENT, BY_REPLAY, CONFIRMED_BY
from ..pipeline import foreign
from ..report import confirm_hint, request_lines
from . import data as D
from . import plots

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d2733;background:#f6f7f9}
main{max-width:1180px;margin:0 auto;padding:18px 24px 48px}
h1{font-size:22px;margin:6px 0 2px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d5dae1;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
.sub{color:#5b6776;margin:0 0 12px}.card{background:#fff;border:1px solid #d9dee5;border-radius:6px;padding:12px 16px;margin:10px 0}
.bad{border-left:4px solid #c0392b}.good{border-left:4px solid #2e8b57}.drift{border-left:4px solid #b7791f}
pre{font:12.5px/1.4 ui-monospace,"DejaVu Sans Mono",monospace;white-space:pre-wrap;margin:6px 0;background:#fbfbfc;
padding:8px;border-radius:4px;border:1px solid #eceff3}
table{border-collapse:collapse;font-size:13px}td,th{padding:3px 10px;border-bottom:1px solid #edf0f3;text-align:left;vertical-align:top}
th{background:#f0f2f5;font-weight:600}tr.differs td{background:#fff6e5}tr.cause td{background:#fde8e6;font-weight:600}
.pill{display:inline-block;padding:0 7px;border-radius:9px;font-size:12px;color:#fff;margin:1px 2px}
.pill.faded{opacity:.45}.pill.self{outline:2px solid #1d2733}
.status{font-weight:600}.status.diverged{color:#c0392b}.status.identical{color:#2e8b57}.status.missing{color:#b7791f}
.status.logits-differ{color:#9a5b00;background:#fff3d6;border-radius:4px;padding:0 6px}
.texts{display:grid;grid-template-columns:1fr 1fr;gap:12px}.texts h4{margin:0 0 4px;font-size:13px}
.text{font:12.5px/1.5 ui-monospace,"DejaVu Sans Mono",monospace;white-space:pre-wrap;word-break:break-word;background:#fbfbfc;
border:1px solid #eceff3;border-radius:4px;padding:8px}
.prompt{color:#8a94a3}.after{color:#9b4d2e}mark.flip{background:#c0392b;color:#fff;border-radius:2px;padding:0 1px}
.figure{overflow-x:auto;max-width:100%}.figure svg{width:100%;max-width:900px;min-width:600px;height:auto}
.scroll{overflow-x:auto;max-width:100%}td,th{overflow-wrap:break-word}#settings-table td{overflow-wrap:anywhere}
table.more td,table.more th{border:0;padding:1px 8px 1px 0}table.more table.more{margin-left:2px}.confirm.yes{color:#2e8b57;font-weight:600}.confirm.no{color:#c0392b;font-weight:600}
.kv{font-family:ui-monospace,monospace}.note{color:#5b6776;font-size:13px}
@media (max-width:700px){main{padding:10px 10px 32px}.texts{grid-template-columns:1fr}.card{padding:10px}
td,th{padding:3px 5px}table{font-size:12px}pre.root-cause{white-space:pre;overflow-x:auto}}
"""


def esc(x) -> str:
    return html.escape(str(x), quote=True)


def render(report, a, b, *, title: str | None = None) -> str:
    """The page (a str) for a BisectReport of the open traces a and b."""
    j = report.to_json()
    d = report.diff
    la, lb = d.label_a, d.label_b
    vocab = a.vocab if a.vocab is not None else b.vocab
    reqs = j.get("requests", [])
    ids = [r["id"] for r in reqs]
    colors = plots.request_colors(ids)
    diverged = [r for r in reqs if r.get("status") != "identical"]
    head = title or f"divergence report: {la} vs {lb}"
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
             f"<meta name=viewport content='width=device-width,initial-scale=1'><title>{esc(head)}</title>"
             f"<style>{CSS}</style></head><body><main>",
             f"<h1>{esc(head)}</h1>",
             f"<p class=sub>A = {esc(la)}: {esc(d.path_a)}<br>B = {esc(lb)}: {esc(d.path_b)}</p>",
             _summary(j, report, d)]
    parts.append(_causes(report, j, a, b, vocab, colors))
    parts.append("<h2 id=requests>Requests</h2>")
    for r in reqs:
        parts.append(_request(r, a, b, vocab, la, lb))
    parts.append(_timeline(j, a, b, la, lb, colors, diverged))
    parts.append(_settings(a.meta, b.meta, la, lb))
    parts.append("<p class=note>Written by divergence. Everything on this page is in this one file; "
                 "it loads nothing.</p></main></body></html>")
    return "\n".join(parts)


def write(report, a, b, path, **kw) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(render(report, a, b, **kw), encoding="utf-8")
    return p


def _summary(j: dict, report, d) -> str:
    reqs = j.get("requests", [])
    bad = [r["id"] for r in reqs if r.get("status") != "identical"]
    text = (f"identical: {len(reqs)} of {len(reqs)} requests" if not bad else
            f"diverged: {len(bad)} of {len(reqs)} requests ({', '.join(bad)})")
    notes = []
    if j.get("mode") and j["mode"] != "kv-hashes":
        notes.append(f"bisect mode: {j['mode']}")
    for p in j.get("incomplete") or []:
        notes.append(f"{p} is incomplete (the run did not finish); compared up to where it ends")
    for g in j.get("groups") or []:
        if len(g.get("requests", [])) > 1:
            notes.append(f"shared root cause: {', '.join(g['requests'])} trace back to the same "
                         f"{d.label_b} step {g.get('step_b')}")
    drift = [r["id"] for r in reqs if r.get("status") == "identical" and r.get("first_numeric_divergence")]
    if drift:
        notes.insert(0, f"{len(drift)} more with identical tokens but other logits ({', '.join(drift)}): "
                        "--bitwise counts them")
    cls = "bad" if bad else "drift" if drift else "good"
    return (f"<div class='card {cls}' id=summary><div class=status>{esc(text)}</div>"
            + "".join(f"<div class=note>{esc(n)}</div>" for n in notes) + "</div>")


def _causes(report, j: dict, a, b, vocab, colors) -> str:
    d = report.diff
    out = ["<h2 id=root-cause>Root cause</h2>"]
    by_id = {r.id: r for r in d.requests}
    any_cause = False

    other_engine = foreign(a, b)
    hint = confirm_hint(d, other_engine)
    for r in j.get("requests", []):
        if r.get("status") == "identical":
            continue
        rd = by_id.get(r["id"])
        finding = report.finding(r["id"]) if hasattr(report, "finding") else None
        lines = request_lines(rd, d.label_a, d.label_b, vocab, finding,
                              getattr(report, "confirm_requested", False),
                              getattr(report, "unexplained", {}).get(r["id"]), hint) if rd is not None else []
        rc = r.get("root_cause") or {}
        any_cause = any_cause or bool(rc)
        out.append(f"<div class='card bad' id='cause-{esc(r['id'])}'><h3>{esc(r['id'])}: {esc(_headline(rc, d.label_b))}"
                   "</h3>")
        out.append(f"<pre class=root-cause>{esc(chr(10).join(lines))}</pre>")
        if rc:
            out.append(_confirm(r, rc, d.label_a, d.label_b, hint, other_engine,
                                getattr(report, "confirm_requested", False)))
            out.append(_kernel_table(rc, d.label_a, d.label_b))
            out.append(_more(rc))
        out.append("</div>")
    if not any_cause:
        out.append("<p class=note>No root cause: " + ("the traces are identical." if j.get("identical") else
                   "no request's divergence could be traced to a step (see the report above).") + "</p>")
    return "\n".join(out)


KIND_WORDS = {"cache_contamination": "cache contamination", "step_compute": "step compute", "sampler": "sampler"}


def _span(ps) -> str:
    if not ps:
        return ""
    return ("position " if len(ps) == 1 else "positions ") + span_text(ps, most=6)


def _headline(rc: dict, lb: str) -> str:
    """'cache contamination, layer 0, positions 9-12, written by concurrent step 8 (158 rows, gemm/8)'."""
    if not rc:
        return "no root cause found"
    kind = rc.get("kind")
    bits = [KIND_WORDS.get(kind, str(kind))]
    if rc.get("layer") is not None:
        bits.append(f"layer {rc['layer']}")
    if kind == "cache_contamination" and rc.get("positions"):
        bits.append(_span(rc["positions"]))
    if kind != "sampler" and rc.get("step_b") is not None:
        verb = "written by" if kind == "cache_contamination" else "in"
        kern = f", {rc['kernel_b']}" if rc.get("kernel_b") not in (None, "?") else ""
        bits.append(f"{verb} {lb} step {rc['step_b']} ({rc.get('rows_b', '?')} rows{kern})")
    co = rc.get("co_batched_b") or []
    if co:
        bits.append(f"batched with {', '.join(co)}")
    return ", ".join(bits)


# the badge's "by ...", per Confirmation.by (analysis.cause.CONFIRMED_BY); the replays' default
BADGE_BY = {BY_COMMAND: "your command (--confirm-cmd)", BY_ENVIRONMENT: "replay under A's environment"}


def _confirm(r: dict, rc: dict, la: str, lb: str, hint: str = "", other_engine: bool = False,
             asked: bool = False) -> str:
    """The confirmation's badge: confirmed or not, by what (Confirmation.by), and for a
    lead nobody tried to confirm, the command that would (asked: a confirmation was asked for)."""
    confirmed = r.get("confirmed")
    detail = rc.get("confirm_detail") or ""
    step_b = rc.get("step_b")
    by = rc.get("confirmed_by")
    badge = BADGE_BY.get(by, "replay")
    if confirmed is True:
        head = f"<span class='confirm yes'>confirmed by {esc(badge)}</span>"
    elif confirmed is False:
        head = f"<span class='confirm no'>NOT confirmed by {esc(badge)}</span>"
    elif asked:  # asked, but nothing could be forced or re-run for it (the detail says why)
        head = "<span class=note>not confirmed, a lead only</span>"
        hint = ""
    elif other_engine:  # --confirm refuses another engine's traces: its own engine re-runs them
        head = ("<span class=note>not confirmed (run with --confirm-cmd CMD to re-run it through the engine that "
                "recorded it): a lead only</span>")
    else:
        head = "<span class=note>not confirmed (run with --confirm to replay it): a lead only</span>"
    forced = rc.get("forced")  # newer reports may name exactly what the replay forced
    if forced:
        what = "; ".join(f"step {k}: {v}" for k, v in (forced.items() if isinstance(forced, dict) else
                                                       enumerate(forced)))
    elif rc.get("kind") != "sampler" and step_b is not None:
        what = f"{lb} step {step_b} run on {la}'s kernels of step {rc.get('step_a')} (the {la} column below)"
    else:
        what = ""
    body = f"<div>{head}{': ' + esc(detail) if detail else ''}</div>"
    if by and confirmed is not None:
        body += f"<div class=note>how: {esc(CONFIRMED_BY.get(by, by))}</div>"
    if what and confirmed is not None and by in (None, BY_REPLAY):  # (another way: the detail says what ran)
        body += f"<div class=note>the replay forced: {esc(what)}</div>"
    elif confirmed is None and hint:
        body += f"<div class=note>to confirm it: {esc(hint)}</div>"
    return f"<div class=confirm-box>{body}</div>"


# root_cause keys the page shows in its own way; any other (added by later analyses) is listed as is
SHOWN_KEYS = {"kind", "layer", "positions", "op", "step_a", "step_b", "rows_a", "rows_b", "kernel_a", "kernel_b",
              "co_batched_b", "composition_a", "composition_b", "kernels_a", "kernels_b",
              "finished_before_divergence", "confirm_detail", "confirmed_by", "forced"}


def _num(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _value_html(v, depth: int = 0) -> str:
    """A bisect-report value, readably: text as text, runs of integers as spans (9-12), mappings
    as nested key/value tables, anything else as JSON (non-ASCII kept: Δ, not \\u0394)."""
    if isinstance(v, str):
        return esc(v if len(v) <= 600 else v[:600] + " …")
    if isinstance(v, bool) or v is None:
        return esc(v)
    if isinstance(v, (int, float)):
        return esc(_num(v))
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return esc(span_text(list(v), most=12))
    if isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        return esc(", ".join(v))
    if isinstance(v, dict) and depth < 3:
        return _kv_table(v, depth + 1)
    text = json.dumps(v, default=str, ensure_ascii=False, separators=(", ", ": "))
    return esc(text if len(text) <= 600 else text[:600] + " …")


def _kv_table(d: dict, depth: int = 0) -> str:
    rows = [f"<tr><th class=kv>{esc(str(k).replace('_', ' '))}</th><td>{_value_html(v, depth)}</td></tr>"
            for k, v in d.items() if v not in (None, {}, [], "")]
    return "<table class=more>" + "".join(rows) + "</table>"


def _more(rc: dict) -> str:
    rest = {k: v for k, v in rc.items() if k not in SHOWN_KEYS and v not in (None, {}, [], "")}
    if not rest:
        return ""
    return ("<details class=more><summary>more from the bisect report</summary>" + _kv_table(rest)
            + "</details>")


def _kernel_table(rc: dict, la: str, lb: str) -> str:
    ka, kb = rc.get("kernels_a") or {}, rc.get("kernels_b") or {}
    if not (ka or kb):
        return ""
    op = rc.get("op")
    rows = []
    for o in list(kb) + [x for x in ka if x not in kb]:
        cls = "cause" if o == op else ("differs" if ka.get(o) != kb.get(o) else "")
        rows.append(f"<tr class='{cls}'><td class=kv>{esc(o)}</td><td>{esc(ka.get(o, '-'))}</td>"
                    f"<td>{esc(kb.get(o, '-'))}</td></tr>")
    return (f"<table><tr><th>op</th><th>{esc(la)} step {esc(rc.get('step_a'))} ({esc(rc.get('rows_a'))} rows)</th>"
            f"<th>{esc(lb)} step {esc(rc.get('step_b'))} ({esc(rc.get('rows_b'))} rows)</th></tr>"
            + "".join(rows) + "</table>")


def _settings(ma: dict, mb: dict, la: str, lb: str) -> str:
    rows = []
    for name, va, vb in D.settings_rows(ma, mb):
        cls = "differs" if va != vb else ""
        rows.append(f"<tr class='{cls}'><th>{esc(name)}</th><td>{esc(va)}</td><td>{esc(vb)}</td></tr>")
    return (f"<h2 id=settings>Run settings</h2><div class=scroll><table id=settings-table><tr><th></th>"
            f"<th>A: {esc(la)}</th><th>B: {esc(lb)}</th></tr>"
            + "".join(rows) + "</table></div><p class=note>Highlighted rows differ between the two runs.</p>")


def _text_html(t: D.Text) -> str:
    out = []
    if t.prompt_elided:
        out.append(f"<span class=prompt>[… {t.prompt_elided} prompt tokens]</span>")
    out.append("<span class=prompt>" + esc("".join(t.prompt)) + "</span>")
    if t.elided_before:
        out.append(f"<span class=prompt>[… {t.elided_before} generated tokens]</span>")
    if t.flip is None:
        out.append(esc("".join(t.generated)))
    else:
        out.append(esc("".join(t.generated[:t.flip])))
        if t.flip < len(t.generated):
            out.append(f"<mark class=flip title='first divergent token'>{esc(t.generated[t.flip])}</mark>")
            out.append("<span class=after>" + esc("".join(t.generated[t.flip + 1:])) + "</span>")
    if t.elided_after:
        out.append(f"<span class=prompt>[… {t.elided_after} more tokens]</span>")
    return "".join(out)


def _request(r: dict, a, b, vocab, la: str, lb: str) -> str:
    rid, status = r["id"], r.get("status", "?")
    tok = r.get("first_divergent_token") or {}
    num = r.get("first_numeric_divergence") or {}
    flip = tok.get("generated_index")
    drift = status == "identical" and bool(num)  # the CLI's "tokens identical; logits differ"
    cls = "drift" if drift else "bad" if status != "identical" else "good"
    badge = (f"<span class='status logits-differ'>identical tokens, logits differ</span>" if drift else
             f"<span class='status {esc(status)}'>{esc(status)}</span>")
    out = [f"<div class='card {cls}' id='request-{esc(rid)}'><h3>{esc(rid)} {badge}</h3>"]
    if drift:
        out.append(f"<div class=note>the tokens are the same, but the logits differ from position "
                   f"{esc(num.get('position'))} on (max |Δlogit| {esc(_num(num.get('max_abs_delta_before_flip')))}); "
                   "<code>--bitwise</code> counts this as diverged and finds its cause</div>")
    if tok:
        out.append(f"<div class=note>first divergent token at position {esc(tok.get('position'))} "
                   f"(generated #{esc(flip)}), marked in both texts</div>")
    ta, tb = (D.request_text(t, rid, vocab, flip) for t in (a, b))
    out.append(f"<div class=texts><div><h4>A: {esc(la)}</h4><div class=text>{_text_html(ta)}</div></div>"
               f"<div><h4>B: {esc(lb)}</h4><div class=text>{_text_html(tb)}</div></div></div>")
    if status == "diverged" and (tok or num):
        s = D.margin_series(a, b, rid, tok.get("position"), num.get("position"))
        out.append(f"<div class='figure margin-plot'>{plots.margin_plot(s, la, lb)}</div>")
        pos = tok.get("position") if tok else num.get("position")
        sa, sb = (tok.get("step_a"), tok.get("step_b")) if tok else (num.get("step_a"), num.get("step_b"))
        rc = r.get("root_cause") or {}
        if pos is not None and sa is not None and sb is not None:
            g = D.kv_grid(a, b, rid, int(pos), int(sa), int(sb), rc.get("step_b"),
                          (a.meta.get("model") or {}).get("num_layers"))
            if g is None:
                out.append("<p class=note>No KV grid: the traces were recorded without KV hashes.</p>")
            else:
                out.append(f"<div class='figure kv-grid'>{plots.kv_plot(g, la, lb)}</div>")
    out.append("</div>")
    return "\n".join(out)


def _pills(slices, colors, focus: set[str], self_id: str | None) -> str:
    out = []
    for s in slices:
        rid = s["request_id"]
        cls = "pill" + ("" if not focus or rid in focus else " faded") + (" self" if rid == self_id else "")
        out.append(f"<span class='{cls}' style='background:{colors.get(rid, '#999')}'>"
                   f"{esc(rid)} {esc(s['phase'])}[{s['start']}:{s['start'] + s['count']}]</span>")
    return " + ".join(out)


def _timeline(j: dict, a, b, la: str, lb: str, colors, diverged: list[dict]) -> str:
    out = ["<h2 id=timeline>Step timeline</h2>"]
    first = next((r for r in diverged if r.get("root_cause")), None)
    rc = (first or {}).get("root_cause") or {}
    cause_a, cause_b = rc.get("step_a"), rc.get("step_b")
    self_id = first["id"] if first else None
    focus = ({self_id} | set(rc.get("co_batched_b") or [])) if first else set()
    # every request's root-cause step, per side: step -> the requests it caused
    marks: tuple[dict, dict] = ({}, {})
    for r in diverged:
        c = r.get("root_cause") or {}
        for m, key in zip(marks, ("step_a", "step_b")):
            if c.get(key) is not None:
                m.setdefault(c[key], []).append(r["id"])
    sides = [(la, D.window(a, cause_a, D.TIMELINE_WINDOW, kernels=False), marks[0]),
             (lb, D.window(b, cause_b, D.TIMELINE_WINDOW, kernels=False), marks[1])]
    if any(s[1] for s in sides):
        out.append(f"<div class='figure timeline-plot'>{plots.timeline_plot(sides, colors, focus)}</div>")
    if first:
        co = ", ".join(rc.get("co_batched_b") or []) or "none"
        out.append(f"<p class=note>Root cause of {esc(self_id)}: {esc(lb)} step {esc(cause_b)}, batched with "
                   f"{esc(co)}; outlined: {esc(self_id)}.</p>")
    for side, label, trace, cause, mark in (("a", la, a, cause_a, marks[0]), ("b", lb, b, cause_b, marks[1])):
        rows = D.window(trace, cause, D.TABLE_WINDOW, kernels=True)
        if not rows:
            continue
        body = []
        for st in rows:
            cls = "cause" if st.step in mark else ""
            title = esc(", ".join(f"{k} {v}" for k, v in st.kernels.items()))
            of = f" <span class=note>root cause of {esc(', '.join(mark[st.step]))}</span>" if st.step in mark else ""
            body.append(f"<tr class='{cls}'><td>{st.step}{of}</td><td>{st.rows}</td>"
                        f"<td>{_pills(st.slices, colors, focus, self_id)}</td>"
                        f"<td class=kv title='{title}'>{esc(st.kernel_text)}</td></tr>")
        out.append(f"<h3>{esc(label)}: target steps around step {esc(cause) if cause is not None else '-'}</h3>"
                   f"<div class=scroll><table class=steps id=steps-{side}><tr><th>step</th><th>rows</th>"
                   "<th>composition</th><th>kernels</th></tr>" + "".join(body) + "</table></div>")
    return "\n".join(out)
