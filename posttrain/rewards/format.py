"""`format`: the completion uses the required tags, each exactly once and well formed.

Default tags `think` then `answer` (the R1-style template). Reward 1 or 0 with the first
problem found as the reason. The gold answer is not used: a format reward says nothing about
correctness and belongs in a weighted sum with one that does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.rewards.base import Verifier
from posttrain.rewards.verdict import Verdict


class FormatVerifier(Verifier):
    """Each tag in `tags` appears exactly once as `<tag>...</tag>` with non-empty content, tags do
    not nest, and (when `ordered`) they appear in the listed order."""

    name = "format"

    def __init__(self, tags: Sequence[str] = ("think", "answer"), ordered: bool = True):
        if not tags or any(not re.fullmatch(r"[A-Za-z_][\w-]*", tag) for tag in tags):
            raise ValueError(f"tags must be non-empty names, got {list(tags)}")
        self.tags, self.ordered = tuple(tags), ordered

    def score(self, completion: str, example: Mapping) -> Verdict:
        """Check opening/closing counts, emptiness, nesting and order."""
        spans = []
        for tag in self.tags:
            opens = [m.start() for m in re.finditer(f"<{tag}>", completion)]
            closes = [m.start() for m in re.finditer(f"</{tag}>", completion)]
            if len(opens) != 1 or len(closes) != 1:
                return Verdict.ok(0.0, f"<{tag}> must appear exactly once (found {len(opens)} "
                                       f"opening, {len(closes)} closing)")
            start, end = opens[0], closes[0]
            if end < start:
                return Verdict.ok(0.0, f"</{tag}> comes before <{tag}>")
            if not completion[start + len(tag) + 2:end].strip():
                return Verdict.ok(0.0, f"<{tag}> is empty")
            spans.append((start, end + len(tag) + 3, tag))
        for (start_a, end_a, tag_a), (start_b, end_b, tag_b) in zip(spans, spans[1:]):
            if self.ordered and start_b < end_a:
                return Verdict.ok(0.0, f"<{tag_b}> must come after </{tag_a}>")
        ordered_spans = sorted(spans)
        for (_, end_a, tag_a), (start_b, _, tag_b) in zip(ordered_spans, ordered_spans[1:]):
            if start_b < end_a:
                return Verdict.ok(0.0, f"<{tag_b}> overlaps <{tag_a}>")
        return Verdict.ok(1.0, "well formed")

    def describe(self) -> dict[str, Any]:
        """Settings for the run card."""
        return {"verifier": self.name, "tags": list(self.tags), "ordered": self.ordered}
