"""Where the trainer computes (``trainer.device``, ``verl_core/training/device.py``).

The host-side half runs everywhere: the setting's values and refusals, ``Batch.to`` (checked by
moving a batch to the ``meta`` device, which needs no accelerator), and the CLI's refusal of
``trainer.device=cuda`` on a machine without a GPU. The ``gpu`` tests need CUDA (they skip
without it; ``bench/gpu_check.py`` runs them on a GPU machine): the tiny model's rollout and
forward on the GPU give the CPU's tokens and (up to float32 rounding) log-probs, an update's
gradients match the CPU's, two updates from the same state are bitwise equal with
``trainer.deterministic``, and a plain-loop run killed mid-update and started again ends with the
weights of an uninterrupted run on the GPU.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from verl_core.config import AlgorithmConfig, ConfigError, OptimConfig, TrainerConfig
from verl_core.data.batch import Batch
from verl_core.models import build_tiny_model
from verl_core.rollout import SamplingParams, make_engine
from verl_core.training import sharding
from verl_core.training.device import DeviceError, make_deterministic, resolve_device
from verl_core.training.forward import batched_logprobs
from verl_core.training.optim import make_optimizer, make_scheduler
from verl_core.training.ppo import UpdateOptions, ppo_update
from verl_core import verl_keys

REPO = pathlib.Path(__file__).resolve().parents[3]
HAS_CUDA = torch.cuda.is_available()


def _batch(model, tok, *, n_prompts=4, G=4, max_new_tokens=6, seed=0) -> Batch:
    enc = tok([f"{i}+{2 * i}=" for i in range(n_prompts)], return_tensors="pt", padding=True)
    ids = enc.input_ids.repeat_interleave(G, 0)
    mask = enc.attention_mask.repeat_interleave(G, 0)
    eng = make_engine("hf", model=model, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    out = eng.generate(ids, mask, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens,
                                                  seed=seed))
    N = ids.shape[0]
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(N, 1, generator=g).expand(N, out.response_ids.shape[1]) * out.response_mask
    return Batch(prompt_ids=ids, prompt_mask=mask, response_ids=out.response_ids,
                 response_mask=out.response_mask, response_logprobs=out.logprobs,
                 group=torch.arange(n_prompts).repeat_interleave(G),
                 uid=[str(i) for i in range(N)], ground_truth=["0"] * N, data_source=["s"] * N,
                 extra_info=[{}] * N, advantages=adv.contiguous())


# ------------------------------------------------------------------ host side: runs everywhere
def test_the_setting_takes_auto_cuda_cpu_and_names_the_others():
    assert TrainerConfig().device == "auto"
    assert TrainerConfig(device="cpu").device == "cpu"
    with pytest.raises(ConfigError, match="trainer.device"):
        TrainerConfig(device="gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    # verl's key: cuda (its YAML default, skipped as a default) needs a GPU; npu is refused
    assert verl_keys.VERL_TO_OURS["trainer.device"]("cuda", {}) == [("trainer.device", "cuda")]
    with pytest.raises(ConfigError, match="npu"):
        verl_keys.VERL_TO_OURS["trainer.device"]("npu", {})


@pytest.mark.skipif(HAS_CUDA, reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_naming_the_setting_and_the_way_out(tmp_path):
    with pytest.raises(DeviceError, match="trainer.device=cuda.*trainer.device=auto"):
        resolve_device("cuda")
    # the plain loop says it before any work: one line, exit 2, nothing written
    r = subprocess.run([sys.executable, "-m", "verl_core.train", "--steps", "1",
                        "--set", "trainer.device=cuda", "--workdir", str(tmp_path / "run")],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "trainer.device=cuda but this worker sees no GPU" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.safetensors"))


def test_batch_to_moves_every_tensor_and_nothing_else():
    model, tok = build_tiny_model(seed=0)
    batch = _batch(model, tok, n_prompts=2, G=2)
    assert batch.to(torch.device("cpu")) is batch  # already there: no copy
    moved = batch.to(torch.device("meta"))
    for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask",
                 "response_logprobs", "group", "advantages"):
        assert getattr(moved, name).device.type == "meta", name
        assert getattr(moved, name).shape == getattr(batch, name).shape
        assert getattr(batch, name).device.type == "cpu"  # the original stays on the host
    assert moved.uid == batch.uid and moved.meta == batch.meta and moved.score is None


# ------------------------------------------------------------------ on a GPU
gpu = pytest.mark.gpu


def _on(model, device):
    return copy.deepcopy(model).to(device)


@gpu
def test_rollout_on_the_gpu_samples_the_cpu_tokens_and_returns_host_tensors():
    """The draws are made on the host from the seed (rollout/hf.py), so the GPU samples the
    CPU's tokens unless a uniform falls within float32 rounding (~1e-6) of a CDF boundary."""
    model, tok = build_tiny_model(seed=0)
    cpu = _batch(model, tok, seed=3)
    dev = _batch(_on(model, "cuda"), tok, seed=3)
    assert dev.response_ids.device.type == "cpu"
    assert torch.equal(dev.response_ids, cpu.response_ids)
    # log-probs of ~5 nats through 2 float32 layers: agree to well under 1e-4
    torch.testing.assert_close(dev.response_logprobs, cpu.response_logprobs, atol=1e-4, rtol=0)


