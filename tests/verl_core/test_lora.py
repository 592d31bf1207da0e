"""LoRA RL with PEFT (issue 28), on the tiny model: the keys, the refusals before any work, the
reference model as the policy with its adapters off, adapter-only checkpoints over a base stored
once, the exports (PEFT adapter folder and merged model) and a SIGKILL resume. Real runs of the
plain loop (the workflow's phases), nothing mocked."""
import glob
import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.crash import kill_then_resume, train_command
from tests.presets import TINY, tiny_run
from verl_core.models.lora import LoRAConfigError
from verl_core.train import train
from verl_core.trainer import RLTrainer
from verl_core.assets import prepare_assets
from verl_core.verl_keys import to_ours

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
LORA = {**TINY, "model.warmup_sft_steps": 400, "model.warmup_target_accuracy": 0.2,
        "model.lora_rank": 4, "model.lora_alpha": 8.0, "algorithm.use_kl_loss": True,
        "algorithm.kl_loss_coef": 0.1, "total_steps": 3, "checkpoint.checkpoint_interval": 1,
        "val_before_train": False}


def test_verls_lora_keys_map_and_bad_values_are_refused():
    got = to_ours({"actor_rollout_ref.model.lora_rank": 8,
                     "actor_rollout_ref.model.lora_alpha": 32,
                     "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
                     "actor_rollout_ref.model.exclude_modules": None})
    assert got["model.lora_rank"] == 8 and got["model.lora_alpha"] == 32.0
    assert got["model.target_modules"] == "q_proj,v_proj"
    assert "model.exclude_modules" not in got
    with pytest.raises(ValueError, match=r"model.lora_rank=-1: must be >= 0"):
        tiny_run(**{"model.lora_rank": -1})
    # rank 0 (off): the LoRA fields change nothing, and the run hashes as before they existed
    assert tiny_run(**{"model.lora_alpha": 99.0}).trajectory_hash() == tiny_run().trajectory_hash()


@pytest.mark.parametrize("over, match", [
    ({"model.target_modules": "q_proj,attn_out"},
     r"model.target_modules='q_proj,attn_out': \['attn_out'\] match no module.*q_proj"),
    ({"model.lora_adapter_path": "/nonexistent/adapter"},
     r"model.lora_adapter_path='/nonexistent/adapter': no adapter_config.json"),
])
def test_lora_settings_that_cannot_apply_are_refused_before_the_warm_start(tmp_path, over, match):
    cfg = tiny_run(**{**LORA, **over})
    work = tmp_path / "work"
    with pytest.raises(LoRAConfigError, match=match):
        prepare_assets(cfg, str(work), log=lambda *_: None)
    assert not (work / "model").exists()  # no warm start was paid for


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 3-step LoRA run with a KL loss (the plain loop), and its store."""
    work = tmp_path_factory.mktemp("lora")
    summary = train(tiny_run(**LORA), str(work / "store"), log=lambda *_: None)
    return summary, work


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The LoRA runs' assets (data, warm-started model), prepared once for the module."""
    return prepare_assets(tiny_run(**LORA), str(tmp_path_factory.mktemp("assets")),
                          log=lambda *_: None)


def _base_path(summary) -> str:
    with open(os.path.join(summary["final_model"], "adapter", "adapter_config.json")) as f:
        return json.load(f)["base_model_name_or_path"]


def test_only_the_adapted_layers_change_and_the_reference_is_the_base(run):
    summary, _ = run
    final = load_file(os.path.join(summary["final_model"], "model.safetensors"))
    base = load_file(os.path.join(_base_path(summary), "model.safetensors"))
    assert final.keys() == base.keys()
    changed = {k for k in final if not torch.equal(final[k], base[k])}
    linear = {k for k in final if k.endswith("proj.weight")}  # all-linear: every projection
    assert changed and changed <= linear
    assert all(torch.equal(final[k], base[k]) for k in final if "norm" in k or "embed" in k)
    # the KL loss was on, against the base (0 until the first optimizer step moves B off 0):
    # it grew as the adapters moved
    kls = [h["actor/kl_loss"] for h in summary["history"]]
    assert 0 <= kls[0] < kls[-1]


def test_the_reference_log_probs_are_the_base_models(assets):
    cfg = tiny_run(**LORA)
    trainer = RLTrainer(cfg, assets)
    try:
        assert trainer.actor.ref is None  # no second copy of the base
        with torch.no_grad():  # move the adapters off zero: policy != base
            for n, p in trainer.actor.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        trainer.behaviour.actor_changed()
        batch, _ = trainer.rollout(1)
        plain = RLTrainer(tiny_run(**{**LORA, "model.lora_rank": 0}), assets)
        try:
            from verl_core.training.forward import batched_logprobs
            base = batched_logprobs(plain.actor.ref, batch, cfg.rollout.temperature, 8)
        finally:
            plain.close()
        m = batch.response_mask.bool()
        # the same float32 forward of the same weights: PEFT's disabled adapter runs the base
        # layer alone
        assert torch.equal(batch.ref_logprobs[m], base[m])
        assert not torch.equal(batch.response_logprobs[m], base[m])  # the policy is not the base
    finally:
        trainer.close()


