"""The tokens a multi-turn rollout appends between two assistant turns (issue 25: token-in /
token-out). The sampled ids of a turn are kept as sampled; what follows them (the tool responses,
the next assistant header) is rendered by the model's own chat template and appended as ids, so
the context the policy reads is, token for token, the one its template would give the whole
conversation, and nothing is decoded and encoded again.

How: the template renders a fixed two-message conversation (a user message, an assistant
message), then the same conversation followed by the new messages, with the generation prompt.
The new ids are what the second text adds after the assistant message's end-of-turn token (the
stop token the turn was sampled up to: ``<|im_end|>`` for Qwen, ``<|eot_id|>`` for Llama 3),
which keeps what templates write after that token (Qwen's newline) on the appended side. verl's
``ToolAgentLoop`` renders the new messages alone and strips the template's system prompt instead;
that drops Qwen's newline after ``<|im_end|>``. A template whose rendering of the longer
conversation does not start with the shorter one's (it rewrites earlier turns) is refused.
"""

from __future__ import annotations

import re

_USER = "verl-core-anchor-user"
_ASSISTANT = "verl-core-anchor-assistant"


class TemplateError(ValueError):
    """A chat template that cannot append turns token-in/token-out."""


def observation_ids(tokenizer, messages: list[dict], *, end_of_turn: str,
                    tools: list[dict] | None = None) -> list[int]:
    """Token ids of ``messages`` (``tool`` or ``user`` messages) and the next assistant header,
    to follow an assistant turn that was sampled up to the token ``end_of_turn``."""
    base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]

    def render(msgs, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False,
                                             add_generation_prompt=generation_prompt)

    short = render(base, False)
    end = short.rfind(_ASSISTANT + end_of_turn)
    if end < 0:
        raise TemplateError(f"the chat template does not end an assistant message with "
                            f"{end_of_turn!r} (the token the turn stopped at); multi-turn "
                            "rollouts need the model's end-of-turn token among its stop tokens")
    cut = end + len(_ASSISTANT) + len(end_of_turn)
    long = render(base + list(messages), True)
    if long[:cut] != short[:cut]:
        raise TemplateError("the chat template renders earlier turns differently once more "
                            "messages follow; the turns cannot be appended as tokens")
    return tokenizer(long[cut:], add_special_tokens=False)["input_ids"]


CHARS_PER_TOKEN = 32
"""Most characters one token is taken to cover when a tool's answer is bounded by characters
before it is tokenised: ``max_tokens * CHARS_PER_TOKEN`` characters (8,192 for verl's default
256) are kept at most. English BPE averages about 4; 32 leaves room for tokens of long runs
(spaces, ``====``). An answer of 50 MB is never tokenised whole (18 GB of ids and offsets)."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def response_char_bound(max_tokens: int) -> int:
    """The characters of a tool's answer that can matter for ``max_tokens`` tokens
    (:data:`CHARS_PER_TOKEN` each); the tool host cuts what it sends to this bound."""
    return max(1, int(max_tokens)) * CHARS_PER_TOKEN


def valid_text(text: str) -> str:
    """``text`` with each lone surrogate (``"\\udcff"``, what ``errors="surrogateescape"``
    leaves of undecodable bytes) replaced by U+FFFD: the tokenizer and the stored batch take
    UTF-8 text only."""
    return _SURROGATE.sub("\ufffd", text)


def truncate_observation(text: str, tokenizer, max_tokens: int, side: str = "left") -> str:
    """``text`` cut to at most ``max_tokens`` tokens of the tokenizer, marked where it was cut as
    verl marks it (``tool_response_truncate_side``: ``left`` keeps the start, ``right`` the end,
    ``middle`` both ends). verl counts ``max_tool_response_length`` in characters; here it is
    tokens, what the response budget is spent in. The text is first cut to
    :func:`response_char_bound` characters on the same side(s), so what is tokenised is bounded
    whatever the tool answered, and lone surrogates are replaced (:func:`valid_text`)."""
    if side not in ("left", "right", "middle"):
        raise ValueError(f"tool_response_truncate_side={side!r}: left, right or middle")
    C = response_char_bound(max_tokens)
    if len(text) <= C:
        head, tail = valid_text(text), None
    elif side == "left":
        head, tail = valid_text(text[:C]), ""
    elif side == "right":
        head, tail = "", valid_text(text[len(text) - C:])
    else:
        head, tail = valid_text(text[:C // 2]), valid_text(text[len(text) - (C - C // 2):])

    def ids_of(part):
        return tokenizer(part, add_special_tokens=False)["input_ids"] if part else []

    def dec(part):
        return tokenizer.decode(part, skip_special_tokens=False)

    if tail is None:  # short enough to tokenise whole
        ids = ids_of(head)
        if len(ids) <= max_tokens:
            return head
        head_ids, tail_ids = ids, ids
    else:  # cut by characters: the kept side(s) tokenised on their own
        head_ids, tail_ids = ids_of(head), ids_of(tail)
    if side == "left":
        return dec(head_ids[:max_tokens]) + "...(truncated)"
    if side == "right":
        return "(truncated)..." + dec(tail_ids[max(0, len(tail_ids) - max_tokens):])
    k = max_tokens // 2
    return (dec(head_ids[:k]) + "...(truncated)..."
            + dec(tail_ids[max(0, len(tail_ids) - (max_tokens - k)):]))
