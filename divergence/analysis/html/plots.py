"""The page's figures, drawn with matplotlib and inlined as SVG.

matplotlib (not hand-written SVG): axes, ticks, legends, log scales and heat maps
are its job and it does them well; its SVG backend needs no browser script, so the
page stays static and opens offline. We use the object API (Figure, no pyplot):
no global state, no GUI backend. Text stays text (svg.fonttype none), so the
figures are small and their labels searchable in the DOM.
"""
from __future__ import annotations

import io
import re

import numpy as np

from .data import KV_ABSENT, KV_DIFFER, KV_DIFFER_CAUSE, KV_EQUAL, KvGrid, MarginSeries, StepRow

COLOR_A, COLOR_B, COLOR_DELTA = "#1f77b4", "#ff7f0e", "#6a3d9a"
FLIP, NUMERIC, CAUSE = "#d62728", "#2ca02c", "#d62728"
REQUEST_COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#ff9da7", "#9c755f",
                  "#bab0ac", "#e15759")
RC = {"svg.fonttype": "none", "svg.hashsalt": "divergence", "font.size": 9, "axes.titlesize": 10,
      "axes.spines.top": False, "axes.spines.right": False, "legend.frameon": False,
      "font.family": "sans-serif", "font.sans-serif": ["DejaVu Sans", "Arial", "sans-serif"]}


def _figure(w: float, h: float):
    from matplotlib.figure import Figure  # (lazy: loads matplotlib, only to draw)

    return Figure(figsize=(w, h), layout="constrained")


def to_svg(fig) -> str:
    """The figure as an inline <svg> element: no XML prolog, DOCTYPE, metadata or namespace
    URIs (an HTML parser needs none), so the page names no http(s) address at all."""
    import matplotlib  # (lazy: loads matplotlib, only to draw)

    buf = io.StringIO()
    with matplotlib.rc_context(RC):
        fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": None, "Format": None, "Type": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>", "", svg, flags=re.S)
    svg = re.sub(r'\s+xmlns(:\w+)?="[^"]*"', "", svg)
    svg = svg.replace("xlink:href=", "href=")
    return svg.strip()


def margin_plot(s: MarginSeries, label_a: str, label_b: str) -> str:
    """Top-1 margins of A and B, and max |Δlogit|, over positions; the first numeric difference and
    the flip as vertical lines, labelled in a strip above the curves (never on them), the legend below."""
    import matplotlib  # (lazy: loads matplotlib, only to draw)
    from matplotlib.lines import Line2D  # (lazy: loads matplotlib, only to draw)

    with matplotlib.rc_context(RC):
        fig = _figure(7.6, 4.4)
        strip, top, bot = fig.subplots(3, 1, sharex=True, height_ratios=(0.75, 3, 2))
        dots = {"marker": "o", "ms": 3} if len(s.positions_a) < 24 else {}  # a step line of one point is invisible
        top.step(s.positions_a, s.margin_a, where="mid", color=COLOR_A, lw=1.1, label=f"{label_a} (A)", **dots)
        top.step(s.positions_b, s.margin_b, where="mid", color=COLOR_B, lw=1.1, ls="--", label=f"{label_b} (B)",
                 **dots)
        top.set_ylabel("top-1 margin\n(logit)")
        fig.suptitle(f"{s.rid}: how close the top two candidates were, and how far A and B drifted apart",
                     fontsize=10)
        bot.step(s.delta_positions, s.delta, where="mid", color=COLOR_DELTA, lw=1.1, label="max |Δlogit| A vs B",
                 **dots)
        bot.set_ylabel("|Δlogit|")
        bot.set_xlabel("sequence position")
        for ax in (top, bot):
            if s.first_numeric is not None:
                ax.axvline(s.first_numeric, color=NUMERIC, lw=1.2, ls=":")
            if s.flip is not None:
                ax.axvline(s.flip, color=FLIP, lw=1.4)
        # the strip: the numeric difference's label on its upper row, the flip's on the lower one; each
        # line rises only to its own label, so neither line crosses the other's text
        strip.set_axis_off()
        strip.set_ylim(0, 1)
        xs = [x for x in (s.first_numeric, s.flip) if x is not None] + list(s.positions_a[:1]) + \
            list(s.positions_a[-1:])
        lo, hi = (min(xs), max(xs)) if xs else (0, 1)

        def label(x, y, text, color, ls, lw):
            strip.plot([x, x], [0, y + 0.38], color=color, ls=ls, lw=lw)
            right = hi > lo and (x - lo) / (hi - lo) > 0.6  # near the right edge: the text to the left
            strip.annotate(text, (x, y), xytext=(-3 if right else 3, 0), textcoords="offset points",
                           ha="right" if right else "left", va="bottom", color=color, fontsize=8)

        if s.first_numeric is not None:
            label(s.first_numeric, 0.55, f"first numeric difference (position {s.first_numeric})", NUMERIC, ":", 1.2)
        if s.flip is not None:
            label(s.flip, 0.05, f"flip (position {s.flip})", FLIP, "-", 1.4)
        handles = [Line2D([], [], color=COLOR_A, lw=1.1, label=f"{label_a} (A)"),
                   Line2D([], [], color=COLOR_B, lw=1.1, ls="--", label=f"{label_b} (B)"),
                   Line2D([], [], color=COLOR_DELTA, lw=1.1, label="max |Δlogit| A vs B")]
        fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8)
        return to_svg(fig)


