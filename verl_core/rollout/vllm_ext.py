"""The vLLM worker extension of the ``vllm`` rollout engine: methods mixed into vLLM's GPU worker.

``LLM(worker_extension_cls="verl_core.rollout.vllm_ext.WeightSyncExtension")`` makes vLLM add
this class to its worker's bases, so ``LLM.collective_rpc("verl_load_weights", args=(...))``
runs :meth:`WeightSyncExtension.verl_load_weights` on every worker, with ``self`` the worker
(``self.model_runner``, ``self.device`` are vLLM's). This is how verl, OpenRLHF and TRL refresh
vLLM's weights after an update (STACK_NOTES.md); reaching into the engine's internals instead
breaks once the worker runs in another process.

The method names carry a ``verl_`` prefix because vLLM refuses an extension that defines a name
its worker already has (vLLM 0.33's worker has its own ``update_weights``). Nothing here imports
vLLM: the class only ever runs inside vLLM's worker, which is already loaded.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch


class WeightSyncExtension:
    """Mixed into vLLM's worker (``self`` is the worker: ``self.model_runner`` is vLLM's)."""

    def _verl_model(self) -> torch.nn.Module:
        # get_model() unwraps a CUDA-graph wrapper (both vLLM model runners have it)
        return self.model_runner.get_model()

    @torch.no_grad()
    def verl_load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy ``(name, tensor)`` pairs in Hugging Face naming (``model.layers.0.self_attn.
        q_proj.weight`` …, what ``state_dict()`` of the training model gives) into the served
        model, in place, through the model's own ``load_weights`` (which fuses q/k/v and
        gate/up into vLLM's stacked parameters). Tensors may be on any device and in any float
        dtype: each is moved to the worker's device one at a time (so at most one extra tensor
        is resident) and cast by the parameter's loader. Returns the model parameters that got
        no weight (vLLM's names), which the caller treats as an error: an empty list is a full
        refresh."""
        model = self._verl_model()
        device = next(model.parameters()).device
        loaded = model.load_weights(weights=((name, t.to(device)) for name, t in named_tensors))
        if torch.cuda.is_available():
            torch.cuda.synchronize(device)
        if loaded is None:  # a model whose load_weights reports nothing: cannot check
            return []
        return sorted({name for name, _ in model.named_parameters()} - set(loaded))

    @torch.no_grad()
    def verl_weights_checksum(self) -> str:
        """sha256 over the served model's parameters (names and raw bytes, in
        ``named_parameters`` order): equal checksums mean bit-identical weights."""
        h = hashlib.sha256()
        for name, p in self._verl_model().named_parameters():
            h.update(name.encode())
            h.update(p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
                     .tobytes())
        return h.hexdigest()
