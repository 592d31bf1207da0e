"""The tiny run the end-to-end tests start from, written once: the built-in demo model warm-started
for a few steps on a small synthetic set, a batch of a few prompts, one thread. A test passes the
values it differs in (and the ones it is about, such as ``total_steps``) explicitly."""
from verl_core.config import RunConfig, preset

TINY: dict[str, object] = {
    "model.warmup_sft_steps": 5, "model.warmup_target_accuracy": 1.0,
    "data.synthetic_train_size": 64, "data.synthetic_val_size": 8,
    # 8 prompts x 4 samples = 32 rows: mini-batches of 4 prompts (16 rows), micro-batches of 8 rows
    "data.train_batch_size": 8, "rollout.n": 4,
    "actor.ppo_mini_batch_size": 4, "actor.ppo_micro_batch_size": 8,
    "num_threads": 1,  # a 2-core CI machine runs several of these at once
}
"""Dotted keys, as ``--set`` takes them (``tests/workflows`` drive ``pyflyte`` with their own)."""


def tiny_run(algorithm: str = "grpo", **overrides) -> RunConfig:
    """``preset(algorithm)`` at :data:`TINY`'s sizes; ``overrides`` (dotted keys) win."""
    return preset(algorithm, **{**TINY, **overrides})


def has_avx512() -> bool:
    """Whether this CPU has AVX-512 (test_resume's vLLM SIGKILL test, which once failed on an
    AVX2-only machine, skips without it; issue 40's note of 2026-12-04 night)."""
    try:
        return "avx512f" in open("/proc/cpuinfo").read()
    except OSError:
        return True
