"""vLLM serves the HF export of a checkpoint: same greedy tokens and log-probs as the training model.

Needs the vllm package: vLLM's CPU backend (``.venv-vllm``, ``bash .ci/install vllm``) or CUDA
vLLM (``pip install '.[vllm]'`` on a GPU machine); skipped otherwise.
"""

from __future__ import annotations

import pytest
import torch

from verl_core.checkpoint import export_hf, store_tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_vllm_loads_the_export_and_matches_the_training_model(manager, store, word_tokenizer,
                                                              tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm import LLM, SamplingParams

    from verl_core.rollout.vllm import memory_kwargs, on_cpu_backend

    # head_dim 64: a size every vLLM attention backend supports
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                      max_position_embeddings=256, bos_token_id=2, eos_token_id=3,
                      pad_token_id=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    store_tokenizer(store, word_tokenizer())
    info = manager.save(1, {"policy": model.state_dict()}, {"hf_config": model.config.to_dict()})
    out = tmp_path / "hf"
    export_hf(manager, info.name, str(out))

    prompts = [[2, 10, 11, 12], [2, 40, 41], [2, 7, 8, 9, 100, 101]]
    new_tokens = 8
    llm = LLM(model=str(out), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
              **memory_kwargs(gpu_memory_utilization=0.3, cpu_kv_cache_gib=0.25))
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=0,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    device = "cpu" if on_cpu_backend() else "cuda"
    model = model.to(device)
    for prompt, o in zip(prompts, outs):
        got = list(o.outputs[0].token_ids)
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            want = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                  min_new_tokens=new_tokens, pad_token_id=1)[0, len(prompt):]
            logp = torch.log_softmax(model(torch.tensor([prompt + got], device=device)).logits
                                     .float(), -1)[0, len(prompt) - 1:-1]
        assert got == want.tolist(), (prompt, got, want.tolist())
        hf_lp = logp.gather(-1, torch.tensor(got, device=device)[:, None])[:, 0].tolist()
        vllm_lp = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, got)]
        assert vllm_lp == pytest.approx(hf_lp, abs=2e-3), (prompt, vllm_lp, hf_lp)
