"""The ``model`` section of :class:`~verl_core.config.RunConfig`: the policy model (a folder you
bring, or the tiny model and its supervised warm start) and its compute dtype, beside the
loading and the tiny-model factory. Composed into the run, checked against the other sections and
hashed in ``verl_core/config.py``.
"""

from __future__ import annotations

import json

from dataclasses import dataclass

from verl_core.config_fields import (_check_types, _fail, _non_negative, _one_of, _positive,
                                     in_trajectory)


def _calculator_task(run) -> bool:
    """The calculator task's warm start reads ``warmup_tool_fraction``; elsewhere it does
    nothing, and the run hashes as before it existed."""
    return not run.data.train_files and run.data.synthetic_task == "calculator"


def _format_warmup_on(run) -> bool:
    """``model.format_warmup_steps`` 0: the format warm start's fields do nothing, and the run
    hashes as before they existed."""
    return run.model.format_warmup_steps > 0


def _lora_on(run) -> bool:
    """``model.lora_rank`` 0: the other LoRA fields do nothing, and the run hashes as before
    they existed."""
    return run.model.lora_rank > 0


def _override_on(run) -> bool:
    """``model.override_config`` empty: the run hashes as before the field existed."""
    return bool(run.model.override_config)


@dataclass(frozen=True)
class ModelConfig:
    """The policy (and reference/critic initialisation)."""

    path: str = in_trajectory("")
    """A local Hugging Face folder (config.json, safetensors, tokenizer.json). Empty: build the
    tiny model and warm-start it on the synthetic task."""
    tiny_hidden_size: int = in_trajectory(64)
    """Hidden size of the tiny Llama-style model built when ``path`` is empty."""
    tiny_layers: int = in_trajectory(2)
    """Decoder layers of the tiny model."""
    tiny_heads: int = in_trajectory(2)
    """Attention heads of the tiny model: 2 gives a head size of 32 at the default hidden size,
    the smallest vLLM's CPU attention kernel runs (it takes 32, 64, 80 and up)."""
    warmup_sft_steps: int = in_trajectory(2000)
    """Most supervised warm-start steps on the synthetic task (only when ``path`` is empty)."""
    warmup_target_accuracy: float = in_trajectory(0.25)
    """The warm start stops once greedy accuracy on a slice of the *training* split reaches this,
    so RL starts from partial accuracy: not zero (no reward signal), not full (nothing to learn).
    1.0 disables the early stop. The held-out split is never looked at. The demo's 0.25 (held-out
    0.16-0.26) leaves RL room to add what the warm start did not."""
    warmup_sft_lr: float = in_trajectory(3e-3)
    """Learning rate of the supervised warm start."""
    warmup_sft_batch_size: int = in_trajectory(64)
    """Batch size of the supervised warm start."""
    warmup_mixed_steps: int = in_trajectory(40, when=_calculator_task)
    """The calculator task's warm start runs in two parts: ``warmup_sft_steps`` steps on
    transcripts that all call the tool (the call, then the tool's answer copied), then this many
    on transcripts of which ``warmup_tool_fraction`` call it and the rest answer at once (the
    true answer, which the tiny model cannot compute). Copying is learnt abruptly (0 -> 100% of
    held-out calls between steps 300 and 350 with one seed, 400-600 with another) and only when
    every transcript teaches it; the short mixed part then makes calling rare: the model can use
    the tool but seldom does, RL has to find that it pays, and ``tool_calls/mean`` shows it."""
    warmup_tool_fraction: float = in_trajectory(0.1, when=_calculator_task)
    """The share of the mixed part's transcripts that call the tool (``warmup_mixed_steps``).
    At 0.1 (the demo's seed) the warm-started model does not call when greedy and calls in ~3%
    of its samples at the demo's temperature (``tool_calls/mean`` 0.029 at step 1)."""
    override_config: str = in_trajectory("", when=_override_on)
    """Fields of the model's ``config.json`` to replace, as a JSON object (verl's
    ``actor_rollout_ref.model.override_config``), e.g. ``{"attention_dropout": 0.0}``: the run
    trains, samples, evaluates and exports a copy of the folder whose config.json has them (the
    weights are the same files). Each must name a field the config has (a typo is refused at
    prepare, naming the fields). Empty: the folder as it is."""
    format_warmup_steps: int = in_trajectory(0, when=_format_warmup_on)
    """A model you bring (``path``): this many supervised steps on the training rows' worked
    solutions (``extra_info.answer``: verl's gsm8k preprocessing keeps GSM8K's solution there, and
    ``data.synthetic_task=word_problems`` writes one) before RL. It teaches the answer format a
    strict scorer reads (``#### N``), which a small instruct model never writes on its own: then
    GRPO's groups have reward variance to learn from (``docs/models.md``, the recipe). The
    held-out split is never looked at. Durable like the tiny model's warm start: saved in the run
    store and on Ctrl-C, reused by any run with the same inputs. 0: none (verl's behaviour)."""
    format_warmup_lr: float = in_trajectory(2e-5, when=_format_warmup_on)
    """Learning rate of the format warm start (AdamW, 10 warm-up steps, then constant)."""
    format_warmup_batch_size: int = in_trajectory(8, when=_format_warmup_on)
    """Rows per step of the format warm start."""
    dtype: str = in_trajectory("float32")
    """Compute dtype for training: float32, or bfloat16 (bf16 matmuls over float32 master weights
    and float32 AdamW state, as verl's FSDP mixed precision; the reference model and the rollout
    copy are held in bf16). A bf16 checkpoint is still loaded into float32 masters."""
    gradient_checkpointing: bool = in_trajectory(False)
    """Recompute activations in backward to save memory (large models)."""
    lora_rank: int = in_trajectory(0, when=_lora_on)
    """LoRA adapters of this rank on the policy (verl's ``actor_rollout_ref.model.lora_rank``;
    0: full fine-tuning). Trained with PEFT (``verl_core/models/lora.py``): the base weights are
    frozen, the reference model is the policy with its adapters off, checkpoints hold the
    adapters and their optimizer state (the frozen base once per run), ``docs/lora.md``."""
    lora_alpha: float = in_trajectory(16.0, when=_lora_on)
    """LoRA's scale numerator: adapters add ``lora_alpha / lora_rank`` x B A (verl's
    ``lora_alpha``)."""
    target_modules: str = in_trajectory("all-linear", when=_lora_on)
    """The modules that get adapters: ``all-linear`` (every linear layer but the output head),
    or comma-separated module names or name suffixes (``q_proj,v_proj``; verl's list)."""
    exclude_modules: str = in_trajectory("", when=_lora_on)
    """Comma-separated module names or suffixes to leave without adapters (verl's
    ``exclude_modules``)."""
    lora_adapter_path: str = in_trajectory("", when=_lora_on)
    """Start from this PEFT adapter folder (``adapter_config.json`` +
    ``adapter_model.safetensors``) instead of fresh adapters; its rank, alpha and targets are
    the adapter's own and must match ``lora_rank`` (verl's ``lora_adapter_path``)."""

    @property
    def config_overrides(self) -> dict:
        """``override_config`` parsed: {field: value} (checked to be a JSON object)."""
        if not self.override_config:
            return {}
        try:
            value = json.loads(self.override_config)
        except json.JSONDecodeError as e:
            _fail("model", "override_config", self.override_config,
                  f"is not JSON ({e}); give an object, e.g. '{{\"attention_dropout\": 0.0}}'")
        if not isinstance(value, dict):
            _fail("model", "override_config", self.override_config,
                  "must be a JSON object of config.json fields")
        return value

    def __post_init__(self):
        _check_types("model", self)
        _positive("model", self, "tiny_hidden_size", "tiny_layers", "tiny_heads",
                  "warmup_sft_batch_size")
        _non_negative("model", self, "warmup_sft_steps", "warmup_mixed_steps")
        _positive("model", self, "warmup_sft_lr", "format_warmup_lr", "format_warmup_batch_size")
        _non_negative("model", self, "format_warmup_steps")
        if self.override_config:
            overrides = self.config_overrides
            if not self.path:
                _fail("model", "override_config", self.override_config,
                      "is for a model you bring (set model.path); the tiny model's config is "
                      "model.tiny_*")
            if not overrides:
                _fail("model", "override_config", self.override_config,
                      "give at least one field, or leave it empty")
        if self.format_warmup_steps and not self.path:
            _fail("model", "format_warmup_steps", self.format_warmup_steps,
                  "is for a model you bring (set model.path); the tiny model has its own warm "
                  "start (model.warmup_sft_steps)")
        if not 0.0 <= self.warmup_tool_fraction <= 1.0:
            _fail("model", "warmup_tool_fraction", self.warmup_tool_fraction, "must be in [0, 1]")
        if not 0.0 < self.warmup_target_accuracy <= 1.0:
            _fail("model", "warmup_target_accuracy", self.warmup_target_accuracy,
                  "must be in (0, 1]")
        if self.tiny_hidden_size % self.tiny_heads:
            _fail("model", "tiny_hidden_size", self.tiny_hidden_size,
                  f"must be divisible by model.tiny_heads={self.tiny_heads}")
        _one_of("model", "dtype", self.dtype, {"float32", "bfloat16"})
        if self.lora_rank < 0:
            _fail("model", "lora_rank", self.lora_rank, "must be >= 0 (0: full fine-tuning)")
        if self.lora_rank:
            _positive("model", self, "lora_alpha")
            if not self.target_modules.strip():
                _fail("model", "target_modules", self.target_modules,
                      "name the modules to adapt, or all-linear")
