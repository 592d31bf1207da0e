"""Rule scorer for the synthetic arithmetic task (``data_source = "synthetic/arithmetic"``).

The policy is prompted with ``12+7=`` and must answer with the integer right away: the response
is cut at its first newline or end-of-sequence marker, stripped of surrounding whitespace, and
must then equal the answer's decimal text exactly. Strict on purpose: "19" and "19 \\n..." score
1, "190", "019", "+19", "19.0", "\\n19" and "" score 0. No partial credit for format.
"""

from __future__ import annotations

__all__ = ["compute_score", "EOS_MARKERS"]

EOS_MARKERS = ("</s>", "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<eos>")
"""End-of-sequence texts a response may still contain when decoded with special tokens."""


def _answer_text(solution_str: str) -> str:
    cut = solution_str.split("\n", 1)[0]
    for marker in EOS_MARKERS:
        cut = cut.split(marker, 1)[0]
    return cut.strip()


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response's first line equals the integer ``ground_truth`` exactly, else 0.0.

    ``ground_truth`` must be an integer's text ("19", "-3"); anything else is a data error and
    raises ``ValueError`` rather than silently scoring every response 0.
    """
    try:
        answer = int(str(ground_truth).strip())
    except ValueError:
        raise ValueError(f"arithmetic scorer: ground_truth={ground_truth!r} is not an integer; "
                         "this scorer is for data_source 'synthetic/arithmetic' rows") from None
    return 1.0 if _answer_text(solution_str or "") == str(answer) else 0.0
