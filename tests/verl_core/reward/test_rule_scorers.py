"""Rule scorers (arithmetic, gsm8k) on hand cases, and data_source dispatch."""

import pytest

from verl_core.reward import arithmetic, gsm8k
from verl_core.reward.registry import (
    DATA_SOURCE_SCORERS,
    UnknownDataSourceError,
    default_compute_score,
    register_rule_scorer,
)


@pytest.mark.parametrize("response,expected", [
    ("19", 1.0),
    ("19 ", 1.0),          # surrounding whitespace is stripped
    (" 19", 1.0),
    ("19\n20", 1.0),       # only the first line counts
    ("19</s>", 1.0),       # decoded with special tokens
    ("19<|endoftext|>junk", 1.0),
    ("190", 0.0),
    ("1", 0.0),
    ("019", 0.0),
    ("+19", 0.0),
    ("19.0", 0.0),
    ("19 or 20", 0.0),
    ("\n19", 0.0),         # the answer must come first
    ("", 0.0),
    (None, 0.0),
])
def test_arithmetic(response, expected):
    assert arithmetic.compute_score(response, "19") == expected


def test_arithmetic_ground_truth_forms():
    assert arithmetic.compute_score("0", "0") == 1.0
    assert arithmetic.compute_score("-3", "-3") == 1.0
    assert arithmetic.compute_score("7", " 7 ") == 1.0
    with pytest.raises(ValueError, match="not an integer"):
        arithmetic.compute_score("7", "seven")


@pytest.mark.parametrize("response,method,expected", [
    ("so 3+4 = 7.\n#### 7", "strict", "7"),
    ("#### 1,234", "strict", "1234"),             # commas removed
    ("#### -5", "strict", "-5"),
    ("#### 3 then #### 8", "strict", "8"),         # the last '####' wins
    ("the answer is 7", "strict", None),           # strict needs '#### '
    ("####7", "strict", None),                     # ... with the space
    ("the answer is 7", "flexible", "7"),
    ("3 apples and 4 pears: 7 fruits .", "flexible", "7"),  # a lone '.' is skipped
    ("it is 7.", "flexible", "7."),                # ... but a trailing one is kept (as verl)
    ("no numbers here", "flexible", None),
    ("1,000 total", "flexible", "1,000"),          # flexible keeps commas (as verl does)
])
def test_gsm8k_extract(response, method, expected):
    assert gsm8k.extract_solution(response, method) == expected


def test_gsm8k_only_the_last_300_chars_are_searched():
    head = "#### 42\n" + "x" * 300
    assert gsm8k.extract_solution(head, "strict") is None
    assert gsm8k.extract_solution("x" * 1000 + "#### 42", "strict") == "42"


def test_gsm8k_scores():
    # correct -> score; extracted but wrong -> format_score; no answer -> 0 regardless
    assert gsm8k.compute_score("... #### 72", "72") == 1.0
    assert gsm8k.compute_score("... #### 71", "72") == 0.0
    assert gsm8k.compute_score("... #### 71", "72", format_score=0.1) == 0.1
    assert gsm8k.compute_score("72", "72", format_score=0.1) == 0.0
    assert gsm8k.compute_score("72", "72", method="flexible") == 1.0
    assert gsm8k.compute_score("... #### 72", "72", score=2.0) == 2.0
    assert gsm8k.compute_score("", "72") == 0.0
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 1", "1", method="loose")


def test_default_compute_score_dispatch():
    assert default_compute_score("synthetic/arithmetic", "19", "19") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 19", "19") == 1.0
    assert default_compute_score("gsm8k", "19", "19") == 0.0  # strict: no '####'
    with pytest.raises(UnknownDataSourceError) as e:
        default_compute_score("my/task", "1", "1", None)
    msg = str(e.value)
    assert "'my/task'" in msg and "synthetic/arithmetic" in msg and "openai/gsm8k" in msg
    assert "reward.scorer" in msg and "file.py:function" in msg


def test_registering_twice_raises():
    with pytest.raises(ValueError, match="already registered"):
        register_rule_scorer("gsm8k", gsm8k.compute_score)
    with pytest.raises(ValueError, match="already routed"):
        register_rule_scorer("other", gsm8k.compute_score, ("openai/gsm8k",))
    assert "other" not in DATA_SOURCE_SCORERS.values()
