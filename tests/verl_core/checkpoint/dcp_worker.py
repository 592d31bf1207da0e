"""One rank of a real FSDP2 (gloo) job for test_checkpoint_dcp.py.

usage: python dcp_worker.py <mode> <rank> <world> <store_root> <workdir>

save      train a tiny model 2 steps; save_distributed at step 1, async_save_distributed at step 2,
          both with a frozen sharded reference model; rank 0 writes the full (gathered) model and
          optimizer state of step 2 for comparison
load      a fresh model (other seed) + optimizer, load_distributed("auto"), then the same dump
disagree  two checkpoints; rank r asks load_distributed for step r + 1: every rank must refuse
crash     step 1 committed, then an async save of a 64 MiB state that the parent kills mid-write
"""

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard

from verl_core.checkpoint import CheckpointDisagreementError, CheckpointManager, RunStore
from verl_core.training.dist import DataParallel

VOCAB, HIDDEN, OUT = 131, 64, 5  # rows that split unevenly over 2 and over 3 workers


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(3)])
        self.head = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def build(seed):
    torch.manual_seed(seed)
    model = Net()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)  # each worker its own data
    ids = torch.randint(0, VOCAB, (4, 3), generator=g)
    model(ids).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model, opt):
    return {"policy": get_model_state_dict(model),
            "optimizer": get_optimizer_state_dict(model, opt)}


def dump_full(model, opt, rank, work, tag):
    """Gather the full state (a collective) and, on rank 0, write it for the parent."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=opts)
    optim = get_optimizer_state_dict(model, opt, options=opts)
    if rank == 0:
        tensors = {f"policy/{k}": v.contiguous() for k, v in full.items()}
        for fqn, st in optim["state"].items():
            for k, v in st.items():
                tensors[f"optimizer/{fqn}/{k}"] = v.contiguous()
        save_file(tensors, f"{work}/{tag}.safetensors")
        with open(f"{work}/{tag}-param_groups.json", "w") as f:
            json.dump(optim["param_groups"], f)


def report(work, tag, rank, **values):
    with open(f"{work}/{tag}-rank{rank}.json", "w") as f:
        json.dump(values, f)


def main():
    mode, rank, world, root, work = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{work}/pg-{mode}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    dp = DataParallel(rank=rank, size=world)
    mgr = CheckpointManager(RunStore(root), chunk_bytes=4096)  # many objects: reads are partial

    if mode == "save":
        model, opt = build(seed=0)
        ref, _ = build(seed=1)  # frozen: the same shards in every checkpoint
        train_step(model, opt, rank, 1)
        one = mgr.save_distributed(1, {**state_of(model, opt), "reference":
                                       get_model_state_dict(ref)}, {"step": 1, "rank": rank},
                                   config_hash="cfg", dp=dp)
        train_step(model, opt, rank, 2)
        handle = mgr.async_save_distributed(2, {**state_of(model, opt), "reference":
                                                get_model_state_dict(ref)}, {"step": 2}, dp=dp)
        two = handle.wait()
        dump_full(model, opt, rank, work, "saved")
        report(work, "save", rank, one=one.name, two=two.name, parent=two.parent)
    elif mode == "load":
        model, opt = build(seed=7)  # not the checkpoint's weights
        state = state_of(model, opt)
        mgr.store.reset_stats()
        meta, info = mgr.load_distributed("auto", state, dp=dp)
        read = mgr.store.stats.bytes_read
        set_model_state_dict(model, state["policy"])
        set_optimizer_state_dict(model, opt, state["optimizer"])
        dump_full(model, opt, rank, work, f"loaded-w{world}")
        report(work, f"load-w{world}", rank, name=info.name, meta=meta, bytes_read=read)
    elif mode == "disagree":
        model, opt = build(seed=0)
        infos = []
        for step in (1, 2):
            train_step(model, opt, rank, step)
            infos.append(mgr.save_distributed(step, state_of(model, opt), {}, dp=dp).name)
        before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        errors = {}
        try:  # every rank reads its own (valid) manifest: rank r wants step r + 1
            mgr.load_distributed(rank + 1, state_of(model, opt), dp=dp)
        except CheckpointDisagreementError as e:
            errors["load"] = str(e)
        try:
            mgr.agree_on(infos[rank], dp)
        except CheckpointDisagreementError as e:
            errors["agree_on"] = str(e)
        unchanged = all(torch.equal(before[k], v.to_local()) for k, v in model.state_dict().items())
        report(work, "disagree", rank, infos=infos, errors=errors, unchanged=unchanged,
               agreed=mgr.agree_on(infos[0], dp))
    elif mode == "crash":
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        mgr = CheckpointManager(RunStore(root), chunk_bytes=4 << 20)
        model, opt = build(seed=0)
        train_step(model, opt, rank, 1)
        mgr.save_distributed(1, state_of(model, opt), {"step": 1}, dp=dp)
        if rank == 0:
            print("committed 1", flush=True)
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(2)  # the same full tensor on every rank, then sharded
        big = distribute_tensor(torch.randn(16384, 1024, generator=g), mesh, [Shard(0)])
        train_step(model, opt, rank, 2)
        mgr.async_save_distributed(2, {**state_of(model, opt), "scratch": {"w": big}},
                                   {"step": 2}, dp=dp)
        print(f"saving 2 rank {rank}", flush=True)
        while True:  # "training" goes on until the parent kills the job mid-write
            torch.randn(256, 256) @ torch.randn(256, 256)
            time.sleep(0.001)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # the manager's background thread pool is idle; do not wait on interpreter exit


if __name__ == "__main__":
    main()
