"""The ``reward`` and ``reward_model`` sections of :class:`~verl_core.config.RunConfig`: the rule
or custom scorer and its timeouts, and the optional reward model, beside the scorers. Composed
into the run, checked against the other sections and hashed in ``verl_core/config.py``. Like the
rest of ``reward/``, free of torch imports.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_core.config_fields import (_check_types, _fail, _non_negative, _one_of, _positive,
                                     in_trajectory, not_in_trajectory)


def _sandbox_tuned(run) -> bool:
    """The code sandbox's limits at their defaults: the run hashes as before they existed."""
    r = run.reward
    return (r.sandbox_timeout_s, r.sandbox_memory_mb) != (5.0, 1024)


def _sandbox_url_set(run) -> bool:
    return bool(run.reward.sandbox_url)


def _overlong_on(run) -> bool:
    """``reward.overlong_buffer_enable`` off: the buffer's fields do nothing, and the run hashes
    as before they existed."""
    return run.reward.overlong_buffer_enable


@dataclass(frozen=True)
class RewardConfig:
    """How responses are scored."""

    scorer: str = in_trajectory("auto")
    """``auto`` (pick a rule scorer by each row's data_source), ``arithmetic``, ``gsm8k``, or a
    custom ``path/to/file.py:function`` / ``module:function`` with verl's signature
    ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``."""
    timeout_s: float = in_trajectory(10.0)
    """Per-call timeout of a custom scorer (run in a worker process); a timeout scores
    ``timeout_score`` and is counted in the metrics."""
    timeout_score: float = in_trajectory(0.0)
    """Score given to a response whose custom scorer timed out."""
    overlong_buffer_enable: bool = in_trajectory(False, when=_overlong_on)
    """DAPO's overlong reward shaping (verl's ``reward_model.overlong_buffer.enable``, its DAPO
    reward manager): a response longer than ``rollout.max_new_tokens - overlong_buffer_len``
    tokens gets ``min(-(length - expected) / overlong_buffer_len * overlong_penalty_factor, 0)``
    added to its score (``reward/overlong.py``)."""
    overlong_buffer_len: int = in_trajectory(0, when=_overlong_on)
    """The buffer: the last this-many tokens of the response budget, over which the penalty
    grows linearly to ``-overlong_penalty_factor`` (verl's ``overlong_buffer.len``)."""
    overlong_penalty_factor: float = in_trajectory(0.0, when=_overlong_on)
    """The penalty of a response that uses the whole budget (verl's
    ``overlong_buffer.penalty_factor``)."""
    overlong_buffer_log: bool = not_in_trajectory(False)
    """Log ``reward/overlong_reward_mean`` and ``reward/overlong_fraction`` each step (verl's
    ``overlong_buffer.log``, which records the per-response ``overlong_reward``/``overlong``)."""
    sandbox_timeout_s: float = in_trajectory(5.0, when=_sandbox_tuned)
    """Wall-clock limit of one sandboxed code run (the ``code`` scorer, ``reward/sandbox.py``);
    its CPU limit is half of it. Code still running then scores 0."""
    sandbox_memory_mb: int = in_trajectory(1024, when=_sandbox_tuned)
    """Address-space limit of one sandboxed code run (verl's
    ``reward_model.sandbox_fusion.memory_limit_mb``); an allocation beyond it fails."""
    sandbox_url: str = in_trajectory("", when=_sandbox_url_set)
    """Empty: code runs in the local sandbox. An http(s) URL of a SandboxFusion service's
    ``/run_code`` (verl's ``reward_model.sandbox_fusion.url``): each test one request there
    (``reward/sandbox_fusion.py``); an unreachable or failing service fails the reward phase."""
    sandbox_max_concurrent: int = not_in_trajectory(4)
    """Sandboxed code runs at once in the reward phase (verl's
    ``reward_model.sandbox_fusion.max_concurrent``); speed only."""
    sandbox_isolation: str = not_in_trajectory("auto")
    """``auto`` (``namespaces`` as root, else ``userns`` where user namespaces are allowed,
    else ``rlimits``, with a warning), ``namespaces`` (root: namespaces and a uid of its own;
    fails where not allowed), ``userns`` (the same namespaces in a user namespace, without root)
    or ``rlimits`` (limits only: no network or filesystem isolation); docs/rewards.md, "Code
    execution rewards"."""
    # a run that completes scores the same whatever the next four are
    num_workers: int = not_in_trajectory(2)
    """Worker processes for custom scorers."""
    import_timeout_s: float = not_in_trajectory(60.0)
    """Deadline for loading a custom scorer in a worker, its import included; one that hangs or
    kills its process while loading fails the run with an error naming it."""
    max_timeout_fraction: float = not_in_trajectory(0.5)
    """A batch in which more than this fraction of custom-scorer calls time out triggers
    ``on_timeouts`` (every timeout is logged and counted in ``reward/timeouts`` anyway)."""
    on_timeouts: str = not_in_trajectory("fail")
    """``fail`` (an error naming the scorer) or ``warn`` (log it, keep the ``timeout_score``
    rewards) when a batch has more than ``max_timeout_fraction`` timed-out calls."""

    def __post_init__(self):
        _check_types("reward", self)
        if not self.scorer:
            _fail("reward", "scorer", self.scorer, "must not be empty; use 'auto'")
        _positive("reward", self, "timeout_s", "num_workers", "import_timeout_s")
        if not 0.0 <= self.max_timeout_fraction <= 1.0:
            _fail("reward", "max_timeout_fraction", self.max_timeout_fraction,
                  "must be in [0, 1] (1 never fails on timeouts)")
        _one_of("reward", "on_timeouts", self.on_timeouts, {"fail", "warn"})
        _positive("reward", self, "sandbox_timeout_s", "sandbox_memory_mb",
                  "sandbox_max_concurrent")
        _one_of("reward", "sandbox_isolation", self.sandbox_isolation,
                {"auto", "namespaces", "userns", "rlimits"})
        if self.sandbox_url and not self.sandbox_url.startswith(("http://", "https://")):
            _fail("reward", "sandbox_url", self.sandbox_url,
                  "must be empty (the local sandbox) or the http(s) URL of a SandboxFusion "
                  "service's /run_code, e.g. http://sandbox:8080/run_code")
        _non_negative("reward", self, "overlong_buffer_len", "overlong_penalty_factor")
        if self.overlong_buffer_enable and self.overlong_buffer_len < 1:
            _fail("reward", "overlong_buffer_len", self.overlong_buffer_len,
                  "must be >= 1 with reward.overlong_buffer_enable=True (the penalty divides by "
                  "it); e.g. a quarter of rollout.max_new_tokens, as DAPO's 4096 of 20480")


