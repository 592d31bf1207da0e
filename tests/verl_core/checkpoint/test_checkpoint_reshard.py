"""Resharding: 1 -> 2 and 2 -> 1 workers with real torch.distributed (gloo) FSDP2 processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from verl_core.checkpoint import CheckpointManager, RunStore


@pytest.mark.slow
def test_reshard_1_to_2_and_2_to_1_with_fsdp2(tmp_path, tiny_llama):
    model = tiny_llama(seed=0, layers=2, hidden=64, vocab=256)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    root = str(tmp_path / "store")
    mgr = CheckpointManager(RunStore(root), chunk_bytes=4096)  # many chunks: slices matter
    mgr.save(1, {"policy": model.state_dict()}, {"hf_config": model.config.to_dict()})
    total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
    work = tmp_path / "work"
    work.mkdir()
    (work / "config.json").write_text(json.dumps(model.config.to_dict()))

    script = os.path.join(os.path.dirname(__file__), "reshard_worker.py")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, str(r), "2", root, str(work)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]

    # 1 -> 2: every rank read only (about) its half; the gathered state is the checkpoint's
    for r in range(2):
        read = json.load(open(work / f"rank{r}.json"))["bytes_read"]
        assert read < 0.75 * total, (r, read, total)
    loaded = load_file(str(work / "loaded_full.safetensors"))
    for k, v in model.state_dict().items():
        assert torch.equal(loaded[k], v), k
    with torch.no_grad():
        ref_logits = model(torch.arange(24).reshape(2, 12) % 256).logits
    torch.testing.assert_close(load_file(str(work / "logits.safetensors"))["logits"], ref_logits)

    # 2 -> 1: the checkpoint committed from two shards loads into one plain model + optimizer
    expected = load_file(str(work / "trained_full.safetensors"))
    plain = tiny_llama(seed=5, layers=2, hidden=64, vocab=256)
    info = mgr.load_into("latest", "policy", plain.state_dict())
    assert info.step == 2
    for k, v in plain.state_dict().items():
        assert torch.equal(v, expected[k]), k
    _, m = mgr.read_manifest("latest")
    assert [s["shard_id"] for s in m["shards"]] == [0, 1]
    groups, _, _ = mgr.load("latest", groups=["optimizer"])
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt.load_state_dict(groups["optimizer"])
    exp_optim = load_file(str(work / "trained_optim.safetensors"))
    names = [n for n, _ in plain.named_parameters()]
    for i, p in enumerate(plain.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], exp_optim[f"{names[i]}|{k}"]), (names[i], k)
