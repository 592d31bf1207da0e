"""FSDP2 wrapping and full (unsharded) views of sharded training state.

What belongs here: ``fully_shard`` of Hugging Face models, and the conversions between a sharded
model/optimizer and the full state dicts a single process uses (the rollout engine's copy of the
weights, checkpoints readable by any worker count). Process groups and Ray live in
``verl_core.engine.group``; the batch split in ``training/dist.py``.

Every function here is a collective when the model is sharded: every worker calls it, in the
same order.
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


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def full_model_state(model: torch.nn.Module, *, rank0_only: bool) -> dict[str, torch.Tensor]:
    """Full tensors of a sharded model (an all-gather per parameter). ``rank0_only``: only rank 0
    receives them, on CPU (for a checkpoint); otherwise every worker gets them (the rollout
    copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=rank0_only))


def load_full_model_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Every worker passes the full tensors; each keeps its shard."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def _trainable_names(model: torch.nn.Module) -> list[str]:
    # the order make_optimizer gives the optimizer its parameters (verl_core.training.optim)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_optimizer_state(model, optimizer, *, rank0_only: bool = True) -> dict:
    """The optimizer state of a sharded model, full, in ``torch.optim.Optimizer.state_dict()``'s
    own layout (parameters by index), so a checkpoint written by W workers is exactly what one
    process writes and reads. torch's ``get_optimizer_state_dict`` keys parameters by name; the
    index of a name is its position among the model's trainable parameters, the order the
    optimizer was built with."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(
        full_state_dict=True, cpu_offload=rank0_only))
    if not osd:
        return {}
    index = {n: i for i, n in enumerate(_trainable_names(model))}
    return {"state": {index[n]: v for n, v in osd["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                             for g in osd["param_groups"]]}


def load_full_optimizer_state(model, optimizer, state: dict) -> None:
    """Inverse of :func:`full_optimizer_state`: every worker passes the full index-keyed state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _trainable_names(model)
    osd = {"state": {names[int(i)]: v for i, v in state["state"].items()},
           "param_groups": [{**g, "params": [names[int(i)] for i in g["params"]]}
                            for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, osd,
                             options=StateDictOptions(full_state_dict=True))