REWARD_MODEL_COMBINE = ("replace", "add")
"""How a reward model's score meets the ``reward.scorer`` score (``RewardModelConfig.combine``)."""
REWARD_MODEL_STYLES = ("discriminative", "generative")
"""``RewardModelConfig.style``: a sequence classifier's score, or a judge's text parsed."""
JUDGE_PARSERS = ("score_tag", "yes_no", "last_number")
"""``RewardModelConfig.parser`` (``reward/judge.py``'s ``PARSERS``)."""


def _generative(run) -> bool:
    """A generative judge's fields decide the trajectory only when it is on: every other run
    hashes as before they existed."""
    return run.reward_model.enable and run.reward_model.style == "generative"


@dataclass(frozen=True)
class RewardModelConfig:
    """A model-based reward, as verl's ``reward_model`` section: a local Hugging Face
    sequence-classification model (one label) scores prompt + response on the run's workers
    (``verl_core/reward/model.py``). What does not carry over from verl 0.9 (a serving engine and
    resource pool for the RM, a custom reward function that queries it, truncation) and why:
    docs/rewards.md."""

    enable: bool = in_trajectory(False)
    """Score responses with the reward model (verl's ``reward_model.enable``)."""
    path: str = in_trajectory("")
    """Local Hugging Face folder of an ``AutoModelForSequenceClassification`` with
    ``num_labels=1`` and its tokenizer (verl's ``reward_model.model.path``)."""
    combine: str = in_trajectory("replace")
    """``replace``: the model's score is the reward, as in verl 0.9 (``reward.scorer`` then only
    scores evaluation); ``add``: reward = ``reward.scorer``'s score + the model's score."""
    micro_batch_size: int = not_in_trajectory(64)
    """Sequences per reward-model forward pass on each worker (verl's
    ``micro_batch_size_per_gpu``; memory only: scores do not depend on it)."""
    max_length: int = not_in_trajectory(0)
    """Most tokens of one reward-model input; a longer one is an error naming the row (verl
    truncates it instead). 0: the model's ``max_position_embeddings``."""
    dtype: str = in_trajectory("float32")
    """Parameter dtype of the reward model: float32 or bfloat16."""
    style: str = in_trajectory("discriminative", when=_generative)
    """``discriminative``: ``path`` is a sequence classifier, its logit the score;
    ``generative``: ``path`` is a causal LM used as a judge (``reward/judge.py``): it answers a
    prompt built from ``prompt_template`` and ``parser`` reads the score in its text."""
    engine: str = in_trajectory("hf", when=_generative)
    """The rollout engine serving a generative judge: ``hf`` or ``vllm`` (verl's
    ``reward_model.rollout.name``); the same seeds, the same tokens up to float rounding."""
    prompt_template: str = in_trajectory("", when=_generative)
    """A text file with the judge prompt, verl's GenRM convention: ``{problem}`` (the prompt's
    last user message), ``{solution}`` (the response), ``{ground_truth}``; "" for the built-in
    template (``reward/judge.py``'s ``DEFAULT_TEMPLATE``, read by ``score_tag``). The file is
    pinned with the run's assets: a changed file is a changed run."""
    parser: str = in_trajectory("score_tag", when=_generative)
    """How the judge's answer becomes a score: ``score_tag`` (the number in the last
    ``<score>...</score>``), ``yes_no`` (first word yes -> 1, no -> 0), ``last_number``."""
    temperature: float = in_trajectory(0.0, when=_generative)
    """The judge's sampling temperature; 0 is greedy (each row has its own seed otherwise)."""
    top_p: float = in_trajectory(1.0, when=_generative)
    """The judge's nucleus sampling."""
    max_new_tokens: int = in_trajectory(64, when=_generative)
    """The longest judge answer (verl's ``reward_model.rollout.response_length``)."""
    failure_score: float = in_trajectory(0.0, when=_generative)
    """The score of a row the judge could not be asked, whose call failed, or whose answer the
    parser cannot read (each counted: ``reward/judge_failed``, ``reward/judge_unparsed``)."""

    def __post_init__(self):
        _check_types("reward_model", self)
        _one_of("reward_model", "style", self.style, REWARD_MODEL_STYLES)
        if self.enable and not self.path:
            _fail("reward_model", "path", self.path,
                  "reward_model.enable=True needs a local Hugging Face folder of a "
                  + ("causal LM (the judge)" if self.style == "generative" else
                     "sequence-classification model with num_labels=1")
                  + "; set reward_model.path")
        _one_of("reward_model", "combine", self.combine, REWARD_MODEL_COMBINE)
        _one_of("reward_model", "engine", self.engine, {"hf", "vllm"})
        _one_of("reward_model", "parser", self.parser, JUDGE_PARSERS)
        _non_negative("reward_model", self, "temperature")
        _positive("reward_model", self, "max_new_tokens")
        if not 0.0 < self.top_p <= 1.0:
            _fail("reward_model", "top_p", self.top_p, "must be in (0, 1]")
        _positive("reward_model", self, "micro_batch_size")
        _non_negative("reward_model", self, "max_length")
        _one_of("reward_model", "dtype", self.dtype, {"float32", "bfloat16"})
