"""The warm start as a durable phase (verl_core/warmstart.py): resumed bit for bit, reused by key,
interrupted with SIGINT through the plain loop and continued by the same command."""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.presets import TINY, tiny_run
from verl_core.data.synthetic import write_arithmetic_dataset
from verl_core.layout import warm_start_doc
from verl_core.models import build_tiny_model
from verl_core.store import RunStore
from verl_core.training.sft import supervised_warm_start
from verl_core.warmstart import WarmStart, warm_start_key

REPO = Path(__file__).resolve().parents[2]


def _sft_inputs():
    model, tok = build_tiny_model(hidden_size=32, layers=1, heads=1, seed=3)
    prompts = [f"{a}+{b}=" for a in range(8) for b in range(8)]
    answers = [str(a + b) for a in range(8) for b in range(8)]
    return model, tok, prompts, answers


def test_resumed_supervised_loop_is_bit_identical():
    # straight: 30 steps; interrupted: 12 steps, its state through torch.save/load (what the
    # store holds), a fresh model and loop resumed from it for the other 18
    kw = dict(steps=30, batch_size=8, lr=3e-3, seed=11)
    straight, tok, prompts, answers = _sft_inputs()
    losses_straight = supervised_warm_start(straight, tok, prompts, answers, **kw)

    model, _, _, _ = _sft_inputs()
    saved = {}

    class Stop(Exception):
        pass

    def on_step(losses, snapshot):
        if len(losses) == 12:
            import io
            buf = io.BytesIO()
            torch.save({"inner": snapshot(), "model": model.state_dict()}, buf)
            saved["bytes"] = buf.getvalue()
            raise Stop

    with pytest.raises(Stop):
        supervised_warm_start(model, tok, prompts, answers, on_step=on_step, **kw)
    import io
    state = torch.load(io.BytesIO(saved["bytes"]), weights_only=False)
    resumed, _, _, _ = _sft_inputs()
    resumed.load_state_dict(state["model"])
    losses = supervised_warm_start(resumed, tok, prompts, answers, resume=state["inner"], **kw)
    assert losses == losses_straight  # the losses before the cut come with the state
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


def test_key_covers_the_warm_start_inputs_and_nothing_of_rl(tmp_path):
    train, _ = write_arithmetic_dataset(str(tmp_path / "d"), train_size=32, val_size=8,
                                        max_operand=9, seed=1)
    key = warm_start_key(tiny_run(), [train], None)
    assert key == warm_start_key(tiny_run(**{"optim.lr": 1e-4, "total_steps": 9}), [train], None)
    for change in ({"seed": 2}, {"model.warmup_sft_steps": 6}, {"model.tiny_hidden_size": 32},
                   {"rollout.max_new_tokens": 7}):
        assert warm_start_key(tiny_run(**change), [train], None) != key, change
    other, _ = write_arithmetic_dataset(str(tmp_path / "e"), train_size=32, val_size=8,
                                        max_operand=9, seed=2)
    assert warm_start_key(tiny_run(), [other], None) != key


def test_finished_warm_start_is_reused_from_the_store_then_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_ASSET_CACHE", str(tmp_path / "cache"))
    store = RunStore(str(tmp_path / "store"))
    model, tok, _, _ = _sft_inputs()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    key = "a" * 64
    logs = []
    ws = WarmStart(store, key, logs.append, total_steps=5, target=1.0)
    assert not ws.reuse(str(tmp_path / "none"))  # nothing finished yet
    ws.finish(str(folder), 5, 0.5)
    assert store.get_json(warm_start_doc(key))["done"]
    files = sorted(p.name for p in folder.iterdir())
    # from the store
    assert WarmStart(store, key, logs.append, total_steps=5, target=1.0).reuse(
        str(tmp_path / "a"))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == files
    assert "reused the finished one of this run" in logs[-1]
    # another run store: from the private cache, and then stored in that run too
    other = RunStore(str(tmp_path / "other"))
    assert WarmStart(other, key, logs.append, total_steps=5, target=1.0).reuse(
        str(tmp_path / "b"))
    assert "from the local cache" in logs[-1]
    for name in files:
        assert (tmp_path / "b" / name).read_bytes() == (folder / name).read_bytes()
    assert other.get_json(warm_start_doc(key))["done"]
    # a damaged cache entry is dropped, never used
    entry = next((tmp_path / "cache").glob("warmstart-*"))
    (entry / "model.safetensors").write_bytes(b"not the weights")
    assert not WarmStart(None, key, logs.append, total_steps=5, target=1.0).reuse(
        str(tmp_path / "c"))
    assert not entry.exists()


