"""FSDP2 wrapping of Hugging Face models, mixed precision, and the full weights the rollout
engine's copy needs.

Mixed precision as verl does it (``model.dtype=bfloat16``): parameters, gradients and AdamW
moments stay float32 (the *master* weights: at lr 1e-6 most updates are far below one bf16 ulp
of a weight, 2^-8 relative, and would round away in bf16 parameters); every forward and backward
computes with bf16 copies. With W > 1 that is FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` over float32 shards; with one process (no FSDP) :func:`compute_in` makes the
same bf16 copies with module hooks, so W = 1 and W give the same numbers up to the order of the
float32 gradient sums.

What belongs here: ``fully_shard``, the one-process mixed precision, and the gather of full
weights from the shards. Checkpoints of
sharded state go through ``CheckpointManager.save_distributed``/``load_distributed`` (DCP),
process groups and Ray through ``verl_core.engine.group``, the batch split ``training/dist.py``.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face decoder (``model.model.layers`` for Llama, Qwen,
    Mistral …; ``transformer.h`` for GPT-2 style). Empty if none is found: the root alone is then
    one FSDP unit (correct, just less overlap of communication and compute)."""
    # the last path: a PEFT wrapper's (PeftModel.base_model.model is the wrapped causal LM)
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers",
                 "base_model.model.model.layers"):
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList):
            return list(obj)
    return []


COMPUTE_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}
"""``model.dtype`` -> the dtype forwards compute in over float32 master weights (None: float32
throughout, no copies)."""


def shard(model: torch.nn.Module, compute_dtype: Optional[torch.dtype] = None) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root, in place (FSDP2 over the default process
    group). ``compute_dtype`` (bf16): the shards keep the model's float32 parameters and each
    unit all-gathers them as bf16 for its forward/backward; gradients are reduced (and kept) in
    float32 (verl's ``mixed_precision`` default: param bf16, reduce fp32, buffers as loaded). The gradient reduction *sums* over workers (divide factor 1): the update weighs each
    worker's part of a mini-batch by its share of the loss's denominator
    (``micro_batch_weight``), so the parts add up to the mini-batch's gradient."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            # a plain SUM (gloo has no pre-multiplied sum; with factor 1 there is nothing to scale)
            m.set_force_sum_reduction_for_comms(True)
    return model


def train_in(model: torch.nn.Module, compute_dtype: Optional[torch.dtype], *,
               distributed: bool) -> torch.nn.Module:
    """Make ``model`` (float32 parameters) trainable by this worker: sharded with W > 1
    (:func:`shard`), else bf16 compute hooks when ``compute_dtype`` is set (:func:`compute_in`),
    else as it is."""
    if distributed:
        return shard(model, compute_dtype)
    return compute_in(model, compute_dtype) if compute_dtype is not None else model


def compute_in(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """One process's equivalent of FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype)``, in place.

    The float32 parameters stay the masters (the optimizer and checkpoints hold only them); each
    module's floating parameters are swapped for ``dtype`` copies (``p.to(dtype)``, gradients
    cast back into ``p.grad``) from its first forward until the root's backward ends, as FSDP2
    keeps a unit's unsharded parameters through its backward, so recomputed checkpoints and the
    chunked LM head see the copies. ``state_dict`` and the next root forward restore them first;
    buffers are left alone, as FSDP2 does. One copy per parameter and root forward, shared by
    every module holding it, so a tied embedding/LM head sums its two gradients in ``dtype``
    first, like FSDP2's one unsharded copy.

    Why not ``torch.autocast``: it casts only matmul inputs, so norms, embeddings and the
    residual stream would stay float32 on one worker and be bf16 under FSDP2 on W (the numbers
    would depend on W), and a bf16 reference model would not reproduce the actor's log-probs."""
    model._compute = {"dtype": dtype, "copies": {}, "swapped": []}
    for m in model.modules():
        # PEFT's LoRA layers cast their input to lora_A's dtype before lora_A's own forward,
        # i.e. to the float32 master, which this hook swaps for the copy only when lora_A runs
        # (float32 input, bf16 weight: a dtype error). Under FSDP2 the whole unit is already in
        # dtype there, so the cast is a no-op: turning it off gives the same numbers here.
        if hasattr(m, "cast_input_dtype_enabled"):
            m.cast_input_dtype_enabled = False
    for m in model.modules():
        if m is model or any(True for _ in m.parameters(recurse=False)):
            m.register_forward_pre_hook(functools.partial(_cast_params, model))
    model.register_forward_hook(functools.partial(_root_done, model), always_call=True)
    model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: _restore(model))
    return model


def _cast_params(root, module, args) -> None:
    state = root._compute
    if module is root:
        _restore(root)  # a forward whose backward never ran must not leave copies behind
    if "_masters" in module.__dict__:
        return  # swapped already (a checkpointed layer recomputed in backward)
    masters = dict(module._parameters)
    module._masters = masters
    state["swapped"].append(module)
    for name, p in masters.items():
        if p is None or not p.is_floating_point() or p.dtype == state["dtype"]:
            continue
        copy = state["copies"].get(id(p))
        if copy is None:
            copy = state["copies"][id(p)] = p.to(state["dtype"])
        module._parameters[name] = copy


def _root_done(root, module, args, output) -> None:
    """After the root's forward: put the masters back now (no backward will come), or at the end
    of the backward that reaches the copies (an autograd-engine callback, FSDP2's mechanism)."""
    copies = [c for c in root._compute["copies"].values() if c.requires_grad]
    if not copies:
        _restore(root)
        return

    def at_first_gradient(grads):
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _restore(root))

    torch.autograd.graph.register_multi_grad_hook(copies, at_first_gradient, mode="any")


def _restore(root) -> None:
    state = root._compute
    for m in state["swapped"]:
        m._parameters.update(m.__dict__.pop("_masters", {}))
    state["swapped"].clear()
    state["copies"] = {}


def full_model_state(model: torch.nn.Module, *, rank0_only: bool) -> dict[str, torch.Tensor]:
    """Full tensors of a sharded model (an all-gather per parameter: a collective, every worker
    calls it). ``rank0_only``: only rank 0 receives them, on CPU; otherwise every worker gets them
    (the rollout copy)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=rank0_only))
