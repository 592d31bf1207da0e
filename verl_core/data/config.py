"""The ``data`` section of :class:`~verl_core.config.RunConfig`: where prompts come from and how
they are batched, beside the datasets, the synthetic task and the sampler it configures.
Composed into the run, checked against the other sections and hashed in ``verl_core/config.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from verl_core.config_fields import (_check_types, _fail, _non_negative, _one_of, _positive,
                                     in_trajectory, not_in_trajectory)

if TYPE_CHECKING:
    from verl_core.config import RunConfig


def _dynamic_sampling(run: RunConfig) -> bool:
    """``data.gen_batch_size`` is read only by DAPO's dynamic sampling: without it the run hashes
    as before the field existed."""
    return run.algorithm.filter_groups_enable


def _truncating(run: RunConfig) -> bool:
    """``data.truncation`` at ``error`` (the default): the run hashes as before the field existed."""
    return run.data.truncation != "error"


TRUNCATIONS = ("error", "left", "right", "middle")
"""verl's ``data.truncation`` values (``RLHFDataset``)."""


def _assets_set(run: RunConfig) -> bool:
    """``data.assets_id`` unset: the run hashes as before the field existed."""
    return bool(run.data.assets_id)


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are batched."""

    train_files: str = in_trajectory("")
    """Comma-separated parquet files/URIs in verl's row layout. Empty: generate the synthetic task."""
    val_files: str = in_trajectory("")
    """Comma-separated held-out parquet files/URIs. Empty: the synthetic task's held-out split."""
    train_batch_size: int = in_trajectory(64)
    """B: prompts per RL step (each is sampled ``rollout.n`` times). The demo's 64 (not 32)
    halves the variance of each policy-gradient step; with 32, held-out accuracy wandered by
    +-0.05 between evaluations and seed 2 ended 0.02 below its start (BENCHMARKS.md "Accuracy")."""
    gen_batch_size: int = in_trajectory(0, when=_dynamic_sampling)
    """Prompts per generation batch of DAPO's dynamic sampling (verl's ``data.gen_batch_size``;
    read with ``algorithm.filter_groups_enable``): a step samples such batches, in the order of
    the shuffled epochs, until ``train_batch_size`` groups are kept. 0: ``train_batch_size``."""
    val_batch_size: int = not_in_trajectory(256)
    """Prompts per greedy-evaluation forward pass (memory only; does not change results)."""
    val_max_samples: int = not_in_trajectory(-1)
    """Evaluate on at most this many held-out prompts (verl's ``data.val_max_samples``; -1: all):
    the same seeded subset (``run.seed``) at every evaluation, so evaluations stay comparable.
    A model you bring evaluates on 64 unless you set it (``config.USER_MODEL_EVAL``): a full
    GSM8K test split at verl's response length costs more CPU time than the training."""
    max_prompt_length: int = in_trajectory(64)
    """Most prompt tokens. A longer prompt fails validation naming its row, unless
    ``truncation`` says how to cut it."""
    truncation: str = in_trajectory("error", when=_truncating)
    """What a prompt over ``max_prompt_length`` tokens gets, as verl's ``data.truncation``:
    ``error`` (refused before any work, naming its file and row), ``left`` (its last
    ``max_prompt_length`` tokens are kept: the end of a chat, where the question and the
    assistant header are), ``right`` (its first) or ``middle`` (the first half and the last
    half). Cutting is for datasets whose long prompts are long context: cutting the question of
    a verifiable task makes its ground truth wrong."""
    shuffle: bool = in_trajectory(True)
    """Shuffle the training prompts each epoch (seeded by ``run.seed``)."""
    synthetic_task: str = in_trajectory("arithmetic")
    """Synthetic verifiable task generated when ``train_files`` is empty: ``arithmetic``
    (``12+7=``, answered at once), ``calculator`` (3-4 digit sums and products, with the
    built-in calculator tool in multi-turn rollouts; the presets then set
    :data:`~verl_core.config.CALCULATOR_DEFAULTS`), ``guess`` (a guessing game against the
    built-in scripted user, ``builtin:guess``: :data:`~verl_core.config.GUESS_DEFAULTS`) or
    ``word_problems`` (GSM8K-style word problems of 1-3 steps in verl's GSM8K layout, scored by verl's ``gsm8k`` scorer: for a real
    pretrained model, ``data/word_problems.py``) or ``code`` (small Python functions with hidden
    ``assert`` tests, scored by running the response in a sandbox: ``data/code_task.py``,
    ``reward/code.py``; the tiny model then starts untrained:
    :data:`~verl_core.config.CODE_DEFAULTS`)."""
    synthetic_train_size: int = in_trajectory(3000)
    """Rows in the generated training split."""
    synthetic_val_size: int = in_trajectory(500)
    """Rows in the generated held-out split (disjoint from training). 500 makes the standard
    error of one accuracy <= 0.022 (sqrt(0.25 / 500)), of a gain <= 0.032."""
    synthetic_max_operand: int = in_trajectory(50)
    """Largest operand of the generated arithmetic problems."""
    assets_id: str = in_trajectory("", when=_assets_set)
    """Empty: a run trains on the files it recorded when it first ran (a dataset or model file
    changed since is refused at resume, naming it). An asset index id (the refusal prints it):
    train on the files as they are now, as a new trajectory of the run (from step 0)."""

    def __post_init__(self):
        _check_types("data", self)
        _non_negative("data", self, "gen_batch_size")
        if self.val_max_samples == 0 or self.val_max_samples < -1:
            _fail("data", "val_max_samples", self.val_max_samples,
                  "must be -1 (every held-out prompt) or a positive count")
        _positive("data", self, "train_batch_size", "val_batch_size", "max_prompt_length",
                  "synthetic_train_size", "synthetic_val_size", "synthetic_max_operand")
        _one_of("data", "synthetic_task", self.synthetic_task,
                {"arithmetic", "calculator", "guess", "word_problems", "code"})
        _one_of("data", "truncation", self.truncation, set(TRUNCATIONS))
        m = self.synthetic_max_operand
        unique = (m + 1) ** 2 + (m + 1) * (m + 2) // 2  # a+b, and a-b with a >= b
        if (not self.train_files and self.synthetic_task == "arithmetic"
                and self.synthetic_train_size + self.synthetic_val_size > unique):
            _fail("data", "synthetic_train_size", self.synthetic_train_size,
                  f"+ synthetic_val_size={self.synthetic_val_size} exceeds the {unique} unique "
                  f"problems with synthetic_max_operand={m}; raise synthetic_max_operand")
        if bool(self.train_files) != bool(self.val_files) and not self.train_files:
            _fail("data", "train_files", self.train_files,
                  "val_files is set but train_files is empty; give both or neither")

    @property
    def gen_batch_prompts(self) -> int:
        """Prompts per generation batch of dynamic sampling (``gen_batch_size`` or B)."""
        return self.gen_batch_size or self.train_batch_size

    @property
    def train_file_list(self) -> list[str]:
        return [f.strip() for f in self.train_files.split(",") if f.strip()]

    @property
    def val_file_list(self) -> list[str]:
        return [f.strip() for f in self.val_files.split(",") if f.strip()]