def kv_plot(g: KvGrid, label_a: str, label_b: str) -> str:
    import matplotlib  # (lazy: loads matplotlib, only to draw)
    from matplotlib.colors import ListedColormap  # (lazy: loads matplotlib, only to draw)
    from matplotlib.patches import Patch  # (lazy: loads matplotlib, only to draw)

    colors = {KV_ABSENT: "#ffffff", KV_EQUAL: "#dfe6ee", KV_DIFFER: "#f4a261", KV_DIFFER_CAUSE: "#c0392b"}
    names = {KV_EQUAL: "equal", KV_DIFFER: "differs",
             KV_DIFFER_CAUSE: f"differs, written by {label_b} step {g.cause_step_b}"}
    with matplotlib.rc_context(RC):
        layers = g.cells.shape[0]
        positions = g.positions or g.cells.shape[1]
        fig = _figure(7.6, 1.5 + 0.22 * min(layers, 24))
        ax = fig.subplots()
        cmap = ListedColormap([colors[i] for i in range(4)])
        # imshow: one small embedded raster however many cells (a path per cell would not scale)
        ax.imshow(g.cells, cmap=cmap, vmin=-0.5, vmax=3.5, aspect="auto", interpolation="nearest",
                  extent=(-0.5, positions - 0.5, layers - 0.5, -0.5))
        if g.earliest is not None:
            layer, pos = g.earliest
            ax.plot([pos], [layer], marker="*", ms=13, color="#111111", mec="white", mew=0.8, ls="none")
            ax.annotate(f"earliest: layer {layer}, position {pos}", (pos, layer), xytext=(10, 0),
                        textcoords="offset points", va="center", fontsize=8,
                        bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "#999999", "lw": 0.5})
        ax.set_xlabel("position")
        ax.set_ylabel("layer")
        ax.set_yticks(range(layers) if layers <= 12 else np.linspace(0, layers - 1, 6).astype(int))
        fig.suptitle(f"{g.rid}: the KV cache the divergent step read ({label_a} step {g.read_at[0]}, "
                     f"{label_b} step {g.read_at[1]}): {g.n_differ} of {g.n_cells} cells differ", fontsize=10)
        used = sorted(set(np.unique(g.cells).tolist()) - {KV_ABSENT})
        fig.legend(handles=[Patch(color=colors[i], label=names[i]) for i in used], loc="outside lower left",
                   ncols=3, fontsize=8)
        return to_svg(fig)


def request_colors(ids) -> dict[str, str]:
    return {rid: REQUEST_COLORS[i % len(REQUEST_COLORS)] for i, rid in enumerate(ids)}


def timeline_plot(sides: list[tuple[str, list[StepRow], dict]], colors: dict[str, str],
                  focus: set[str]) -> str:
    """Rows per target step, stacked by request; the root-cause steps of each side marked.
    sides: (label, steps, root-cause steps {step: request ids}). Requests outside `focus` are drawn faded."""
    import matplotlib  # (lazy: loads matplotlib, only to draw)
    from matplotlib.patches import Patch  # (lazy: loads matplotlib, only to draw)

    with matplotlib.rc_context(RC):
        fig = _figure(7.6, 1.2 + 1.5 * len(sides))
        axes = fig.subplots(len(sides), 1, squeeze=False)[:, 0]
        seen: list[str] = []
        for ax, (label, steps, causes) in zip(axes, sides):
            x = np.arange(len(steps))
            bottom = np.zeros(len(steps))
            for i, st in enumerate(steps):
                for sl in st.slices:
                    rid = sl["request_id"]
                    if rid not in seen:
                        seen.append(rid)
                    alpha = 1.0 if not focus or rid in focus else 0.35
                    ax.bar(i, sl["count"], bottom=bottom[i], width=0.8, color=colors.get(rid, "#999999"),
                           alpha=alpha, lw=0)
                    bottom[i] += sl["count"]
            for i, st in enumerate(steps):
                if st.step in causes:
                    ax.axvspan(i - 0.5, i + 0.5, color=CAUSE, alpha=0.12, lw=0)
                    ax.annotate(f"root cause of {', '.join(causes[st.step])}: step {st.step}, {st.rows} rows",
                                (i, bottom[i]), xytext=(4, 2), textcoords="offset points", color=CAUSE, fontsize=8)
            ax.set_ylabel(f"{label}\nrows")
            ticks = x[:: max(1, len(x) // 12)]
            ax.set_xticks(ticks, [str(steps[i].step) for i in ticks])
            ax.set_xlim(-0.8, len(steps) - 0.2)
        axes[-1].set_xlabel("engine step (target forward passes)")
        axes[0].set_title("rows per step, by request" + (" (faded: not batched with the diverged request)"
                                                         if focus else ""))
        axes[0].legend(handles=[Patch(color=colors.get(r, "#999999"), label=r) for r in seen],
                       loc="upper right", ncols=min(len(seen), 6), fontsize=8)
        return to_svg(fig)
