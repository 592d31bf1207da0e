"""Prompt data: verl-layout parquet datasets, synthetic verifiable tasks, a resumable sampler.

``dataset.py`` reads and validates files into :class:`PromptRow` records; ``synthetic.py`` writes
the arithmetic task in the same layout; ``prompts.py`` loads rows for a tokenizer (length-checked)
and encodes them; ``sampler.py`` picks the B prompt indices of each step;
``batch.py`` holds the per-response frames that cross phase boundaries.
"""

from verl_core.lazy import exports

# imported on first use (verl_core/lazy.py): the run's config reads data/config.py without paying
# for pyarrow
__all__, __getattr__ = exports(__name__, {
    "verl_core.data.dataset": ("DatasetError", "PromptRow", "load_prompt_rows", "render_prompt"),
    "verl_core.data.sampler": ("ResumableSampler",),
    "verl_core.data.synthetic": ("arithmetic_problems", "write_arithmetic_dataset"),
})
