"""What the browser shows, computed from one or two traces. Never imports textual.

Everything is numpy over the reader's lazy tables: a screen asks for one
request's tokens, one page of steps, one request's KV grid, and nothing is
read before it is needed. `BrowseData.analyse()` (diff + bisect) is the slow
part; the app runs it in a worker thread.

- session:  BrowseData, the traces and their analysis; A, B, the sides
- overview: the request list, the run metadata and totals
- tokens:   one request's tokens of A and B aligned by position; top-k
- steps:    one trace's step timeline and its kernels
- kv:       one request's live KV writes, A against B
- routing:  one position's MoE routing per layer, A against B
- text:     how tokens, logits and spans are written
"""
from .kv import KvGrid
from .overview import RequestRow
from .session import A, B, BrowseData
from .steps import DIVERGENT_TOKEN_MARK, OP_CLASSES, ROOT_CAUSE_MARK, KernelRow, StepDetail, StepIndex, StepMark, StepRow
from .text import fmt_delta, fmt_logit, show_piece, span_text
from .tokens import TokenAlignment, TopK, TopKSide

__all__ = [
    "A", "B", "BrowseData",
    "RequestRow",
    "TokenAlignment", "TopK", "TopKSide",
    "OP_CLASSES", "ROOT_CAUSE_MARK", "DIVERGENT_TOKEN_MARK", "StepRow", "KernelRow", "StepMark", "StepDetail",
    "StepIndex",
    "KvGrid",
    "show_piece", "fmt_logit", "fmt_delta", "span_text",
]