@gpu
def test_log_probs_and_update_gradients_on_the_gpu_match_the_cpu():
    model, tok = build_tiny_model(seed=0)
    batch = _batch(model, tok)
    gm = _on(model, "cuda")
    lp_cpu = batched_logprobs(model, batch, 1.0, 4)
    lp_gpu = batched_logprobs(gm, batch, 1.0, 4)
    assert lp_gpu.device.type == "cpu"  # results come back to the host, as stored batches are
    torch.testing.assert_close(lp_gpu, lp_cpu, atol=1e-4, rtol=0)

    def grads(m):  # SGD at lr 0: the weights stay, each step's gradient is read by a pre-hook
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        out = []
        opt.register_step_pre_hook(lambda *_: out.append(
            {n: p.grad.detach().cpu().clone() for n, p in m.named_parameters()}))
        metrics = ppo_update(m, opt, sched, batch,
                             UpdateOptions(algo=AlgorithmConfig(), temperature=1.0,
                                           mini_batch_rows=8, micro_batch_rows=4, epochs=1,
                                           grad_clip=1e9),
                             seed=0)
        return out, metrics

    g_cpu, m_cpu = grads(model)
    g_gpu, m_gpu = grads(gm)
    assert len(g_cpu) == len(g_gpu) == 2
    for a, b in zip(g_cpu, g_gpu):
        for name in a:
            scale = float(a[name].abs().max()) + 1e-12
            # float32 sums in another order: relative differences of ~1e-6 of the largest entry
            torch.testing.assert_close(b[name], a[name], atol=1e-4 * scale, rtol=0)
    assert m_gpu["actor/pg_loss"] == pytest.approx(m_cpu["actor/pg_loss"], abs=1e-5)


def _model(arch, tmp_path):
    if arch == "llama":
        return build_tiny_model(seed=0)
    from tests.standins import qwen_folder
    from verl_core.models import load_causal_lm, load_tokenizer

    folder = qwen_folder(tmp_path / "qwen")  # Qwen2.5's layout: GQA, biases, tied embeddings
    return load_causal_lm(str(folder), "float32"), load_tokenizer(str(folder))


@gpu
@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("llama", "bfloat16"),
                                        ("qwen2", "bfloat16")])
def test_two_deterministic_updates_from_the_same_state_are_bitwise_equal(arch, dtype, tmp_path):
    make_deterministic(resolve_device("cuda"), True)
    model, tok = _model(arch, tmp_path)
    batch = _batch(model, tok)

    def updated():
        m = _on(model, "cuda")
        compute = sharding.COMPUTE_DTYPES[dtype]
        if compute is not None:
            sharding.compute_in(m, compute)
        cfg = OptimConfig(lr=1e-3, warmup_steps=0)
        opt = make_optimizer(m.parameters(), cfg, cfg.lr)
        for step in range(2):
            ppo_update(m, opt, make_scheduler(opt, cfg, 10), batch,
                       UpdateOptions(algo=AlgorithmConfig(), temperature=1.0, mini_batch_rows=8,
                                     micro_batch_rows=4, epochs=1, grad_clip=1.0),
                       seed=step)
        return {k: v.detach().cpu() for k, v in m.state_dict().items()}

    a, b = updated(), updated()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], model.state_dict()[k]) for k in a)  # it did train


def _export_digest(workdir: pathlib.Path) -> str:
    files = sorted(workdir.glob("exports/*/model.safetensors"))
    assert len(files) == 1, files
    return hashlib.sha256(files[0].read_bytes()).hexdigest()


@gpu
def test_a_run_killed_mid_update_on_the_gpu_resumes_to_the_uninterrupted_weights(tmp_path):
    """The plain loop on the GPU: SIGKILLed inside step 3's update (VERL_FAULTS), the same command
    again ends with the exported weights of a run that was never interrupted."""
    cmd = [sys.executable, "-m", "verl_core.train", "--steps", "4",
           "--set", "trainer.device=cuda", "--set", "validation.mode='off'"]
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FAULTS", "VERL_FAULTS_DIR")}

    def run(workdir, extra_env=None):
        return subprocess.run(cmd + ["--workdir", str(workdir)], cwd=REPO,
                              env={**env, **(extra_env or {})}, capture_output=True, text=True,
                              timeout=1200)

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "[verl] device: cuda" in whole.stdout, whole.stdout[:2000]
    faults = {"VERL_FAULTS": json.dumps([{"phase": "update", "step": 3, "kind": "kill"}]),
              "VERL_FAULTS_DIR": str(tmp_path / "faults")}
    killed = run(tmp_path / "resumed", faults)
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])
    resumed = run(tmp_path / "resumed", faults)  # the fault fired once: it does not again
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _export_digest(tmp_path / "resumed") == _export_digest(tmp_path / "whole")
    import pandas as pd

    metrics = pd.read_parquet(next((tmp_path / "whole").glob("metrics/*.parquet")))
    assert (metrics["perf/max_memory_allocated_gb"].dropna() > 0).all()