def _objects(store: str, manifest: dict, group: str) -> set[str]:
    return {c["sha"] for t in manifest["groups"][group]["tensors"].values() for c in t["chunks"]}


def test_checkpoints_hold_the_adapters_and_the_base_once(run):
    summary, work = run
    manifests = []
    for path in sorted(glob.glob(str(work / "store" / "checkpoints" / "*.json"))):
        with open(path) as f:
            manifests.append(json.load(f))
    assert len(manifests) >= 2
    for m in manifests:
        assert "reference" not in m["groups"]  # the base with adapters off is the reference
        policy = m["groups"]["policy"]["tensors"]
        assert policy and all(".lora_" in k for k in policy)
        assert m["groups"]["base"]["shared"]
        assert all(".lora_" not in k for k in m["groups"]["base"]["tensors"])
    first, last = manifests[0], manifests[-1]
    assert _objects("", first, "base") == _objects("", last, "base")  # stored once
    assert not _objects("", first, "policy") & _objects("", last, "policy")  # trained


def test_the_exports_load_with_peft_and_give_the_trained_model(run, tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    summary, work = run
    store = str(work / "store")
    for extra, out in (([], "adapter"), (["--merge"], "merged")):
        r = subprocess.run([sys.executable, "-m", "verl_core.checkpoint", "export", store,
                            "latest", str(tmp_path / out), *extra], cwd=REPO,
                           capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
        assert r.returncode == 0, r.stderr[-3000:]
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(
        os.listdir(tmp_path / "adapter"))
    base = _base_path(summary)
    ids = torch.tensor([[1, 5, 9, 14, 3, 7, 2]])

    def logits(model):
        with torch.no_grad():
            return model.double()(input_ids=ids).logits

    # in float64, x W + s (x A) B (PEFT) against x W' with W' = W + s B A merged in float32 and
    # stored so: each merged weight is off by at most 2^-24 of itself, so each logit by at most
    # n 2^-24 max|logit|, n the chained terms: 2 x layers x (hidden + intermediate)
    adapted = logits(peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base),
                                                    str(tmp_path / "adapter")))
    merged = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged"))
    final = logits(AutoModelForCausalLM.from_pretrained(summary["final_model"]))
    run_adapter = logits(peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base),
        os.path.join(summary["final_model"], "adapter")))
    plain = logits(AutoModelForCausalLM.from_pretrained(base))
    conf = AutoModelForCausalLM.from_pretrained(base).config
    n = 2 * conf.num_hidden_layers * (conf.hidden_size + conf.intermediate_size)
    bound = n * 2.0 ** -24 * adapted.abs().max().item()
    assert torch.equal(merged, final)  # the CLI's merge of the checkpoint = the run's export
    assert (merged - adapted).abs().max().item() <= bound
    assert (run_adapter - adapted).abs().max().item() < 1e-12  # the same adapter, both ways
    assert (adapted - plain).abs().max().item() > 1e-3  # the adapters did something


