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


def truncate_observation(text: str, tokenizer, max_tokens: int, side: str = "left") -> str:
    """``text`` cut to at most ``max_tokens`` tokens of the tokenizer, marked where it was cut as
    verl marks it (``tool_response_truncate_side``: ``left`` keeps the start, ``right`` the end,
    ``middle`` both ends). verl counts ``max_tool_response_length`` in characters; here it is
    tokens, what the response budget is spent in."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text

    def dec(part):
        return tokenizer.decode(part, skip_special_tokens=False)

    if side == "left":
        return dec(ids[:max_tokens]) + "...(truncated)"
    if side == "right":
        return "(truncated)..." + dec(ids[len(ids) - max_tokens:])
    if side == "middle":
        head = max_tokens // 2
        return dec(ids[:head]) + "...(truncated)..." + dec(ids[len(ids) - (max_tokens - head):])
    raise ValueError(f"tool_response_truncate_side={side!r}: left, right or middle")
