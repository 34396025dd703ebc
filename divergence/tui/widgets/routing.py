"""A position's MoE routing per layer, A and B side by side; flipped layers in red.
Gate values with 9 significant digits: a float32 near-tie hides in fewer."""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from ..data.routing import PositionRouting, RoutingSide


class RoutingPanel(Static):
    DEFAULT_CSS = """
    RoutingPanel { height: auto; border-top: solid $primary; padding: 0 1; display: none; }
    """

    def show(self, routing: PositionRouting | None, labels: list[str]) -> None:
        shown = routing is not None and bool(routing.layers)
        self.display = shown  # dense models: no panel at all (not even its border)
        self.update(self._routing_text(routing, labels) if shown else "")

    @staticmethod
    def _side(s: RoutingSide | None) -> str:
        if s is None:
            return "no routing row"
        chosen = ", ".join(f"{e} {v:.9g}" for e, v in sorted(zip(s.experts, s.scores), key=lambda p: -p[1]))
        runner = f"  runner-up {s.runner_up} {s.runner_up_score:.9g}" if s.runner_up >= 0 else ""
        return f"step {s.step}: {chosen}{runner}"

    def _routing_text(self, r: PositionRouting, labels: list[str]) -> Text:
        text = Text(f"routing of position {r.position} (the row of that token; it computed the next one)",
                    style="bold")
        for row in r.layers:
            mark = "≠" if row.flipped else " "
            for n, s in enumerate(row.sides):
                text.append("\n")
                head = f"{mark} layer {row.layer:<3}" if n == 0 else " " * 11
                text.append(head, style="bold red" if row.flipped else "bold")
                text.append(f" {labels[n]:<14} {self._side(s)}", style="red" if row.flipped else "")
            if row.flipped:
                why = "same router input: the gate's kernel" if row.same_input else "router input differed"
                text.append(f"\n{' ' * 12}flip: {why}", style="italic red")
        return text
