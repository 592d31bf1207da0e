"""A generative reward model (``reward_model.style=generative``, an LLM as judge): a local Hugging
Face causal LM, served by the project's own rollout engines (``hf`` or ``vllm``), reads a judge
prompt built from a template and answers in text; a named parser turns the text into a score.

What belongs here: the judge prompt (:data:`DEFAULT_TEMPLATE`, :func:`check_template`), the
parsers (:data:`PARSERS`), checking the judge's folder (:func:`check_judge`, at prepare time,
before any work) and judging rows (:meth:`Judge.judge_rows`). What does not: how the judge's score
meets the ``reward.scorer`` score (``reward/scoring.py``, as for the discriminative reward model),
storing its answers (``RLTrainer.reward`` puts them in the scored batch's ``meta``).

The prompt follows verl's GenRM convention (docs/advance/reward_loop.rst, its FAPO recipe): a
template with ``{problem}`` and ``{solution}`` placeholders (here also ``{ground_truth}``),
filled with Python's ``str.format`` and sent as one user message through the judge's chat
template (``add_generation_prompt=True``); without a chat template, the filled text itself.
``{problem}`` is the prompt's last user message, ``{solution}`` the response as every scorer sees
it (``reward/decode.py``: cut at its first EOS).

Determinism: row i of step s samples from its own seed, ``derive_seed(seed, s, "judge-row-i")``
(``judge-baseline-i`` for ReMax's greedy responses), so a batch recomputed after damage, on any
number of workers, asks the same questions and draws the same answers; with the default
temperature 0 the judge is greedy and draws nothing.

Never a crash: a row whose judge prompt is too long, a judge call that raises (an engine error, a
model that produces NaN), and an answer the parser cannot read all score ``failure_score`` (0),
each counted (``reward/judge_failed``, ``reward/judge_unparsed``) and logged with the reason.
"""

from __future__ import annotations

import logging
import math
import os
import re
import string
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from verl_core.errors import PermanentError

__all__ = ["DEFAULT_TEMPLATE", "PARSERS", "TEMPLATE_FIELDS", "JudgeError", "JudgeResult", "Judge",
           "check_judge", "check_template", "parse_score", "problem_text"]

log = logging.getLogger(__name__)

TEMPLATE_FIELDS = ("problem", "solution", "ground_truth")
"""The placeholders a judge template may use."""

DEFAULT_TEMPLATE = (
    "You are grading a student's answer.\n\n"
    "Problem:\n{problem}\n\n"
    "Reference answer:\n{ground_truth}\n\n"
    "Student's answer:\n{solution}\n\n"
    "Is the student's final answer correct? Reply with <score>1</score> if it is and "
    "<score>0</score> if it is not.")
"""The judge prompt when ``reward_model.prompt_template`` names no file (for the ``score_tag``
parser)."""

_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


def _score_tag(text: str) -> float | None:
    """The number inside the last ``<score>...</score>``."""
    found = re.findall(r"<score>\s*(" + _NUMBER + r")\s*</score>", text)
    return float(found[-1]) if found else None


def _yes_no(text: str) -> float | None:
    """1 for an answer whose first word is yes, 0 for no (case and punctuation ignored)."""
    m = re.match(r"\W*(yes|no)\b", text, flags=re.IGNORECASE)
    if m is None:
        return None
    return 1.0 if m.group(1).lower() == "yes" else 0.0


def _last_number(text: str) -> float | None:
    """The last number in the text (verl's GenRM example reads an integer at the end)."""
    found = re.findall(_NUMBER, text)
    return float(found[-1]) if found else None


PARSERS: dict[str, Callable[[str], float | None]] = {
    "score_tag": _score_tag, "yes_no": _yes_no, "last_number": _last_number}
"""``reward_model.parser`` -> a function from the judge's answer to a score (None: unreadable)."""


def parse_score(parser: str, text: str) -> float | None:
    """The score ``parser`` reads in ``text``; None when it reads none or a non-finite one."""
    value = PARSERS[parser](text)
    return value if value is not None and math.isfinite(value) else None


class JudgeError(PermanentError, ValueError):
    """The judge cannot be used at all (its folder, its tokenizer, its template). Raised at prepare
    time, before any work, naming the thing and the fix."""


def check_template(text: str, where: str) -> str:
    """``text`` when it is a usable judge template: only :data:`TEMPLATE_FIELDS` as placeholders,
    ``{solution}`` among them (a judge that never sees the response scores nothing)."""
    try:
        names = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as e:
        raise JudgeError(f"{where}: not a valid template ({e}); write literal braces as {{{{ "
                         "and }}") from e
    unknown = sorted(n for n in names if n not in TEMPLATE_FIELDS)
    if unknown:
        raise JudgeError(f"{where}: unknown placeholder(s) {unknown}; a judge template may use "
                         f"{['{' + f + '}' for f in TEMPLATE_FIELDS]} (write literal braces as "
                         "{{ and }})")
    if "solution" not in names:
        raise JudgeError(f"{where}: has no {{solution}} placeholder; the judge would never see "
                         "the response it scores")
    return text


