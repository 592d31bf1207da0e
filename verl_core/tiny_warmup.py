"""The tiny model's supervised warm start (``model.warmup_sft_steps``): the targets (each row's
answer; for the calculator task, tool-call transcripts built as a rollout builds them,
:func:`calculator_transcripts`), run in parts through ``training/sft.py`` and stopped early at
the training slice's target accuracy (its greedy probe, :class:`_AccuracyProbe`).

What does not belong here: the supervised loop (``training/sft.py``), saving, resuming and reusing
the warm start (``warmstart.py``), a brought model's format warm start (``format_warmup.py``).
"""

from __future__ import annotations

import random
import time

from verl_core.agent.tools import ToolHost, tool_entries
from verl_core.agent.turns import observation_ids
from verl_core.config import RunConfig
from verl_core.data.batch import encode_prompts
from verl_core.data.dataset import PromptRow, render_prompt
from verl_core.reward.decode import decode_responses, stop_token_ids
from verl_core.reward.manager import RewardScorer
from verl_core.rollout import SamplingParams, make_engine
from verl_core.rollout.multi_turn import generate_turns, turn_limits
from verl_core.seeds import derive_seed
from verl_core.training.sft import supervised_warm_start
from verl_core.warmstart import WarmStart


def tiny_warm_start(cfg: RunConfig, model, tok, rows, schemas, calculator: bool, ws: WarmStart,
                    log, guess: bool = False) -> None:
    """The tiny model's supervised warm start (``training/sft.py``), in its parts, resumed from
    and saved through ``ws``; sets ``ws.steps_done`` and ``ws.accuracy``. ``guess``: the
    guessing game's random legal guesses (:func:`guess_transcripts`)."""
    m = cfg.model
    prompts = [render_prompt(r, tok, schemas) for r in rows]
    host = ToolHost(tool_entries(cfg.rollout.tool_config_path),
                    timeout_s=cfg.rollout.tool_timeout_s) if schemas else None
    try:
        probe = _AccuracyProbe(model, tok, rows[:256], prompts[:256], cfg, host, schemas)
        t0 = time.perf_counter()
        # the calculator task: every transcript calls the tool, then a mixed part in which
        # most answer at once (model.warmup_mixed_steps)
        parts = [(m.warmup_sft_steps, 1.0, "sft"), (m.warmup_mixed_steps,
                                                    m.warmup_tool_fraction, "sft-mixed")] \
            if calculator else [(m.warmup_sft_steps, -1.0, "sft-guess")] if guess \
            else [(m.warmup_sft_steps, None, "sft")]
        saved = ws.resume_point()
        if saved is not None:
            model.load_state_dict(saved["model"])
            probe.last = saved["probe_last"]
        losses = list(saved["prior_losses"]) if saved is not None else []
        first_part = saved["part"] if saved is not None else 0
        for i, (steps, fraction, phase) in enumerate(parts):
            if i < first_part:
                continue
            targets = {"answers": [r.ground_truth for r in rows]} if fraction is None else \
                {"responses": guess_transcripts(tok, rows, derive_seed(cfg.seed, 0, phase),
                                                cfg.rollout.max_assistant_turns)} if guess else \
                {"responses": calculator_transcripts(
                    tok, rows, schemas, derive_seed(cfg.seed, 0, phase + "-tools"), fraction)}
            prior = list(losses)

            def on_step(part_losses, snapshot, i=i, prior=prior):
                ws.after_step(len(prior) + len(part_losses), part_losses[-20:], probe.last,
                              lambda: {"part": i, "prior_losses": prior, "inner": snapshot(),
                                       "model": model.state_dict(), "probe_last": probe.last})

            losses += supervised_warm_start(
                model, tok, prompts, **targets,
                steps=steps, batch_size=m.warmup_sft_batch_size,
                lr=m.warmup_sft_lr, seed=derive_seed(cfg.seed, 0, phase),
                max_prompt_length=cfg.data.max_prompt_length,
                truncation=cfg.data.truncation,
                stop_fn=(lambda: probe() >= m.warmup_target_accuracy)
                if m.warmup_target_accuracy < 1.0 else None,
                resume=saved["inner"] if saved is not None and i == first_part else None,
                on_step=on_step)
    finally:
        if host is not None:
            host.close()
    ws.steps_done, ws.accuracy = len(losses), probe.last
    if losses:
        acc = "" if probe.last != probe.last else f", train-slice accuracy {probe.last:.3f}"
        log(f"warm start: {len(losses)} SFT steps in {time.perf_counter() - t0:.1f}s, "
            f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{acc}")


CALCULATOR_CALL = '<tool_call>{{"name":"calculator","arguments":{{"expression":"{}"}}}}</tool_call>'
"""The call the calculator task's warm start teaches (hermes, compact JSON)."""


def calculator_transcripts(tok, rows: list[PromptRow], tools: list[dict] | None,
                           seed: int, tool_fraction: float) -> list[tuple[list[int], list[float]]]:
    """The calculator task's warm-start responses, (ids, loss mask) per row, built as a
    rollout builds them (``rollout/multi_turn.py``): a call turn, the tool's response as the
    chat template's ids (mask 0), the answer turn; or, for the rows a seeded draw leaves out
    (``model.warmup_tool_fraction``), the answer alone."""
    rng, eos = random.Random(seed), tok.eos_token_id
    out = []
    for r in rows:
        answer = tok(r.ground_truth, add_special_tokens=False)["input_ids"] + [eos]
        if rng.random() >= tool_fraction:
            out.append((answer, [1.0] * len(answer)))
            continue
        e = r.extra_info
        call = tok(CALCULATOR_CALL.format(f"{e['a']}{e['op']}{e['b']}"),
                   add_special_tokens=False)["input_ids"] + [eos]
        obs = observation_ids(tok, [{"role": "tool", "content": r.ground_truth}],
                              end_of_turn=tok.eos_token, tools=tools)
        out.append((call + obs + answer, [1.0] * len(call) + [0.0] * len(obs)
                    + [1.0] * len(answer)))
    return out


def guess_transcripts(tok, rows: list[PromptRow], seed: int,
                      max_turns: int) -> list[tuple[list[int], list[float]]]:
    """The guessing game's warm-start responses, (ids, loss mask) per row, built as a rollout
    against the scripted user builds them: each turn a uniformly random guess among the numbers
    the user's answers so far leave (a legal but not a halving strategy: RL has room to learn
    halving), the user's answer as the template's ids (mask 0), until ``correct`` or
    ``max_turns`` guesses (no answer after the last, as the rollout)."""
    rng, eos, out = random.Random(seed), tok.eos_token_id, []
    for r in rows:
        kw = r.extra_info["interaction_kwargs"]
        lo, hi, target = int(kw["low"]), int(kw["high"]), int(kw["target"])
        ids: list[int] = []
        mask: list[float] = []
        for k in range(max_turns):
            g = rng.randint(lo, hi)
            turn = tok(str(g), add_special_tokens=False)["input_ids"] + [eos]
            ids += turn
            mask += [1.0] * len(turn)
            if k == max_turns - 1:
                break
            said = "correct" if g == target else "higher" if target > g else "lower"
            obs = observation_ids(tok, [{"role": "user", "content": said}],
                                  end_of_turn=tok.eos_token)
            ids += obs
            mask += [0.0] * len(obs)
            if g == target:
                break
            lo, hi = (g + 1, hi) if target > g else (lo, g - 1)
        out.append((ids, mask))
    return out


class _AccuracyProbe:
    """Greedy accuracy of ``model`` on a fixed slice of training prompts (rule scorer); with a
    tool ``host``, of multi-turn rollouts."""

    def __init__(self, model, tok, rows, prompts, cfg: RunConfig, host=None, tools=None):
        self.ids, self.mask = encode_prompts(tok, prompts, cfg.data.max_prompt_length,
                                             truncation=cfg.data.truncation)
        self.rows, self.tok, self.model, self.host, self.tools = rows, tok, model, host, tools
        self.rc = cfg.rollout
        self.engine = make_engine("hf", model=model, eos_token_ids=stop_token_ids(tok),
                                  pad_token_id=tok.pad_token_id)
        self.params = SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens)
        self.scorer = RewardScorer.from_config(cfg.reward)
        self.last = float("nan")

    def __call__(self) -> float:
        if self.host is not None:
            out = generate_turns(
                self.engine, self.tok,
                [i[m.bool()].tolist() for i, m in zip(self.ids, self.mask)], self.params,
                host=self.host, tools=self.tools, **turn_limits(self.rc), instance_prefix="probe")
            dec = decode_responses(self.tok, out.response_ids, out.attention_mask,
                                   sampled_mask=out.response_mask)
        else:
            out = self.engine.generate(self.ids, self.mask, self.params)
            dec = decode_responses(self.tok, out.response_ids, out.response_mask)
        res = self.scorer.score([r.data_source for r in self.rows], dec.texts,
                                [r.ground_truth for r in self.rows],
                                special_token=dec.special_token)
        self.last = sum(res.scores) / len(res.scores)
        return self.last
