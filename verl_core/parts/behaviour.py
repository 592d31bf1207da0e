"""The behaviour policy: the weights that sample, their version, the rollout engine and the
background rollout.

On-policy (``rollout.max_staleness`` = 0) the behaviour policy is the actor itself (with W > 1 a
full copy refreshed from the shards after every update, verl's colocated hybrid engine). With
``rollout.max_staleness`` = 1 it is a copy that takes the actor's weights only when told
(:meth:`Behaviour.snapshot`), so the rollout of step t + 1 can sample, in a background thread or
process, with the weights of step t while update t changes the actor (docs/async.md). Its
version is the step of the weights it holds; every off-policy batch records it
(``meta["policy_version"]``) and the update refuses one outside the bound
(:meth:`Behaviour.check_lag`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import threading
import time

import torch

from verl_core.data.batch import Batch
from verl_core.data.prompts import Prompts
from verl_core.errors import RECOVER, StaleBatchError
from verl_core.guard import faults
from verl_core.models import load_causal_lm
from verl_core.parts.trained import model_state
from verl_core.reward.decode import stop_token_ids
from verl_core.rollout import SamplingParams, make_engine
from verl_core.rollout.base import GenerationOutput, concat_outputs
from verl_core.reward.scoring import turn_extra_info
from verl_core.rollout.multi_turn import (MultiTurnOutput, concat_turn_outputs, generate_turns,
                                          turn_limits, turn_metrics)
from verl_core.seeds import derive_seed
from verl_core.training.dist import DataParallel

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prefetch:
    """The rollout of ``step`` sampling in a background thread (from the behaviour policy, the
    state after ``version`` updates) while the update runs."""

    step: int
    version: int
    thread: threading.Thread
    box: dict  # "out": (batch, metrics), or "error"; "span": (start, end) perf_counter times


class Behaviour:
    """The sampling side of a run: its weights (:attr:`model`), their :attr:`version`, the
    rollout :attr:`engine`, and the background rollout (off-policy)."""

    def __init__(self, cfg, assets, actor, prompts: Prompts, dp: DataParallel,
                 device: torch.device):
        """``actor``: the :class:`~verl_core.parts.Actor` whose weights this follows; None in the
        sampler process (``parts/sampler_process.py``), whose weights are the worker's."""
        self.cfg, self.assets, self.actor, self.prompts, self.dp = cfg, assets, actor, prompts, dp
        self.lag = cfg.rollout.max_staleness
        """How many updates the sampling weights may be behind the actor's (0: on-policy)."""
        self.version = 0
        """The step of the weights that sample (off-policy; on-policy they are the live ones)."""
        # with W > 1 workers the actor is sharded (FSDP2) and rollout runs on a full copy of it,
        # refreshed from the shards after every change; off-policy, the copy is the behaviour
        # policy, which takes the actor's weights only when told (snapshot)
        if dp.distributed or self.lag or actor is None:
            self.model = load_causal_lm(assets.model_path, cfg.model.dtype).to(device)
        else:
            self.model = actor.model
        self._stale = False  # on-policy: the copy is behind the actor (an update ran)
        self._engine_stale = False  # off-policy: the engine's own copy (vllm) is not current
        self._actor_engine = None  # off-policy with hf: evaluation samples the actor itself
        self._prefetch: Prefetch | None = None
        self._sampler = None  # rollout.async_mode=process: the SamplerProcess (started lazily)
        tok, rc = prompts.tokenizer, cfg.rollout
        self.engine = make_engine(rc.engine, model=self.model, model_path=assets.model_path,
                                  eos_token_ids=stop_token_ids(tok),  # the model's EOS set
                                  pad_token_id=tok.pad_token_id,
                                  micro_batch_size=rc.generation_batch,
                                  max_num_seqs=rc.max_num_seqs,
                                  enable_chunked_prefill=rc.enable_chunked_prefill,
                                  # read by vllm only (hf ignores them)
                                  gpu_memory_utilization=rc.gpu_memory_utilization,
                                  enforce_eager=rc.enforce_eager,
                                  free_cache_engine=rc.free_cache_engine,
                                  cpu_kv_cache_gib=rc.cpu_kv_cache_gib,
                                  engine_own_process=rc.engine_own_process,
                                  engine_timeout_s=rc.engine_timeout_s,
                                  engine_max_restarts=rc.engine_max_restarts,
                                  # the longest sequence a run asks for (not the model's
                                  # context, whose KV cache may not fit cpu_kv_cache_gib)
                                  max_model_len=rc.max_model_len or
                                  cfg.data.max_prompt_length + rc.max_new_tokens,
                                  dtype=cfg.model.dtype, seed=cfg.seed)
        self.snapshot(0)  # off-policy: a LoRA policy's merged weights, else the same copy

    def stop(self) -> None:
        """Wait for a background rollout (dropping it) and end the sampler process."""
        self.drop_prefetch()
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.close()

    def close(self) -> None:
        self.stop()
        self.engine.close()  # a vllm engine's processes (rollout.engine_own_process)

    # ------------------------------------------------------------------ weights
    def snapshot(self, version: int) -> None:
        """Off-policy: take the actor's current weights (a LoRA policy's merged), the state
        after ``version`` updates; a background rollout of the weights held before is dropped,
        and an engine with its own copy takes the new ones before it samples next. On-policy
        the sampling weights are the actor's: nothing to do."""
        if not self.lag or self.actor is None:
            return
        self.drop_prefetch()
        self.model.load_state_dict(self._actor_weights())
        self.changed()
        self.version = version

    def _actor_weights(self) -> dict:
        """The actor's weights as a plain model's state dict (a LoRA policy's merged): with
        W > 1 gathered from the FSDP shards on every worker (a collective on the default group:
        called from the main thread, by every worker in the same order)."""
        return self.actor.gathered_merged_state() if self.dp.distributed \
            else self.actor.merged_state()

    def changed(self) -> None:
        """The behaviour weights changed (a snapshot, a load, or another process's snapshot of
        the shared weights: ``parts/sampler_process.py``): an engine with its own copy (vllm)
        takes them before it samples next."""
        self._engine_stale = True

    def actor_changed(self) -> None:
        """An update changed the actor: on-policy, the copy (W > 1) and an engine's own weights
        follow it before the next sample."""
        self._stale = True

    def ready(self) -> None:
        """Bring the sampling weights up to date before a sample. W > 1 on-policy: copy the
        current weights from the FSDP shards (an all-gather, no round trip through the store; a
        collective: every worker calls it). An engine with its own copy (vllm) then gets them.
        Off-policy the weights change only by :meth:`snapshot` (or a load): the engine follows."""
        if self.lag:
            if self._engine_stale and self.engine.owns_weights:
                self.engine.load_weights(self._weights())
            self._engine_stale = False
            return
        if self._stale:
            if self.dp.distributed:  # a LoRA policy's merged (W + s B A) into the plain copy
                self.model.load_state_dict(self.actor.gathered_merged_state())
            if self.engine.owns_weights:
                self.engine.load_weights(self._weights())
        self._stale = False

    def _weights(self) -> dict:
        """The sampling weights as a plain model's state dict (what an engine with its own copy
        loads): the copy's, or the actor's merged when they are the actor's (W = 1 on-policy)."""
        return self.actor.merged_state() if self.model is self.actor.model \
            else self.model.state_dict()

    @contextlib.contextmanager
    def policy_engine(self):
        """The engine that samples the current policy (the evaluation's), once a background
        rollout that shares the tool host or the engine finished (it is kept): the rollout
        engine on-policy; off-policy, where that one holds the behaviour policy, an ``hf``
        engine over the actor, or the rollout engine (vllm) given the actor's weights until the
        next rollout gives it the behaviour policy's back."""
        if self._prefetch is not None:
            self._prefetch.thread.join()
        if not self.lag:
            self.ready()
            yield self.engine
        elif self.engine.owns_weights:
            self.engine.load_weights(self._actor_weights())
            self._engine_stale = True
            yield self.engine
        else:
            if self._actor_engine is None:
                # W > 1 the actor is sharded and decoding runs no collectives (each worker its
                # own share of the rows): a full copy of it, as on-policy, filled below
                model = load_causal_lm(self.assets.model_path, self.cfg.model.dtype).to(
                    self.model.device) if self.dp.distributed else self.actor.model
                tok = self.prompts.tokenizer
                self._actor_engine = make_engine(
                    "hf", model=model, eos_token_ids=stop_token_ids(tok),
                    pad_token_id=tok.pad_token_id, micro_batch_size=self.cfg.rollout.generation_batch)
            if self.dp.distributed:
                self._actor_engine.model.load_state_dict(self._actor_weights())
            yield self._actor_engine

    # ------------------------------------------------------------------ checkpoint groups
    def state_dict(self, *, with_optimizer: bool = True) -> tuple[dict, dict]:
        """Off-policy: the weights the next rollout samples with (``behaviour``) and their step
        (``meta["behaviour_step"]``); on-policy nothing (they are the actor's). No optimizer."""
        if not self.lag:
            return {}, {}
        return {"behaviour": model_state(self.model)}, {"behaviour_step": self.version}

    def load_targets(self) -> dict:
        """Views of the behaviour weights a load fills in place; a background rollout reading
        them is waited for and dropped first."""
        self.drop_prefetch()
        return {"behaviour": model_state(self.model)} if self.lag else {}

    def load_state_dict(self, groups: dict, meta: dict, step: int) -> None:
        """After a load of the state of ``step``: off-policy, the behaviour weights of the
        checkpoint, or (an on-policy run's checkpoint) the loaded actor's: the first rollout
        samples its own state."""
        if self.lag:
            if "behaviour" in groups:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict

                set_model_state_dict(self.model, groups["behaviour"])
                self.changed()
            else:
                self.snapshot(step)
        self._stale = True
        self.version = int(meta.get("behaviour_step", step))

    # ------------------------------------------------------------------ sampling
    @property
    def _sample_dp(self) -> DataParallel:
        """Whose gathers the rollout's blocks go through: off-policy a gloo group of their own
        (:meth:`DataParallel.sampling`), since the background rollout gathers in its thread
        while the update's FSDP collectives run on the default group; on-policy the worker's."""
        return self.dp.sampling() if self.lag else self.dp

    def generate(self, prompt_ids, prompt_mask, params: SamplingParams):
        """Generate for all N rows; with W > 1 each worker samples its block (with the random
        draws the whole batch would use for those rows) and the blocks are gathered."""
        self.ready()
        if not self.dp.distributed:
            return self.engine.generate(prompt_ids, prompt_mask, params)
        n = prompt_ids.shape[0]
        mine = self.dp.block(torch.arange(n))
        out = self.engine.generate(prompt_ids[mine], prompt_mask[mine], params,
                                   first_row=int(mine[0]), total_rows=n)
        return concat_outputs(self._sample_dp.gather_objects(out),
                              self.prompts.tokenizer.pad_token_id)

    def generate_turns(self, prompt_ids, prompt_mask, params: SamplingParams, rows: list[int],
                       rows_data: list, phase: str, split: bool = True,
                       engine=None) -> MultiTurnOutput:
        """Multi-turn rollouts (``rollout.multi_turn``, :func:`generate_turns`) of the N
        prompts; ``rows`` (N,): each one's row index in the phase's whole batch (its random
        draws), ``rows_data`` (N,) the dataset rows (verl's ``extra_info.tools_kwargs``). With
        W > 1 and ``split`` each worker runs its block and the blocks are gathered (a
        collective); ``split=False``: this worker runs all N. ``engine``: another engine than
        the rollout's (the evaluation's, :meth:`policy_engine`)."""
        if engine is None:
            self.ready()
        rc, n, p = self.cfg.rollout, prompt_ids.shape[0], self.prompts
        split = split and self.dp.distributed
        mine = self.dp.block(torch.arange(n)).tolist() if split else list(range(n))
        out = generate_turns(
            engine or self.engine, p.tokenizer,
            [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in mine], params,
            host=p.tool_host, tools=p.tool_schemas, rows=[rows[i] for i in mine],
            tools_kwargs=[(rows_data[i].extra_info or {}).get("tools_kwargs") for i in mine],
            **turn_limits(rc), instance_prefix=f"{phase}:{params.seed}")
        if split:
            out = concat_turn_outputs(self._sample_dp.gather_objects(out),
                                      p.tokenizer.pad_token_id)
        return out

    def generate_greedy(self, prompt_ids, prompt_mask) -> GenerationOutput:
        """One greedy (argmax) response per prompt row: (B, T_b). With W > 1 the rows are padded
        to a multiple of W with copies of the last one (greedy decoding draws nothing, so the
        copies change no other row) and the copies dropped after."""
        B = prompt_ids.shape[0]
        pad = -B % self.dp.size
        if pad:
            prompt_ids = torch.cat([prompt_ids, prompt_ids[-1:].expand(pad, -1)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[-1:].expand(pad, -1)])
        params = SamplingParams(temperature=0.0, max_new_tokens=self.cfg.rollout.max_new_tokens)
        out = self.generate(prompt_ids, prompt_mask, params)
        mask = out.response_mask[:B]
        T = int(mask.sum(0).nonzero().max()) + 1 if mask.any() else 0  # drop the copies' columns
        return GenerationOutput(response_ids=out.response_ids[:B, :T], response_mask=mask[:, :T],
                                logprobs=out.logprobs[:B, :T])

    def sample(self, step: int, idx: list[int], kl_coef: float,
               phase: str = "rollout") -> tuple[Batch, dict]:
        """G responses for each prompt of dataset indices ``idx`` (B,) from these weights,
        seeded by (seed, step, ``phase``), with one greedy response per prompt when the
        estimator asks for it (``needs_greedy_baseline``, ReMax): the batch (groups 0..B-1 in
        the order of ``idx``; ``meta["kl_coef"]``: ``kl_coef``) and the rollout metrics."""
        rc, G, p = self.cfg.rollout, self.cfg.rollout.n, self.prompts
        rows_idx = torch.tensor(idx).repeat_interleave(G)  # (N,): prompt b's G samples adjacent
        params = SamplingParams(temperature=rc.temperature, top_p=rc.top_p, top_k=rc.top_k,
                                max_new_tokens=rc.max_new_tokens,
                                seed=derive_seed(self.cfg.seed, step, phase))
        rows = [p.train_rows[i] for i in rows_idx.tolist()]
        t0 = time.perf_counter()
        restarts, timeouts = self.engine.restarts, self.engine.timeouts
        faults.engine_drill(self.engine, step)  # a VERL_FAULTS drill (engine_kill/_hang)
        extra, metrics, infos = {}, {}, [r.extra_info for r in rows]
        if rc.multi_turn:
            # VERL_FAULTS' tool_call point: in this step's calls, once sent (a no-op without it)
            p.tool_host.on_calls_sent = functools.partial(faults.maybe_inject, "tool_call", step)
            try:
                out = self.generate_turns(p.train_ids[rows_idx], p.train_mask[rows_idx], params,
                                          list(range(len(rows))), rows, phase)
            finally:
                p.tool_host.on_calls_sent = None
            extra = {"response_attention_mask": out.attention_mask,
                     "turns": out.stored_turns()}
            metrics.update(turn_metrics(out))
            infos = turn_extra_info(infos, extra["turns"])
        else:
            out = self.generate(p.train_ids[rows_idx], p.train_mask[rows_idx], params)
        dt = time.perf_counter() - t0
        if self.cfg.algorithm.estimator_traits.needs_greedy_baseline:
            t1 = time.perf_counter()
            greedy = self.generate_greedy(p.train_ids[idx], p.train_mask[idx])
            prompt_of_row = torch.arange(len(idx)).repeat_interleave(G)  # (N,) row -> prompt b
            extra.update({"baseline_response_ids": greedy.response_ids[prompt_of_row],  # (N, T_b)
                          "baseline_response_mask": greedy.response_mask[prompt_of_row]})
            metrics["rollout/greedy_time_s"] = time.perf_counter() - t1
            metrics["rollout/greedy_length_mean"] = float(greedy.response_mask.sum()) / len(idx)
        batch = Batch(
            prompt_ids=p.train_ids[rows_idx], prompt_mask=p.train_mask[rows_idx],
            response_ids=out.response_ids, response_mask=out.response_mask,
            response_logprobs=out.logprobs,
            group=torch.arange(len(idx)).repeat_interleave(G),
            uid=[str(r.index) for r in rows], ground_truth=[r.ground_truth for r in rows],
            data_source=[r.data_source for r in rows], extra_info=infos,
            pad_id=p.tokenizer.pad_token_id,
            meta={"step": step, "kl_coef": kl_coef}, **extra)
        tokens = float(out.response_mask.sum())  # sampled
        lengths = batch.response_lengths  # (N,) every real token (multi-turn: tools' too)
        return batch, {"rollout/time_s": dt, "rollout/tokens_per_s": tokens / max(dt, 1e-9),
                       "response_length/mean": float(lengths.sum()) / batch.num_rows,
                       # verl's: the share of responses cut at rollout.max_new_tokens
                       "response_length/clip_ratio": float(
                           (lengths >= rc.max_new_tokens).float().mean()),
                       # 1: the engine gave its memory back for the update (vLLM's sleep mode)
                       "rollout/memory_released": float(self.engine.releases_memory),
                       # rebuilds of a dead or hung engine (vllm in its own process)
                       "rollout/engine_restarts": float(self.engine.restarts - restarts),
                       "rollout/engine_timeouts": float(self.engine.timeouts - timeouts),
                       **metrics}

    def rollout(self, step: int, idx: list[int], kl_coef: float) -> tuple[Batch, dict]:
        """The rollout of ``step`` (prompts ``idx``) from these weights: off-policy, taken from
        the background rollout that the update of ``step - 1`` started when there is one
        (:meth:`follow`), else sampled now; the same bytes either way (every draw is seeded by
        (seed, step, row)). Off-policy batches record ``meta["policy_version"]``; the metrics
        say how far behind the weights were (``rollout/staleness``)."""
        got = self._take_prefetch(step)
        if got is None:
            batch, metrics = self.sample(step, idx, kl_coef)
            if self.lag:
                metrics["rollout/prefetched"] = 0.0
        else:
            batch, metrics = got
        if self.lag:
            batch = batch.replace(meta={**batch.meta, "kl_coef": kl_coef,
                                        "policy_version": self.version})
        metrics["rollout/staleness"] = float(step - self.version) if self.lag else 0.0
        return batch, metrics

    def check_lag(self, step: int, batch: Batch, ref: str) -> None:
        """The batch of update ``step`` was sampled with weights at most ``rollout.max_staleness``
        updates behind (its ``meta["policy_version"]``; an on-policy batch's version is its
        step), never ahead; else :class:`StaleBatchError`."""
        version = int(batch.meta.get("policy_version", batch.meta.get("step", step)))
        if not 0 <= step - version <= self.lag:
            raise StaleBatchError(
                f"update {step}: its batch {ref[:12]} was sampled with the weights of step "
                f"{version} (policy version {version}), {step - version} updates behind the "
                f"weights it updates (step {step}); rollout.max_staleness={self.lag} allows "
                f"0..{self.lag}. The batch is not this run's rollout of step {step}: {RECOVER}")

    # ------------------------------------------------------------------ background rollout
    def follow(self, step: int, next_idx) -> bool:
        """Update ``step`` starts. Off-policy, the live state is the behaviour policy of the
        next rollout: take it (:meth:`snapshot`) and, with ``next_idx`` (a callable giving the
        prompts of step + 1; None at the last step), sample step + 1 in the background while
        the update runs. True when it did: the caller then does not trust the live state until
        the update is recorded (a retry or a failure rebuilds it, with its behaviour policy)."""
        if not self.lag:
            return False
        self.snapshot(step)
        if next_idx is not None:
            self._start_prefetch(step + 1, next_idx())
        return True

    def _start_prefetch(self, step: int, idx: list[int]) -> None:
        """Start sampling the rollout of ``step`` in a background thread (the update of
        ``step - 1`` runs meanwhile on the actor, another copy). It only reads the behaviour
        model, the prompts and the tool host, and draws only from its own seeded generators; the
        prompts were chosen by the caller, so the data sampler is not touched there."""
        box: dict = {}
        version = self.version
        sample = functools.partial(self.sample, kl_coef=self.actor.kl_ctrl.value)
        if self.cfg.rollout.async_mode == "process":
            if self._sampler is None:
                from verl_core.parts.sampler_process import SamplerProcess

                self._sampler = SamplerProcess(json.dumps(self.cfg.to_dict()), self.assets,
                                               self.model, type(self))
            sampler = self._sampler

            def sample(step, idx):
                return sampler.sample(step, idx, version)

        def body():
            t0 = time.perf_counter()
            try:
                faults.maybe_inject("background_rollout", step)  # a VERL_FAULTS drill
                batch, metrics = sample(step, idx)
                box["out"] = (batch, {**metrics, "rollout/prefetched": 1.0})
            except BaseException as e:  # noqa: BLE001 - reported where the rollout is taken
                box["error"] = e
            box["span"] = (t0, time.perf_counter())

        thread = threading.Thread(target=body, name=f"verl-rollout-step-{step}", daemon=True)
        self._prefetch = Prefetch(step=step, version=version, thread=thread, box=box)
        thread.start()

    def _take_prefetch(self, step: int) -> tuple[Batch, dict] | None:
        """The background rollout of ``step`` from the weights held now, waited for; None when
        there is none (or it failed: the phase samples again, and raises if that fails too)."""
        p = self._prefetch
        if p is None or p.step != step or p.version != self.version:
            self.drop_prefetch()
            return None
        self._prefetch = None
        t0 = time.perf_counter()
        p.thread.join()
        if "error" in p.box:
            log.warning("the background rollout of step %d failed (%s); sampling it again",
                        step, p.box["error"])
            if self._sampler is not None and not self._sampler.proc.is_alive():
                sampler, self._sampler = self._sampler, None  # the next one starts a new one
                sampler.close()
            return None
        batch, metrics = p.box["out"]
        start, end = p.box["span"]
        # the overlap, as the phase timeline shows it: how long the phase waited for the
        # background rollout, and how much of it ran before the phase asked
        metrics["rollout/prefetch_wait_s"] = time.perf_counter() - t0
        metrics["rollout/prefetch_ahead_s"] = max(0.0, min(end, t0) - start)
        return batch, metrics

    def drop_prefetch(self) -> None:
        """Wait for a background rollout and discard it (the state it belongs to is changing,
        or it is for another step). A thread cannot be stopped half-way; it only ever reads the
        behaviour model, which is why it is waited for before that changes."""
        p, self._prefetch = self._prefetch, None
        if p is not None:
            p.thread.join()
