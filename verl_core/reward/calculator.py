"""Rule scorer for the synthetic calculator task (``data_source = "synthetic/calculator"``,
issue 25).

A response is a multi-turn transcript (``reward/decode.py``: the assistant turns and the tool's
responses between them, the template's turn markers skipped); the answer is its last line,
which the tiny model's chat template starts after each tool response
(``models/tokenizer.CHAR_CHAT_TEMPLATE``). The line, cut at an end-of-sequence marker and
stripped, must equal the answer's decimal text exactly, as for the arithmetic task. A response
that ends right after a tool response has an empty last line and scores 0: the tool's output is
not the model's answer.
"""

from __future__ import annotations

from verl_core.reward import arithmetic

__all__ = ["compute_score"]


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response's last line equals the integer ``ground_truth`` exactly, else 0.0."""
    text = solution_str or ""
    last = text.rsplit("\n", 1)[-1] if "\n" in text else text
    return arithmetic.compute_score(last, ground_truth)
