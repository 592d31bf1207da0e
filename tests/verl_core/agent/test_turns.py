"""Token-in/token-out turns (verl_core/agent/turns.py) on the stand-ins' real chat templates: the
ids a rollout appends after a sampled turn make, with the sampled ids, exactly the tokens the
template gives the whole conversation."""
import pytest

from tests.standins import llama3_tokenizer, qwen_tokenizer
from verl_core.agent.tools import CalculatorTool
from verl_core.agent.turns import TemplateError, observation_ids, truncate_observation

TOOLS = [CalculatorTool.SCHEMA]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "48 / 2"}}\n</tool_call>'


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("family", ["qwen", "llama3"])
def test_appended_turns_are_the_templates_tokens_of_the_whole_conversation(family):
    tok = qwen_tokenizer() if family == "qwen" else llama3_tokenizer()
    eot = "<|im_end|>" if family == "qwen" else "<|eot_id|>"
    tools = TOOLS if family == "qwen" else None  # the Llama stand-in's template has no tools
    chat = [{"role": "user", "content": "Natalia sold 48 clips, then half as many. How many?"}]
    prompt = tok.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
    ids = _ids(tok, prompt)
    turns = [CALL, "24 in May, so 48 + 24 = 72. #### 72"]
    observations = [[{"role": "tool", "content": "24"}]]
    for k, turn in enumerate(turns):
        ids += _ids(tok, turn) + _ids(tok, eot)  # the turn as sampled, up to its stop token
        if k < len(observations):
            ids += observation_ids(tok, observations[k], end_of_turn=eot, tools=tools)
    whole = chat + [{"role": "assistant", "content": turns[0]}, *observations[0],
                    {"role": "assistant", "content": turns[1]}]
    want = _ids(tok, tok.apply_chat_template(whole, tools=tools, tokenize=False))
    # the template ends the last assistant message with its end-of-turn token (and Qwen's newline)
    assert ids == want[:len(ids)] and tok.decode(want[len(ids):]).strip() == ""


def test_two_tool_responses_and_the_next_header_in_one_span():
    tok = qwen_tokenizer()
    ids = observation_ids(tok, [{"role": "tool", "content": "24"}, {"role": "tool", "content": "7"}],
                          end_of_turn="<|im_end|>", tools=TOOLS)
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n24\n</tool_response>\n"
                               "<tool_response>\n7\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")


def test_a_stop_token_the_template_does_not_end_turns_with_is_refused():
    with pytest.raises(TemplateError, match=r"does not end an assistant message with "
                                            r"'<\|endoftext\|>'"):
        observation_ids(qwen_tokenizer(), [{"role": "tool", "content": "1"}],
                        end_of_turn="<|endoftext|>")


def test_a_template_that_rewrites_earlier_turns_is_refused():
    # renders the assistant's content only when it is the last message (as reasoning templates
    # drop earlier thoughts): appending tokens would not be what the template gives
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                "{% if m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}")
    with pytest.raises(TemplateError, match="renders earlier turns differently"):
        observation_ids(qwen_tokenizer(template), [{"role": "tool", "content": "1"}],
                        end_of_turn="<|im_end|>")


@pytest.mark.parametrize("side,starts,ends", [("left", "0 1 2", "...(truncated)"),
                                              ("right", "(truncated)...", "10 11 12"),
                                              ("middle", "0 1", "11 12")])
def test_a_long_tool_response_is_cut_to_its_token_budget(side, starts, ends):
    tok = qwen_tokenizer()
    text = " ".join(str(i) for i in range(13))
    cut = truncate_observation(text, tok, 8, side)
    assert cut.startswith(starts) and cut.endswith(ends), cut
    assert len(_ids(tok, cut.replace("...(truncated)...", "").replace("...(truncated)", "")
                    .replace("(truncated)...", ""))) <= 8
    assert truncate_observation("0 1", tok, 8, side) == "0 1"
