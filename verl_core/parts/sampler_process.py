"""``rollout.async_mode=process``: the background rollout of ``rollout.max_staleness`` in a
sampler process of its own (docs/async.md).

Why a process: the worker's update and a sampling thread beside it share one interpreter lock,
and with a small model (or the per-token loop of the ``hf`` engine) both spend most of their time
holding it, so a thread overlaps little but the tool calls' waits. The sampler process builds the
run's prompts and behaviour policy from the same config and assets (tokenizer, prompts, tool host,
engine; no actor) and samples with :meth:`Behaviour.sample`, the code the worker's own rollout
runs. Its behaviour model's
weights *are* the worker's: the worker's behaviour model is moved to shared memory and the child
aliases those tensors, so ``Behaviour.push`` (an in-place copy) is all the transfer there
is. Draws are seeded by (seed, step, row) and the child computes with the run's
thread count, so it samples the bytes the worker would.

The worker only asks it to sample while the behaviour weights stand still (they change only after
the background rollout was taken or dropped), and hands it the behaviour version with every
request, so an engine with its own copy (vllm) reloads when it changed.
"""

from __future__ import annotations

import atexit
import json
import logging

import torch

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0


class SamplerError(RuntimeError):
    """The sampler process failed a request (its error, as text) or died."""


class SamplerProcess:
    """A child process sampling rollouts from ``rollout_model``'s weights (shared in place)."""

    def __init__(self, config_json: str, assets, rollout_model: torch.nn.Module, behaviour):
        """``behaviour``: the class the child samples with (:class:`~verl_core.parts.Behaviour`,
        handed in rather than imported: it is the one that starts this process)."""
        rollout_model.share_memory()  # in place: the worker's engine keeps the same model
        ctx = torch.multiprocessing.get_context("spawn")  # no fork of a process holding threads
        self.conn, child = ctx.Pipe()
        # not a daemon: it starts the tool host's process (multi-turn rollouts). It ends when
        # told (close, at the latest when this interpreter exits: atexit runs it before
        # multiprocessing joins its children), or when this process is gone (its pipe closes)
        self.proc = ctx.Process(target=_serve, name="verl-sampler",
                                args=(child, config_json, assets, rollout_model.state_dict(),
                                      behaviour))
        self.proc.start()
        child.close()
        atexit.register(self.close)

    def sample(self, step: int, idx: list[int], version: int):
        """``Behaviour.sample(step, idx)`` in the child, from the behaviour weights of
        ``version``: (batch, metrics)."""
        try:
            self.conn.send(("sample", step, list(idx), version))
            kind, out = self.conn.recv()
        except (EOFError, OSError) as e:
            self.proc.join(5)  # its pipe closes as it dies: the exit code follows at once
            raise SamplerError(f"the sampler process died (exit code {self.proc.exitcode}) "
                               f"sampling step {step}") from e
        if kind == "error":
            raise SamplerError(f"the sampler process failed sampling step {step}: {out}")
        return out

    def close(self) -> None:
        atexit.unregister(self.close)
        if self.conn.closed:
            return
        try:
            self.conn.send(("close",))
        except (OSError, ValueError):
            pass
        self.proc.join(CLOSE_TIMEOUT_S)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def _serve(conn, config_json: str, assets, shared: dict, Behaviour) -> None:
    from verl_core.config import RunConfig
    from verl_core.data.prompts import load_prompts
    from verl_core.guard import faults
    from verl_core.threads import intra_op_threads
    from verl_core.training.device import make_deterministic, resolve_device
    from verl_core.training.dist import SINGLE

    cfg = RunConfig.from_dict(json.loads(config_json))
    # as the worker's trainer computes (its recorded thread count, device, determinism)
    torch.set_num_threads(intra_op_threads(cfg))
    device = resolve_device(cfg.trainer.device)
    make_deterministic(device, cfg.trainer.deterministic)
    prompts = load_prompts(cfg, assets)
    behaviour = Behaviour(cfg, assets, None, prompts, SINGLE, device)
    try:
        # the worker's behaviour weights, aliased (tied weights stay tied: one tensor, two names)
        behaviour.model.load_state_dict(shared, assign=True)
        loaded = None
        while True:
            msg = conn.recv()
            if msg[0] == "close":
                return
            _, step, idx, version = msg
            if version != loaded:  # an engine with its own copy (vllm) takes the new weights
                behaviour.changed()
                loaded = version
            faults.maybe_inject("sampler", step)  # a VERL_FAULTS drill (a kill ends this process)
            try:
                # the KL coefficient is the worker's to set when it takes the batch
                conn.send(("ok", behaviour.sample(step, idx, cfg.algorithm.kl_coef)))
            except Exception as e:  # noqa: BLE001 - the worker samples again and reports
                log.exception("sampling step %d failed", step)
                conn.send(("error", f"{type(e).__name__}: {e}"))
    except EOFError:
        return  # the worker is gone
    finally:
        behaviour.close()
        prompts.close()
