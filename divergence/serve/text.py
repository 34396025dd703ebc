"""Tokens -> the text and log-probabilities a response carries; chat messages -> a prompt."""
from __future__ import annotations

import math

import numpy as np


def plain_chat(messages: list[dict]) -> str:
    """Where a tokenizer has no chat template (the embedded fixture's): each message on its
    own line as 'role: content', then the assistant's turn."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_prompt(loaded, messages: list[dict]) -> list[int]:
    """Token ids of a chat: the tokenizer's own template, else plain_chat."""
    tok = getattr(loaded.tokenizer, "_tokenizer", loaded.tokenizer)
    template = getattr(tok, "chat_template", None)
    if template:
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        return [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) else ids)]
    return list(loaded.encode(plain_chat(messages)))


class Detokenizer:
    """Text of the tokens so far, released as it becomes final: a trailing partial UTF-8
    character, or what could still be the start of a stop string, waits for the next token."""

    def __init__(self, decode, stops=()):
        self.decode = decode
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0  # characters released
        self.stopped = False
        self.text = ""

    def add(self, token: int) -> str:
        """The token's new text (maybe ''); after a stop string, nothing more."""
        if self.stopped:
            return ""
        self.tokens.append(int(token))
        text = self.text = self.decode(self.tokens)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped, self.text = True, text[:cut]
            out = text[self.sent:cut]
            self.sent = cut
            return out
        safe = len(text) - self.hold
        if text.endswith("\ufffd"):
            safe = min(safe, len(text.rstrip("\ufffd")))
        out = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return out

    def _stop_at(self, text: str) -> int | None:
        start = max(0, self.sent - self.hold)
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def rest(self) -> str:
        """What is still held back, at the end."""
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out


def token_logprobs(event, temperature: float) -> tuple[float, list[tuple[int, float]]]:
    """(the chosen token's log-probability, [(id, logprob)] of the recorded top-k) under the
    distribution it was drawn from: the model's softmax for greedy requests, the tempered one
    otherwise (from the recorded probability, so top_p's cut is not applied to alternatives)."""
    prob, logit = float(event.prob), float(event.logit)
    ids, vals = np.asarray(event.topk_ids), np.asarray(event.topk_logits, np.float64)
    lp = math.log(prob) if prob > 0 else -math.inf
    scale = 1.0 / temperature if temperature > 0 else 1.0
    out = []
    for i, v in zip(ids.tolist(), vals.tolist()):
        if i < 0 or not math.isfinite(v):
            continue
        out.append((int(i), lp + (v - logit) * scale if math.isfinite(logit) and math.isfinite(lp) else -math.inf))
    return lp, out