def read_template(path: str) -> str:
    """The judge template in ``path`` (a text file), checked; the default for ""."""
    if not path:
        return DEFAULT_TEMPLATE
    where = f"reward_model.prompt_template={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise JudgeError(f"{where}: cannot read it ({e}); give a UTF-8 text file with "
                         "{problem} and {solution} placeholders") from e
    return check_template(text, where)


def check_judge(path: str, template: str = "") -> None:
    """Check a judge folder (a causal LM with its tokenizer) and its template without loading the
    weights. Raises :class:`JudgeError` (or ``ModelLoadError``) naming the folder and the fix."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from verl_core.models.loading import check_model_folder, load_tokenizer

    read_template(template)
    where = f"reward_model.path={path!r}"
    if not path or not os.path.isdir(path):
        raise JudgeError(f"{where}: no such folder; with reward_model.style=generative point it "
                         "at a local Hugging Face causal LM folder (config.json, weights, "
                         "tokenizer)")
    check_model_folder(path, "reward_model.path")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    want = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    archs = list(getattr(config, "architectures", None) or [])
    if want is None or want not in archs:
        # a sequence classifier loads as a causal LM too, with a random LM head: refused
        raise JudgeError(f"{where}: not a causal LM (architectures={archs}, model_type="
                         f"{config.model_type!r}); a generative judge writes its verdict as text: "
                         f"give a folder saved from {want or 'an AutoModelForCausalLM'}")
    load_tokenizer(path)


def problem_text(chat: Sequence[dict]) -> str:
    """The prompt's last user message (the question the response answers)."""
    users = [m.get("content", "") for m in chat if m.get("role") == "user"]
    return str(users[-1]) if users else ""


@dataclass
class JudgeResult:
    """The judge's verdict on n rows."""

    scores: list[float]  # (n,) the parsed score, failure_score where none
    outputs: list[str]  # (n,) the judge's answer ("" where it was not asked or failed)
    failed: int  # rows the judge could not be asked (too long) or whose call raised
    unparsed: int  # rows whose answer the parser could not read
    seconds: float  # wall time of this worker's share