def _cmd(store, run_name):
    sets = {**TINY, "model.warmup_sft_steps": 300, "model.warmup_target_accuracy": 1.0}
    cmd = [sys.executable, "-m", "verl_core.train", "--steps", "1", "--store", str(store),
           "--run-name", run_name]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def _env(tmp_path, cache):
    return {**os.environ, "PYTHONPATH": str(REPO), "VERL_ASSET_CACHE": str(tmp_path / cache)}


def _model_sha(run_store: Path) -> str:
    index = next(p for p in (run_store / "assets").glob("*.json"))
    return json.loads(index.read_text())["model"]["model.safetensors"]


def test_sigint_during_the_warm_start_then_the_same_command_resumes_it(tmp_path):
    cmd = _cmd(tmp_path / "runs", "r")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path, "cache"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:  # the warm start's first line, then 2 s into its 300 steps
        lines.append(line)
        if line.startswith("warm start: up to 300"):
            break
    else:
        pytest.fail("".join(lines))
    time.sleep(2.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=60)[0]
    waited = time.monotonic() - t0
    out = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGINT, out
    m = re.search(r"interrupted \(SIGINT\) during the warm start \(step (\d+) of at most 300\): "
                  r"kept the warm start's progress up to step (\d+) in (\S+); continue with: "
                  r"(.+)$", out, re.M)
    assert m, out
    assert m.group(1) == m.group(2) and int(m.group(1)) > 0
    assert m.group(3) == str(tmp_path / "runs" / "r")
    assert shlex.split(m.group(4))[1:] == cmd[1:]  # the same command (its interpreter, as run)
    assert "Traceback" not in out
    # a polling loop saves and exits at once: well inside interrupt.GRACE_S, never past it
    # by more than a process's exit (a generous bound for a loaded machine)
    assert waited < 30, waited

    again = subprocess.run(cmd, cwd=tmp_path, env=_env(tmp_path, "cache"), capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"warm start: resuming from step {m.group(1)}" in again.stdout, again.stdout

    # the undisturbed warm start, in a run of its own with its own cache: the same weights
    ref = subprocess.run(_cmd(tmp_path / "runs", "ref"), cwd=tmp_path,
                         env=_env(tmp_path, "cache-ref"), capture_output=True, text=True,
                         timeout=900)
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    assert "warm start: resuming" not in ref.stdout
    assert _model_sha(tmp_path / "runs" / "r") == _model_sha(tmp_path / "runs" / "ref")

    # the same command a third time continues the finished run: no warm start at all
    third = subprocess.run([*cmd[:4], "2", *cmd[5:]], cwd=tmp_path, env=_env(tmp_path, "cache"),
                           capture_output=True, text=True, timeout=900)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "warm start" not in third.stdout
    assert "resuming from the checkpoint of step 1" in third.stdout, third.stdout
    assert re.search(r"^step 2/2 ", third.stdout, re.M) and "step 1/2" not in third.stdout


def test_key_of_the_calculator_task_names_its_builtin_tool(tmp_path):
    from verl_core.data.synthetic import write_calculator_dataset

    train, _ = write_calculator_dataset(str(tmp_path / "c"), train_size=16, val_size=4, seed=1)
    cfg = tiny_run(**{"data.synthetic_task": "calculator"})
    assert cfg.rollout.tool_config_path == "builtin:calculator"
    assert warm_start_key(cfg, [train], None) != warm_start_key(tiny_run(), [train], None)
