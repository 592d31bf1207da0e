"""The ``vllm`` engine's pure side (runs without vLLM): the clear error without vllm, the config and
verl keys that select it, its pure helpers (prompt unpadding, per-row seeds, output assembly),
and the trainer pushing weights to an engine that owns its own copy after an update. The engine
itself runs in test_vllm_engine.py (``-m vllm``: vLLM's CPU backend in .venv-vllm, or CUDA)."""
import copy
import sys

import pytest
import torch

from tests.presets import tiny_run
from verl_core.config import ConfigError, RolloutConfig, preset
from verl_core.models import build_tiny_model
from verl_core.rollout import SamplingParams, make_engine
from verl_core.rollout.hf import HFEngine
from verl_core.rollout.vllm import (VLLMUnavailableError, filters_tokens, row_seeds_of,
                                    to_generation_output, unpad_prompts)
from verl_core.verl_keys import to_ours


def test_make_engine_without_cuda_or_vllm_names_the_field_and_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    with pytest.raises(VLLMUnavailableError) as e:
        make_engine("vllm", model_path="/nonexistent", eos_token_id=2, pad_token_id=0)
    msg = str(e.value)
    assert "rollout.engine='vllm'" in msg and "pip install -e '.[vllm]'" in msg, msg
    assert "CUDA" in msg and "vllm package" in msg and "rollout.engine='hf'" in msg, msg


def test_config_accepts_vllm_and_its_fields():
    cfg = preset("grpo", **{"rollout.engine": "vllm", "rollout.enforce_eager": False,
                            "rollout.free_cache_engine": False})
    assert (cfg.rollout.engine, cfg.rollout.enforce_eager, cfg.rollout.free_cache_engine) == \
        ("vllm", False, False)
    d = RolloutConfig()
    assert (d.gpu_memory_utilization, d.enforce_eager, d.free_cache_engine) == (0.5, True, True)
    with pytest.raises(ConfigError, match=r"rollout\.engine='sglang'.*hf, vllm"):
        RolloutConfig(engine="sglang")
    # vLLM refuses temperatures above 2: refused here, before any work, naming the field
    with pytest.raises(ConfigError, match=r"rollout\.temperature=2\.5.*\[0, 2\]"):
        RolloutConfig(engine="vllm", temperature=2.5)
    RolloutConfig(engine="hf", temperature=2.5)  # the hf engine has no such limit
    # vLLM's CPU KV cache is sized by the config (never by the machine's RAM): positive GiB
    assert d.cpu_kv_cache_gib == 0.5
    with pytest.raises(ConfigError, match=r"rollout\.cpu_kv_cache_gib=0\b.*> 0"):
        RolloutConfig(cpu_kv_cache_gib=0)


def test_verl_rollout_keys_map_to_ours():
    assert to_ours({"actor_rollout_ref.rollout.name": "vllm",
                    "actor_rollout_ref.rollout.enforce_eager": False,
                    "actor_rollout_ref.rollout.free_cache_engine": False,
                    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.4}) == {
        "rollout.engine": "vllm", "rollout.enforce_eager": False,
        "rollout.free_cache_engine": False, "rollout.gpu_memory_utilization": 0.4}


def test_unpad_prompts_drops_left_padding():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]])
    mask = (ids != 0).long()
    assert unpad_prompts(ids, mask) == [[5, 6], [7, 8, 9, 10], [11]]
    with pytest.raises(ValueError, match="prompt row 1 has no tokens"):
        unpad_prompts(ids[:2], torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]]))


def test_row_seeds_depend_on_the_global_row_only():
    whole = row_seeds_of(7, 0, 10)
    # worker blocks (rows 0-3, 4-6, 7-9) get the seeds the whole batch gives those rows
    assert row_seeds_of(7, 0, 4) + row_seeds_of(7, 4, 3) + row_seeds_of(7, 7, 3) == whole
    assert len(set(whole)) == 10 and all(0 <= s < 2**63 for s in whole)
    assert set(row_seeds_of(8, 0, 10)).isdisjoint(whole)


def test_output_is_right_padded_with_eos_in_the_mask():
    # row 0 stopped on EOS (id 2) after 2 tokens, row 1 ran to the 3-token limit
    out = to_generation_output([[9, 2], [4, 5, 6]], [[-0.5, -1.0], [-0.1, -0.2, -0.3]], pad_id=0)
    assert out.response_ids.tolist() == [[9, 2, 0], [4, 5, 6]]
    assert out.response_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    assert out.logprobs.dtype == torch.float32 and out.response_mask.dtype == torch.float32
    assert torch.allclose(out.logprobs, torch.tensor([[-0.5, -1.0, 0.0], [-0.1, -0.2, -0.3]]))
    with pytest.raises(ValueError, match="row 0: 2 tokens but 1 log-probs"):
        to_generation_output([[9, 2]], [[-0.5]], pad_id=0)


def test_vllm_logprobs_need_a_recompute_only_under_top_k_or_top_p():
    assert not filters_tokens(SamplingParams(temperature=0.7))
    assert not filters_tokens(SamplingParams(temperature=0.0, top_p=0.5, top_k=3))  # greedy
    assert filters_tokens(SamplingParams(temperature=1.0, top_p=0.9))
    assert filters_tokens(SamplingParams(temperature=1.0, top_k=5))


class _OwnCopyEngine(HFEngine):
    """The hf engine on its own deep copy of the model: an engine that owns its weights, as
    vllm does, so the trainer must refresh it through load_weights."""

    owns_weights = True

    def __init__(self, model, **kw):
        super().__init__(copy.deepcopy(model), **kw)


def test_trainer_refreshes_an_engine_that_owns_its_weights_after_an_update(tmp_path):
    from verl_core.trainer import RLTrainer
    from verl_core.assets import prepare_assets

    cfg = tiny_run(**{"model.warmup_sft_steps": 2, "data.synthetic_train_size": 32,
                      "data.synthetic_val_size": 4, "data.train_batch_size": 2, "rollout.n": 2,
                      "actor.ppo_mini_batch_size": 2, "actor.ppo_micro_batch_size": 4,
                      "optim.lr": 1e-2,
                      # a gradient even when every reward ties (GRPO advantages all 0)
                      "algorithm.entropy_coeff": 0.01})
    assets = prepare_assets(cfg, str(tmp_path), log=lambda *_: None)
    trainer = RLTrainer(cfg, assets)
    try:
        tok = trainer.tokenizer
        trainer.behaviour.engine = _OwnCopyEngine(
            trainer.behaviour.model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)

        def same_as_actor():
            own = trainer.behaviour.engine.model.state_dict()
            return all(torch.equal(v, own[k]) for k, v in trainer.actor.model.state_dict().items())

        batch, _ = trainer.rollout(step=0)
        batch, _ = trainer.reward(batch)
        batch, _ = trainer.advantage(batch)
        trainer.update(batch, step=0)
        assert not same_as_actor()  # the update changed the actor, not the engine's copy
        trainer.rollout(step=1)  # the rollout first hands the new weights to the engine
        assert same_as_actor()
    finally:
        trainer.close()


def test_the_hf_engine_samples_from_the_model_it_was_given():
    model, tok = build_tiny_model(seed=0)
    eng = make_engine("hf", model=model, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, gpu_memory_utilization=0.3, dtype="float32")
    assert eng.owns_weights is False and eng.model is model
