"""One rank of the 2-process FSDP2 (gloo) resharding test; run by test_checkpoint_reshard.py.

usage: python reshard_worker.py <rank> <world> <store_root> <workdir>

1 -> 2: the checkpoint written by one plain process is loaded into FSDP2 shards (each rank reads
        only the rows it owns); the gathered full state must equal the checkpoint.
2 -> 1: after one optimizer step each rank writes its own shards (save_shard), rank 0 commits;
        the full model/optimizer state gathered here is written for the parent to compare with.
"""

import json
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from verl_core.checkpoint import CheckpointManager, RunStore


def main():
    rank, world, root, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
    torch.set_num_threads(1)
    cfg = LlamaConfig(**json.load(open(f"{work}/config.json")))
    torch.manual_seed(999)  # deliberately not the checkpoint's weights
    model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    # the optimizer must see the sharded parameters: create it before any forward (a no-grad
    # forward leaves FSDP2's root unsharded until model.reshard())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(RunStore(root, create=False))

    # ---- 1 -> 2
    mgr.store.reset_stats()
    mgr.load_into("latest", "policy", model.state_dict())
    read = mgr.store.stats.bytes_read
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    ids = torch.arange(24).reshape(2, 12) % cfg.vocab_size
    with torch.no_grad():
        logits = model(ids).logits
    model.reshard()
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, f"{work}/loaded_full.safetensors")
        save_file({"logits": logits.contiguous()}, f"{work}/logits.safetensors")
    json.dump({"bytes_read": read}, open(f"{work}/rank{rank}.json", "w"))

    # ---- 2 -> 1
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    mgr.save_shard(2, rank, world, {"policy": model.state_dict(), "optimizer": opt.state_dict()})
    dist.barrier()
    if rank == 0:
        mgr.commit(2, world, {"hf_config": cfg.to_dict()})
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    optim_full = {f"{n}|{k}": opt.state[p][k].full_tensor()  # collective: every rank calls it
                  for n, p in model.named_parameters() for k in ("exp_avg", "exp_avg_sq")}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, f"{work}/trained_full.safetensors")
        save_file({k: v.contiguous() for k, v in optim_full.items()},
                  f"{work}/trained_optim.safetensors")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