class Judge:
    """A loaded judge: its model served by a rollout engine, its tokenizer, template and parser.
    Build with :meth:`load`."""

    def __init__(self, engine, tokenizer, *, template: str, parser: str, params,
                 max_length: int, failure_score: float, micro_batch_size: int, path: str = ""):
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = template
        self.parser = parser
        self.params = params  # SamplingParams (seed unused: each row has its own)
        self.max_length = max_length
        self.failure_score = failure_score
        self.micro_batch_size = micro_batch_size
        self.path = path

    @classmethod
    def load(cls, path: str, rm_cfg, *, template_path: str = "", device="cpu",
             rollout_cfg=None) -> "Judge":
        """The judge of ``reward_model`` section ``rm_cfg`` from its folder ``path`` (the run's
        pinned copy), served by ``rm_cfg.engine``; ``rollout_cfg`` gives the vLLM settings."""
        from verl_core.models.loading import load_causal_lm, load_tokenizer
        from verl_core.reward.decode import stop_token_ids
        from verl_core.reward.model import max_positions
        from verl_core.rollout import make_engine
        from verl_core.rollout.base import SamplingParams

        check_judge(path, template_path)
        tok = load_tokenizer(path)
        model = load_causal_lm(path, rm_cfg.dtype).to(device)
        limit = max_positions(model.config) or 0
        max_length = rm_cfg.max_length or limit
        rc = rollout_cfg
        vllm = {} if rc is None else dict(
            max_num_seqs=rc.max_num_seqs, gpu_memory_utilization=rc.gpu_memory_utilization,
            enforce_eager=rc.enforce_eager, cpu_kv_cache_gib=rc.cpu_kv_cache_gib,
            engine_own_process=rc.engine_own_process, engine_timeout_s=rc.engine_timeout_s,
            engine_max_restarts=rc.engine_max_restarts)
        engine = make_engine(rm_cfg.engine, model=model, model_path=path,
                             eos_token_ids=stop_token_ids(tok), pad_token_id=tok.pad_token_id,
                             micro_batch_size=rm_cfg.micro_batch_size,
                             max_model_len=max_length or None, dtype=rm_cfg.dtype, **vllm)
        params = SamplingParams(temperature=rm_cfg.temperature, top_p=rm_cfg.top_p,
                                max_new_tokens=rm_cfg.max_new_tokens)
        return cls(engine, tok, template=read_template(template_path), parser=rm_cfg.parser,
                   params=params, max_length=max_length, failure_score=rm_cfg.failure_score,
                   micro_batch_size=rm_cfg.micro_batch_size, path=path)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def prompt(self, chat: Sequence[dict], response: str, ground_truth: str) -> str:
        """The judge's input text for one row (see the module docstring)."""
        text = self.template.format(problem=problem_text(chat), solution=response,
                                    ground_truth=ground_truth)
        if self.has_chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return text

    def judge_rows(self, rows: Sequence, responses: Sequence[str], *, seeds: Sequence[int],
                   dp=None) -> JudgeResult:
        """The judge's verdict on each (dataset row ``rows[i]``, response text ``responses[i]``),
        row i sampled from ``seeds[i]``. With W > 1 (``dp``) worker r asks the r-th contiguous
        share of the rows and the shares are gathered (a collective: every worker calls it); a
        row's answer depends on its prompt and seed only, so W changes nothing."""
        t0 = time.perf_counter()
        n = len(rows)
        W, k = (dp.size, dp.rank) if dp is not None else (1, 0)
        lo, hi = n * k // W, n * (k + 1) // W
        local = self._judge_share(rows[lo:hi], responses[lo:hi], seeds[lo:hi], first=lo)
        parts = dp.gather_objects(local) if dp is not None else [local]
        scores = [s for p in parts for s in p[0]]
        outputs = [o for p in parts for o in p[1]]
        return JudgeResult(scores=scores, outputs=outputs, failed=sum(p[2] for p in parts),
                           unparsed=sum(p[3] for p in parts), seconds=time.perf_counter() - t0)

    def _judge_share(self, rows, responses, seeds, *, first: int):
        """(scores, outputs, failed, unparsed) of this worker's rows."""
        import torch

        from verl_core.reward.decode import decode_responses

        n = len(rows)
        scores, outputs = [self.failure_score] * n, [""] * n
        failed = unparsed = 0
        texts = [self.prompt(r.chat, resp, r.ground_truth) for r, resp in zip(rows, responses)]
        ids = self.tokenizer(texts, add_special_tokens=not self.has_chat_template)["input_ids"]
        budget = self.max_length - self.params.max_new_tokens if self.max_length else None
        asked = [i for i, row_ids in enumerate(ids) if budget is None or len(row_ids) <= budget]
        if len(asked) < n:
            failed += n - len(asked)
            i = next(i for i in range(n) if i not in set(asked))
            log.warning("judge: %d row(s) have a judge prompt longer than reward_model.max_length "
                        "- reward_model.max_new_tokens = %d tokens (row %d: %d): scored %s. "
                        "Shorten the template or the responses, or raise "
                        "reward_model.max_length", n - len(asked), budget, first + i, len(ids[i]),
                        self.failure_score)
        pad = self.tokenizer.pad_token_id
        for s in range(0, len(asked), self.micro_batch_size):
            part = asked[s:s + self.micro_batch_size]
            width = max(len(ids[i]) for i in part)
            prompt = torch.full((len(part), width), pad, dtype=torch.long)  # (b, P) left-padded
            mask = torch.zeros((len(part), width), dtype=torch.long)  # (b, P)
            for j, i in enumerate(part):
                prompt[j, width - len(ids[i]):] = torch.as_tensor(ids[i], dtype=torch.long)
                mask[j, width - len(ids[i]):] = 1
            try:
                out = self.engine.generate(prompt, mask, self.params,
                                           row_seeds=[int(seeds[i]) for i in part])
                answers = decode_responses(self.tokenizer, out.response_ids,
                                           out.response_mask).texts
            except Exception as e:  # noqa: BLE001 - a judge that fails scores 0, never a crash
                failed += len(part)
                log.error("judge: rows %s: the judge's call failed (%s: %s); scored %s",
                          [first + i for i in part], type(e).__name__, e, self.failure_score)
                continue
            for i, answer in zip(part, answers):
                outputs[i] = answer
                value = parse_score(self.parser, answer)
                if value is None:
                    if not unparsed:
                        log.warning("judge: the %s parser reads no score in row %d's answer %r: "
                                    "scored %s (each such row is counted in "
                                    "reward/judge_unparsed)", self.parser, first + i,
                                    answer[-200:], self.failure_score)
                    unparsed += 1
                else:
                    scores[i] = value
        return scores, outputs, failed, unparsed

    def close(self) -> None:
        self.engine.close()
