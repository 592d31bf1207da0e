"""The held-out evaluation: ``val/accuracy`` (the mean score), the mean response length and,
sampling k responses per prompt, verl's ``val/best@k``; greedy unless ``rollout.val_do_sample``
(then seeded by the run's seed and the step). With W > 1 each worker decodes a contiguous share of
the rows and the scores are gathered."""

from __future__ import annotations

from verl_core import report
from verl_core.agent.loops import loop_scores, stored_with_agents, uses_agent_loops
from verl_core.data.prompts import Prompts
from verl_core.report import EvalSample
from verl_core.reward.decode import decode_responses
from verl_core.reward.scoring import turn_extra_info
from verl_core.rollout import SamplingParams


def evaluate(cfg, behaviour, prompts: Prompts, scorer, dp, n_samples: int, step: int,
             seed: int) -> tuple[dict, list[EvalSample]]:
    """The held-out metrics of the current policy (``behaviour.policy_engine()``) and the first
    ``n_samples`` responses as decoded (with W > 1, from this worker's share). ``seed``: the
    sampling seed of this step's evaluation (``rollout.val_do_sample``)."""
    rc, tok = cfg.rollout, prompts.tokenizer
    sampled = rc.val_do_sample and rc.val_temperature > 0  # verl: do_sample at 0 is greedy
    k = rc.val_n if sampled else 1  # responses per prompt, adjacent (as rollout.n's)
    params = SamplingParams(temperature=rc.val_temperature if sampled else 0.0,
                            top_p=rc.val_top_p, top_k=rc.val_top_k,
                            max_new_tokens=rc.max_new_tokens, seed=seed)
    n, W, r = prompts.val_ids.shape[0], dp.size, dp.rank
    lo, hi = n * r // W, n * (r + 1) // W  # no collectives in decoding: shares may differ
    texts, special, lengths, shown, infos, loop_stored = [], [], [], [], [], []
    step_rows = cfg.data.val_batch_size
    with behaviour.policy_engine() as engine:
        for s in range(lo, hi, step_rows):
            e = min(s + step_rows, hi)
            ids = prompts.val_ids[s:e].repeat_interleave(k, 0)
            mask = prompts.val_mask[s:e].repeat_interleave(k, 0)
            # each response draws what it would in one call over all n x k rows: the numbers
            # do not depend on the worker count or val_batch_size
            sampled_mask = None
            chunk = [row for row in prompts.val_rows[s:e] for _ in range(k)]
            if rc.multi_turn or uses_agent_loops(rc, chunk):
                out = behaviour.generate_turns(ids, mask, params, list(range(s * k, e * k)),
                                               chunk, "val", split=False, engine=engine)
                # the scorer sees verl's num_turns and tool_rewards, as in the rollout phase
                stored = stored_with_agents(out)
                infos += turn_extra_info([row.extra_info for row in chunk], stored)
                loop_stored += stored
                real = out.attention_mask  # (n, T) every real token, tools' responses too
                sampled_mask = out.response_mask
                dec = decode_responses(tok, out.response_ids, real,
                                       sampled_mask=out.response_mask)
            else:
                out = engine.generate(ids, mask, params, first_row=s * k, total_rows=n * k) \
                    if sampled else engine.generate(ids, mask, params)
                real = out.response_mask
                dec = decode_responses(tok, out.response_ids, out.response_mask)
                infos += [row.extra_info for row in chunk]
                loop_stored += [{} for _ in chunk]
            for i in range(min(len(ids), n_samples - len(shown))):  # as the model saw them
                shown.append((report.visible_text(tok, ids[i], mask[i]),
                              report.visible_text(tok, out.response_ids[i], real[i],
                                                  None if sampled_mask is None
                                                  else sampled_mask[i])))
            texts += dec.texts
            special += dec.special_token
            lengths += real.sum(-1).tolist()
    rows = [row for row in prompts.val_rows[lo:hi] for _ in range(k)]
    res = scorer.score([r.data_source for r in rows], texts,
                       [r.ground_truth for r in rows], infos, special_token=special)
    own = [s if g is None else g for s, g in  # a loop's own reward_score (failed: 0)
           zip(res.scores, loop_scores(loop_stored) or [None] * len(rows))]
    scores = [s for part in dp.gather_objects(own) for s in part]
    lengths = [x for part in dp.gather_objects(lengths) for x in part]
    samples = [EvalSample(prompt=prompt, response=response, ground_truth=row.ground_truth,
                          score=float(score))
               for row, (prompt, response), score in zip(rows, shown, own)]
    metrics = {"val/accuracy": sum(scores) / max(1, len(scores)),
               "val/response_length": sum(lengths) / max(1, len(lengths))}
    if k > 1:  # verl's best@n: each prompt's best of its k responses, averaged
        best = [max(scores[i:i + k]) for i in range(0, len(scores), k)]
        metrics[f"val/best@{k}"] = sum(best) / max(1, len(best))
    return metrics, samples
