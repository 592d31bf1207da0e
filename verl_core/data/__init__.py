"""Prompt data: verl-layout parquet datasets, synthetic verifiable tasks, a resumable sampler.

``dataset.py`` reads and validates files into :class:`PromptRow` records; ``synthetic.py`` writes
the arithmetic task in the same layout; ``sampler.py`` picks the B prompt indices of each step;
``batch.py`` holds the per-response frames that cross phase boundaries.
"""

from verl_core.data.dataset import DatasetError, PromptRow, load_prompt_rows, render_prompt
from verl_core.data.sampler import ResumableSampler
from verl_core.data.synthetic import arithmetic_problems, write_arithmetic_dataset

__all__ = ["DatasetError", "PromptRow", "load_prompt_rows", "render_prompt", "ResumableSampler",
           "arithmetic_problems", "write_arithmetic_dataset"]
