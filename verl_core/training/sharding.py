"""FSDP2 wrapping of Hugging Face models, and the full weights the rollout engine's copy needs.

What belongs here: ``fully_shard`` and the gather of full weights from the shards. Checkpoints of
sharded state go through ``CheckpointManager.save_distributed``/``load_distributed`` (DCP),
process groups and Ray through ``verl_core.engine.group``, the batch split ``training/dist.py``.
"""

from __future__ import annotations

from typing import Any

import torch


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face decoder (``model.model.layers`` for Llama, Qwen,
    Mistral …; ``transformer.h`` for GPT-2 style). Empty if none is found: the root alone is then
    one FSDP unit (correct, just less overlap of communication and compute)."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root, in place (FSDP2 over the default process
    group). The gradient reduction *sums* over workers (divide factor 1): the update weighs each
    worker's part of a mini-batch by its share of the loss's denominator
    (``micro_batch_weight``), so the parts add up to the mini-batch's gradient."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in _decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # a plain SUM (gloo has no pre-multiplied sum; with factor 1 there is nothing to scale)
            m.set_force_sum_reduction_for_comms(True)
    return model


def full_model_state(model: torch.nn.Module, *, rank0_only: bool) -> dict[str, torch.Tensor]:
    """Full tensors of a sharded model (an all-gather per parameter: a collective, every worker
    calls it). ``rank0_only``: only rank 0 receives them, on CPU; otherwise every worker gets them
    (the rollout copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=rank0_only))