def test_a_run_starts_from_an_exported_adapter(run, assets, tmp_path):
    summary, _ = run
    adapter = os.path.join(summary["final_model"], "adapter")
    cfg = tiny_run(**{**LORA, "model.lora_adapter_path": adapter})
    trainer = RLTrainer(cfg, assets)
    try:
        got = {k.replace(".default.", "."): v for k, v in trainer.actor.model.state_dict().items()
               if ".lora_" in k}
        saved = load_file(os.path.join(adapter, "adapter_model.safetensors"))
        assert got.keys() == saved.keys()
        assert all(torch.equal(got[k], saved[k]) for k in saved)
    finally:
        trainer.close()
    wrong = tiny_run(**{**LORA, "model.lora_rank": 8, "model.lora_adapter_path": adapter})
    with pytest.raises(LoRAConfigError, match=r"an adapter of rank 4, but model.lora_rank=8"):
        prepare_assets(wrong, str(tmp_path / "w"), log=lambda *_: None)
    # a copy cut short: refused naming the key and the file, before the warm start
    import shutil
    cut = tmp_path / "cut"
    shutil.copytree(adapter, cut)
    data = (cut / "adapter_model.safetensors").read_bytes()
    (cut / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(LoRAConfigError, match=r"model.lora_adapter_path=.*cut.*adapter_model"
                       r"\.safetensors is not a readable safetensors file"):
        prepare_assets(tiny_run(**{**LORA, "model.lora_adapter_path": str(cut)}),
                       str(tmp_path / "c"), log=lambda *_: None)
    assert not (tmp_path / "c" / "model").exists()


def _sha256(folder: str) -> str:
    with open(os.path.join(folder, "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_a_sigkill_after_the_first_checkpoint_resumes_bit_identical(run, tmp_path):
    summary, _ = run
    work = tmp_path / "work"
    got = kill_then_resume(*train_command(work, LORA), work / "latest.json", tmp_path / "s.json")
    assert _sha256(got["final_model"]) == _sha256(summary["final_model"])
    a = load_file(os.path.join(got["final_model"], "adapter", "adapter_model.safetensors"))
    b = load_file(os.path.join(summary["final_model"], "adapter", "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.vllm
def test_on_vllm_the_rollout_samples_the_adapted_policy(assets):
    """``rollout.engine=vllm`` with LoRA: vLLM is loaded with the merged weights (W + s B A)
    when the adapters change. With adapters far from 0, the rollout's log-probs equal the
    trainer's (PEFT's forward) within the bound of the plain vLLM loop test (both float32
    forwards of the same function, the merge one more float32 rounding per weight: 1e-4 holds,
    ``test_the_plain_loop_trains_the_default_task_on_vllm``), and differ from the base's."""
    from verl_core.training.forward import batched_logprobs

    cfg = tiny_run(**{**LORA, "rollout.engine": "vllm"})
    trainer = RLTrainer(cfg, assets)
    try:
        assert type(trainer.behaviour.engine).__name__ == "VLLMEngine"
        with torch.no_grad():
            for n, p in trainer.actor.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        trainer.behaviour.actor_changed()
        batch, _ = trainer.rollout(1)
        m = batch.response_mask.bool()
        t = cfg.rollout.temperature
        policy = batched_logprobs(trainer.actor.model, batch, t, 8)
        assert (policy - batch.response_logprobs)[m].abs().max().item() <= 1e-4
        assert (batch.ref_logprobs - batch.response_logprobs)[m].abs().max().item() > 1e-2
    finally:
        trainer.close()


def test_an_adapter_of_another_base_model_is_refused_naming_its_shapes(tmp_path):
    import peft
    from verl_core.models import build_tiny_model

    other, _ = build_tiny_model(hidden_size=32, heads=2, layers=2, seed=0)
    peft.get_peft_model(other, peft.LoraConfig(r=4, target_modules="all-linear")).save_pretrained(
        tmp_path / "other")
    cfg = tiny_run(**{**LORA, "model.lora_adapter_path": str(tmp_path / "other")})
    with pytest.raises(LoRAConfigError, match=r"lora_A.weight has shape \[4, \d+\], but .* needs "
                       r"\[4, \d+\]: an adapter made for another base"):
        prepare_assets(cfg, str(tmp_path / "w"), log=lambda *_: None)
    assert not (tmp_path / "w" / "model").exists()


SCORE_BY_FIRST_CHARACTER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ord(solution_str[0]) % 2) if solution_str else 0.0
'''


@pytest.mark.slow
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_lora_trains_in_bf16_on_the_qwen_stand_in(tmp_path, checkpointing):
    """model.dtype=bfloat16 with LoRA: the rollout runs (it crashed at the first generate, PEFT
    casting lora_A's input to the float32 master), and an update moves the adapters, with
    gradient checkpointing too (a frozen base must not cut the adapters off from the loss)."""
    from tests.standins import gsm8k_parquet, qwen_folder
    from verl_core.train import main

    folder = qwen_folder(tmp_path / "qwen", dtype=torch.bfloat16)
    scorer = tmp_path / "score.py"
    scorer.write_text(SCORE_BY_FIRST_CHARACTER)
    out = tmp_path / "summary.json"
    A = "actor_rollout_ref.actor."
    argv = [f"actor_rollout_ref.model.path={folder}",
            f"data.train_files={gsm8k_parquet(tmp_path / 'train.parquet', 8)}",
            f"data.val_files={gsm8k_parquet(tmp_path / 'val.parquet', 2, split='test')}",
            "algorithm.adv_estimator=grpo", "data.train_batch_size=4", f"{A}ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=4", "data.max_prompt_length=256",
            "data.max_response_length=6", "trainer.total_training_steps=1",
            "trainer.val_before_train=False", "actor_rollout_ref.model.lora_rank=4",
            "actor_rollout_ref.model.lora_alpha=8", f"{A}optim.lr=1e-3", "model.dtype=bfloat16",
            f"actor_rollout_ref.model.enable_gradient_checkpointing={checkpointing}",
            f"custom_reward_function.path={scorer}", "--workdir", str(tmp_path / "run"),
            "--summary-json", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    (step,) = summary["history"]
    assert 0 < step["reward/mean"] < 1 and step["actor/grad_norm"] > 0, step
    adapter = load_file(os.path.join(summary["final_model"], "adapter",
                                     "adapter_model.safetensors"))
    b = [t for k, t in adapter.items() if "lora_B" in k]
    assert b and all(t.abs().sum() > 0 for t in b)  # every adapter moved off its zero start
