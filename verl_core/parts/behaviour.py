"""The behaviour policy: the weights that sample, their versions, the rollout engine and the
background rollout.

On-policy (``rollout.max_staleness`` = 0) the behaviour policy is the actor itself (with W > 1 a
full copy refreshed from the shards after every update, verl's colocated hybrid engine). With
``rollout.max_staleness`` = k >= 1 it is a queue of the actor's last k weight versions, taken
only when told (:meth:`Behaviour.push`, at the start of every update): the rollout of step t
samples with the oldest of them, so it can run in a background thread or process while the
updates before it change the actor (docs/async.md). A version is the step of the state whose
weights it is; every off-policy batch records its own (``meta["policy_version"]``) and the update
refuses one outside the bound (:meth:`Behaviour.check_lag`).

The schedule is a function of the lineage alone: after update s starts the queue holds the
distinct versions among the last k pushed (s - k + 1 .. s, fewer after a reset), so the rollout
of step t samples the weights of step t - k (t - k' with k' < k in the first k steps and right
after a guard rollback, which resets the queue to the rolled-back weights: lag 0). A resume, a
replay and an uninterrupted run choose the same versions."""

from __future__ import annotations

import contextlib
import copy
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
from verl_core.agent.loops import (agent_metrics, agent_name_of, default_loop, loop_kwargs,
                                   run_agent_loops, stored_with_agents, uses_agent_loops,
                                   verl_view)
from verl_core.reward.scoring import turn_extra_info
from verl_core.rollout.multi_turn import (MultiTurnOutput, concat_turn_outputs, generate_turns,
                                          row_interactions, turn_limits, turn_metrics)
from verl_core.seeds import derive_seed
from verl_core.training.dist import DataParallel

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Prefetch:
    """The rollout of ``step`` sampling in a background thread from the behaviour weights of
    ``version`` (the state after ``version`` updates) while the phases before it run."""

    step: int
    plan: list[int]  # the versions it samples with, oldest first (one without partial rollout)
    thread: threading.Thread
    box: dict  # "out": (batch, metrics), or "error"; "span": (start, end) perf_counter times


@dataclasses.dataclass
class _Slot:
    """A sampler process beyond the first (``rollout.async_samplers``) and the behaviour model
    it samples with: a copy of its own in shared memory, holding one version at a time."""

    model: torch.nn.Module
    lock: threading.Lock
    held: int | None = None  # the version :attr:`model` holds
    sampler: object | None = None  # its SamplerProcess, started at its first rollout


class Cancelled(Exception):
    """A background rollout given up: the state it belongs to changed."""


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
        self.queue: list[tuple[int, dict | None]] = []
        """Off-policy: the versions the next rollouts sample with, oldest first (at most
        :attr:`lag`), each with its weights (a copy; with ``lag`` 1 None: :attr:`model` holds
        the one version)."""
        self._held = 0  # the version :attr:`model` holds now
        self._keys = None  # the model's state keys (a version's copy holds these)
        self._lock = threading.Lock()  # the queue, between the worker and a background rollout
        self._pushed = threading.Condition(self._lock)  # a version joined the queue
        self._cancel = False  # the background rollouts are being dropped
        # the behaviour model and engine: one user at a time (a background rollout while it
        # samples, the worker's own sampling, loads and evaluation otherwise)
        self._model_lock = threading.RLock()
        self.partial = bool(cfg.rollout.partial_rollout)
        # with W > 1 workers the actor is sharded (FSDP2) and rollout runs on a full copy of it,
        # refreshed from the shards after every change; off-policy, the copy is the behaviour
        # policy, which takes the actor's weights only when told (push)
        if dp.distributed or self.lag or actor is None:
            self.model = load_causal_lm(assets.model_path, cfg.model.dtype).to(device)
        else:
            self.model = actor.model
        self._stale = False  # on-policy: the copy is behind the actor (an update ran)
        self._engine_stale = False  # off-policy: the engine's own copy (vllm) is not current
        self._actor_engine = None  # off-policy with hf: evaluation samples the actor itself
        self._prefetch: dict[int, Prefetch] = {}  # by step; one after another per sampler
        # the newest background rollout of each sampler (0: the worker's thread or the first
        # sampler process; j >= 1: rollout.async_samplers' others)
        self._last: dict[int, threading.Thread] = {}
        self._sampler = None  # rollout.async_mode=process: the SamplerProcess (started lazily)
        self._slots: dict[int, _Slot] = {}  # rollout.async_samplers > 1: the others
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
        self.reset(0)  # off-policy: a LoRA policy's merged weights, else the same copy

    def stop(self) -> None:
        """Wait for a background rollout (dropping it) and end the sampler process."""
        self.drop_prefetch()
        sampler, self._sampler = self._sampler, None
        if sampler is not None:
            sampler.close()
        for slot in self._slots.values():
            if slot.sampler is not None:
                slot.sampler.close()
                slot.sampler = None

    def close(self) -> None:
        self.stop()
        self.engine.close()  # a vllm engine's processes (rollout.engine_own_process)

    # ------------------------------------------------------------------ weights
    @property
    def version(self) -> int:
        """The version the next rollout samples with: the oldest in the queue (off-policy; 0
        on-policy, where the weights are the live ones)."""
        with self._lock:
            return self.queue[0][0] if self.queue else 0

    def versions(self) -> list[int]:
        """The versions the next rollout may sample with, oldest first (off-policy)."""
        with self._lock:
            return [v for v, _ in self.queue]

    def plan(self) -> list[int]:
        """The versions the next rollout samples with: the oldest alone, or with
        ``rollout.partial_rollout`` all of them (segment j with the j-th); [0] on-policy."""
        got = self.versions() or [0]
        return got if self.partial else got[:1]

    def _actor_weights(self) -> dict:
        """The actor's weights as a plain model's state dict (a LoRA policy's merged): with
        W > 1 gathered from the FSDP shards on every worker (a collective on the default group:
        called from the main thread, by every worker in the same order)."""
        return self.actor.gathered_merged_state() if self.dp.distributed \
            else self.actor.merged_state()

    def reset(self, version: int) -> None:
        """Off-policy: the queue becomes the actor's current weights alone, as ``version`` (the
        start, a rollback, a load without behaviour weights): the next rollout samples them,
        lag 0. Background rollouts of the weights held before are dropped."""
        if not self.lag or self.actor is None:
            return
        self.drop_prefetch()
        weights = self._actor_weights()
        with self._model_lock:
            self.model.load_state_dict(weights)
            self.changed()
            self._held = version
        with self._lock:
            self.queue = [(version, None if self.lag == 1 else self._copy(weights))]
            self._pushed.notify_all()

    def push(self, version: int) -> None:
        """Off-policy, update ``version`` starts: the actor's current weights (the state after
        ``version`` updates) join the queue as ``version``, and the oldest leaves it once it
        holds more than :attr:`lag` (a version already newest is not pushed twice). With ``lag``
        1 the copy takes them in place, after any background rollout of the old ones finished.
        Background rollouts of the versions kept are kept."""
        if not self.lag or self.actor is None:
            return
        if self.queue and self.queue[-1][0] == version:
            return
        if self.lag == 1:  # the queue of one is the actor's weights alone: a reset
            self.reset(version)
            return
        entry = (version, self._copy(self._actor_weights()))
        with self._lock:
            self.queue = (self.queue + [entry])[-self.lag:]
            self._pushed.notify_all()  # a partial rollout waiting for it goes on

    def _copy(self, weights: dict) -> dict:
        """A version's own copy, keyed as the behaviour model's checkpoint group."""
        if self._keys is None:
            self._keys = list(model_state(self.model))
        return {k: weights[k].detach().clone() for k in self._keys}

    def _hold(self, version: int) -> None:
        """Make :attr:`model` hold the weights of ``version`` (its user holds the model lock:
        :meth:`_using`)."""
        if self.actor is None or not self.lag or version == self._held:
            return
        with self._lock:
            weights = dict(self.queue).get(version)
        if weights is None:
            raise RuntimeError(f"the behaviour weights of version {version} are not held (the "
                               f"queue holds {self.versions()}, the model {self._held})")
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, weights)
        self.changed()
        self._held = version

    @contextlib.contextmanager
    def holding(self, version: int):
        """The behaviour model with the weights of ``version`` (the rollout phase's per-token
        inputs of a batch sampled with them), no background rollout sampling meanwhile."""
        with self._model_lock:
            self._hold(version)
            yield self.model

    def _wait_for(self, version: int) -> None:
        """A partial rollout's next segment samples with ``version``: wait until it joined the
        queue (its update began), or raise :class:`Cancelled` when the rollouts are dropped or
        the version left the queue (a newer one is there: it will not come again; the rollout
        was never taken, its rollout phase a cache hit)."""
        with self._pushed:
            while not self._cancel and version not in [v for v, _ in self.queue] \
                    and not (self.queue and version < self.queue[-1][0]):
                self._pushed.wait()
            if self._cancel or version not in [v for v, _ in self.queue]:
                raise Cancelled(f"version {version}")

    def changed(self) -> None:
        """The behaviour weights changed (a push, a load, or another process's push into
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
        Off-policy the weights change only by :meth:`push`, :meth:`reset` (or a load): the engine follows."""
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
        """The engine that samples the current policy (the evaluation's), while no background
        rollout samples (they share the tool host, and the engine): the rollout
        engine on-policy; off-policy, where that one holds the behaviour policy, an ``hf``
        engine over the actor, or the rollout engine (vllm) given the actor's weights until the
        next rollout gives it the behaviour policy's back."""
        with self._model_lock:
            yield from self._policy_engine()

    def _policy_engine(self):
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
        """Off-policy: the queue (every version a rollout still samples with): the oldest's
        weights as ``behaviour`` with its step (``meta["behaviour_step"]``), and with ``lag`` > 1
        the others as ``behaviour_1`` .. and every version (``meta["behaviour_versions"]``);
        on-policy nothing (they are the actor's). No optimizer."""
        if not self.lag:
            return {}, {}
        if self.lag == 1:
            return {"behaviour": model_state(self.model)}, {"behaviour_step": self.version}
        with self._lock:
            queue = list(self.queue)
        groups = {("behaviour" if i == 0 else f"behaviour_{i}"): w
                  for i, (_, w) in enumerate(queue)}
        return groups, {"behaviour_step": queue[0][0],
                        "behaviour_versions": [v for v, _ in queue]}

    def load_targets(self) -> dict:
        """Where a load puts the behaviour weights: the model for the oldest version (in place),
        new tensors for the others; a background rollout reading them is waited for and
        dropped first."""
        self.drop_prefetch()
        if not self.lag:
            return {}
        out = {"behaviour": model_state(self.model)}
        for i in range(1, self.lag):
            out[f"behaviour_{i}"] = {k: torch.empty_like(v) for k, v in out["behaviour"].items()}
        return out

    def load_state_dict(self, groups: dict, meta: dict, step: int) -> None:
        """After a load of the state of ``step``: off-policy, the queue of the checkpoint, or
        (an on-policy run's checkpoint) the loaded actor's weights alone: the first rollout
        samples its own state."""
        self._stale = True
        if not self.lag:
            return
        if "behaviour" not in groups:
            self.reset(step)
            return
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, groups["behaviour"])
        self.changed()
        versions = [int(v) for v in meta.get("behaviour_versions",
                                             [meta.get("behaviour_step", step)])]
        self._held = versions[0]
        if self.lag == 1:
            queue = [(versions[0], None)]
        else:
            queue = [(v, self._copy(groups["behaviour"] if i == 0 else groups[f"behaviour_{i}"]))
                     for i, v in enumerate(versions)]
        with self._lock:
            self.queue = queue

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
                       engine=None, turn_context=None) -> MultiTurnOutput:
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
        prompts = [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in mine]

        def tool_turns(sub: list[int]) -> MultiTurnOutput:  # the built-in tool loop's rows
            return generate_turns(
                engine or self.engine, p.tokenizer, [prompts[j] for j in sub], params,
                host=p.tool_host, tools=p.tool_schemas, rows=[rows[mine[j]] for j in sub],
                tools_kwargs=[(rows_data[mine[j]].extra_info or {}).get("tools_kwargs")
                              for j in sub],
                **turn_limits(rc), instance_prefix=f"{phase}:{params.seed}",
                turn_context=turn_context,
                interactions=row_interactions(p, [rows_data[mine[j]] for j in sub]))
        if not uses_agent_loops(rc, rows_data):
            out = tool_turns(list(range(len(mine))))  # as before agent loops existed
        else:
            out = run_agent_loops(
                engine or self.engine, p.tokenizer, prompts, params,
                rows=[rows[i] for i in mine],
                names=[agent_name_of(rows_data[i]) or default_loop(rc) for i in mine],
                config_path=rc.agent_loop_config_path,
                row_kwargs=[loop_kwargs(rows_data[i]) for i in mine], tool_turns=tool_turns,
                host=p.tool_host, tool_schemas=p.tool_schemas,
                prefix=f"{phase}:{params.seed}:loop", timeout_s=rc.agent_loop_timeout_s,
                trainer_config=verl_view(self.cfg))
        if split:
            parts = self._sample_dp.gather_objects((out, getattr(out, "agents", None)))
            out = concat_turn_outputs([o for o, _ in parts], p.tokenizer.pad_token_id)
            if parts[0][1] is not None:
                object.__setattr__(out, "agents", [a for _, got in parts for a in got])
        return out

    def _agent_episodes(self, prompt_ids, prompt_mask, params: SamplingParams, rows: list):
        """``rollout.openai_agent``'s rollout (``agent/openai_server.agent_rollout``) of the N
        rows: each episode's first prompt, left-padded (N, P'), the responses, the rows'
        ``extra_info`` and the metrics. With W > 1 each worker runs its block's episodes."""
        from verl_core.agent.openai_server import agent_rollout
        from verl_core.rollout.multi_turn import _left_pad
        self.ready()
        n, tok = prompt_ids.shape[0], self.prompts.tokenizer
        split = self.dp.distributed
        mine = self.dp.block(torch.arange(n)).tolist() if split else list(range(n))
        got = agent_rollout(self.engine, tok, [prompt_ids[i][prompt_mask[i].bool()].tolist()
                                               for i in mine],
                            [rows[i] for i in mine], params, self.cfg.rollout,
                            self.cfg.data.max_prompt_length, rows_index=mine)
        parts = self._sample_dp.gather_objects(got) if split else [got]
        first = [p for part in parts for p in part[0]]
        out = concat_turn_outputs([part[1] for part in parts], tok.pad_token_id)
        infos = [i for part in parts for i in part[2]]
        metrics = {k: sum(part[3][k] for part in parts)  # errors summed, means averaged
                   / (1 if k == "agent/errors" else len(parts)) for k in parts[0][3]}
        ids, mask = _left_pad(first, tok.pad_token_id)  # (N, P') each episode's first prompt
        return ids, mask, out, infos, metrics

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

    def sample(self, step: int, idx: list[int], kl_coef: float, phase: str = "rollout",
               version: int | None = None,
               plan: list[int] | None = None) -> tuple[Batch, dict]:
        """G responses for each prompt of dataset indices ``idx`` (B,) from the behaviour
        weights of ``version`` (off-policy; default the next rollout's), or with
        ``rollout.partial_rollout`` the versions of ``plan`` (oldest first, default
        :meth:`plan`) segment by segment, seeded by (seed, step, ``phase``), with one greedy
        response per prompt when the estimator asks for it (``needs_greedy_baseline``, ReMax):
        the batch (groups 0..B-1 in the order of ``idx``; ``meta["kl_coef"]``: ``kl_coef``) and
        the rollout metrics."""
        plan = [version] if version is not None else list(plan or self.plan())
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
        loops = uses_agent_loops(rc, rows)
        if rc.multi_turn or loops:
            # VERL_FAULTS' tool_call point: in this step's calls, once sent (a no-op without it)
            hosts = [h for h in (p.tool_host, p.interaction_host) if h is not None]
            for h in hosts:  # the users' calls too (p.interaction_host: simulated users)
                h.on_calls_sent = functools.partial(faults.maybe_inject, "tool_call", step)
            used: list[int] = []
            try:
                with self._using(plan[0]):
                    out = self.generate_turns(
                        p.train_ids[rows_idx], p.train_mask[rows_idx], params,
                        list(range(len(rows))), rows, phase,
                        turn_context=functools.partial(self._turn, plan, used)
                        if self.partial else None)
            finally:
                for h in hosts:
                    h.on_calls_sent = None
            extra = {"response_attention_mask": out.attention_mask,
                     "turns": stored_with_agents(out)}
            if self.partial:
                extra["meta"] = {"partial_versions": used, "partial_unit": "turn"}
                metrics["rollout/partial_segments"] = float(len(used))
            metrics.update(turn_metrics(out))
            metrics.update(agent_metrics(extra["turns"]))
            infos = turn_extra_info(infos, extra["turns"])
        elif rc.openai_agent:  # an agent function drives each row's episode over HTTP
            with self._using(plan[0]):
                prompt_ids, prompt_mask, out, infos, episode_metrics = self._agent_episodes(
                    p.train_ids[rows_idx], p.train_mask[rows_idx], params, rows)
            extra = {"response_attention_mask": out.attention_mask, "turns": out.stored_turns(),
                     "prompt_ids": prompt_ids, "prompt_mask": prompt_mask}
            metrics.update(episode_metrics)
        elif self.partial:
            out, used = self._generate_partial(p.train_ids[rows_idx], p.train_mask[rows_idx],
                                               params, plan)
            extra["meta"] = {"partial_versions": used,
                             "partial_segment_tokens": self.segment_tokens}
            metrics["rollout/partial_segments"] = float(len(used))
        else:
            with self._using(plan[0]):
                out = self.generate(p.train_ids[rows_idx], p.train_mask[rows_idx], params)
        dt = time.perf_counter() - t0
        if self.cfg.algorithm.estimator_traits.needs_greedy_baseline:
            t1 = time.perf_counter()
            with self._using(plan[0]):
                greedy = self.generate_greedy(p.train_ids[idx], p.train_mask[idx])
            prompt_of_row = torch.arange(len(idx)).repeat_interleave(G)  # (N,) row -> prompt b
            extra.update({"baseline_response_ids": greedy.response_ids[prompt_of_row],  # (N, T_b)
                          "baseline_response_mask": greedy.response_mask[prompt_of_row]})
            metrics["rollout/greedy_time_s"] = time.perf_counter() - t1
            metrics["rollout/greedy_length_mean"] = float(greedy.response_mask.sum()) / len(idx)
        batch = Batch(
            prompt_ids=extra.pop("prompt_ids", p.train_ids[rows_idx]),
            prompt_mask=extra.pop("prompt_mask", p.train_mask[rows_idx]),
            response_ids=out.response_ids, response_mask=out.response_mask,
            response_logprobs=out.logprobs,
            group=torch.arange(len(idx)).repeat_interleave(G),
            uid=[str(r.index) for r in rows], ground_truth=[r.ground_truth for r in rows],
            data_source=[r.data_source for r in rows], extra_info=infos,
            pad_id=p.tokenizer.pad_token_id,
            meta={"step": step, "kl_coef": kl_coef, **extra.pop("meta", {})}, **extra)
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

    @contextlib.contextmanager
    def _using(self, version: int):
        """The behaviour model and engine, holding the weights of ``version``, for one user."""
        with self._model_lock:
            self._hold(version)
            yield

    @contextlib.contextmanager
    def _turn(self, plan: list[int], used: list[int], k: int):
        """A multi-turn partial rollout's turn ``k``: sampled with the weights of ``plan[k]``
        (the last of ``plan`` once they run out), waited for with the model lock let go (the
        rollout holds it once, :meth:`sample`; the tool calls between turns are done), then
        held while the turn samples; ``used`` gets each turn's version."""
        version = plan[min(k, len(plan) - 1)]
        if version not in self.versions():
            self._model_lock.release()
            try:
                self._wait_for(version)
            finally:
                self._model_lock.acquire()
        self._hold(version)
        self.ready()
        used.append(version)
        yield

    @property
    def segment_tokens(self) -> int:
        """``rollout.partial_rollout``: the tokens of one segment, ceil(max_new_tokens / k)."""
        return -(-self.cfg.rollout.max_new_tokens // self.lag)

    def _generate_partial(self, prompt_ids, prompt_mask, params: SamplingParams,
                          plan: list[int]) -> tuple[GenerationOutput, list[int]]:
        """``rollout.partial_rollout``: the N responses in k segments of
        :attr:`segment_tokens` tokens, segment j from the weights of ``plan[j]`` (the last of
        ``plan`` once they run out: a queue shortened by a reset), each waited for (its update
        begins) and held while the segment samples. A segment re-reads each unfinished row's
        prompt and tokens so far with its weights (a prefill: no KV cache of older weights is
        reused) and samples on with its own seed per (row, segment), so a row's tokens depend
        on the plan and the seeds only: a replay samples them again. Returns the output (each
        token's log-prob from the weights that sampled it) and the versions the segments
        used."""
        eos = set(stop_token_ids(self.prompts.tokenizer))
        pad = self.prompts.tokenizer.pad_token_id
        n, T, L = prompt_ids.shape[0], params.max_new_tokens, self.segment_tokens
        prompts = [prompt_ids[i][prompt_mask[i].bool()].tolist() for i in range(n)]
        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        done, used = [False] * n, []
        for j in range(self.lag):
            active = [i for i in range(n) if not done[i] and len(ids[i]) < T]
            if not active:
                break
            version = plan[min(j, len(plan) - 1)]
            self._wait_for(version)
            seqs = [prompts[i] + ids[i] for i in active]
            width = max(map(len, seqs))
            seg_ids = torch.full((len(active), width), pad, dtype=torch.long)
            seg_mask = torch.zeros((len(active), width), dtype=torch.long)
            for a, seq in enumerate(seqs):  # left-padded, as the engines take prompts
                seg_ids[a, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
                seg_mask[a, width - len(seq):] = 1
            limits = [min(L, T - len(ids[i])) for i in active]
            with self._using(version):
                self.ready()
                out = self.engine.generate(
                    seg_ids, seg_mask, dataclasses.replace(params, max_new_tokens=max(limits)),
                    row_seeds=[derive_seed(params.seed, i, f"segment-{j}") for i in active],
                    row_limits=limits)
            used.append(version)
            for a, i in enumerate(active):
                m = out.response_mask[a].bool()
                got = out.response_ids[a][m].tolist()
                ids[i] += got
                lps[i] += out.logprobs[a][m].tolist()
                done[i] = len(got) < limits[a] or bool(got) and got[-1] in eos
        width = max(1, max(map(len, ids)))
        out_ids = torch.full((n, width), pad, dtype=torch.long)
        out_mask = torch.zeros((n, width), dtype=torch.float32)
        out_lp = torch.zeros((n, width), dtype=torch.float32)
        for i in range(n):
            out_ids[i, :len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
            out_mask[i, :len(ids[i])] = 1.0
            out_lp[i, :len(ids[i])] = torch.tensor(lps[i], dtype=torch.float32)
        return GenerationOutput(response_ids=out_ids, response_mask=out_mask,
                                logprobs=out_lp), used

    def rollout(self, step: int, idx: list[int], kl_coef: float) -> tuple[Batch, dict]:
        """The rollout of ``step`` (prompts ``idx``) from the behaviour weights of
        :attr:`version`: off-policy, taken from the background rollout an update before started
        when there is one (:meth:`follow`), else sampled now; the same bytes either way (every
        draw is seeded by (seed, step, row)). Off-policy batches record
        ``meta["policy_version"]``; the metrics say how far behind the weights were
        (``rollout/staleness``)."""
        got = self.take(step)
        if got is None:
            batch, metrics = self.sample(step, idx, kl_coef)
            if self.lag:
                metrics["rollout/prefetched"] = 0.0
        else:
            batch, metrics = got
        return self.stamp(step, batch, metrics, kl_coef)

    def stamp(self, step: int, batch: Batch, metrics: dict,
              kl_coef: float) -> tuple[Batch, dict]:
        """Off-policy: ``batch`` of ``step`` records the version it was sampled with
        (``meta["policy_version"]``) and the live KL coefficient; ``rollout/staleness``."""
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
    def follow(self, step: int, job_for=None) -> bool:
        """Update ``step`` starts. Off-policy, the live state joins the queue (:meth:`push`) and
        every rollout of steps step + 1 .. step + :attr:`lag` whose first version is now in the
        queue and which is not sampling yet starts in the background, one after another, while
        the update (and the phases after it) run: ``job_for(t)`` gives the job of step t (a
        callable taking the plan, the versions it samples with, returning ``(batch,
        metrics)``; :meth:`rollout_job`), or None (past the last step; a step whose prompts are
        not known yet). True when off-policy: the caller then does not trust the live state
        until the update is recorded (a retry or a failure rebuilds it, with its behaviour
        policy)."""
        if not self.lag:
            return False
        self.push(step)
        if job_for is None:
            return True
        for t in range(step + 1, step + self.lag + 1):
            if t in self._prefetch:
                continue
            job = job_for(t)
            if job is not None:
                self._start_prefetch(t, self.plan_of(step, t), job)
        return True

    def plan_of(self, step: int, t: int) -> list[int]:
        """The plan of the rollout of ``t`` (:meth:`plan`), unless the queue is reset before:
        the last :attr:`lag` versions once updates step + 1 .. t - 1 pushed theirs."""
        seen = self.versions() + list(range(step + 1, t))
        got = seen[max(0, len(seen) - self.lag):]
        return got if self.partial else got[:1]

    def rollout_job(self, step: int, idx: list[int]):
        """The job of a background rollout of ``step`` (prompts ``idx``, chosen by the caller:
        the data sampler is not touched in the background): a thread of this worker
        (``rollout.async_mode=thread``), or the sampler process (``process``), whose model is
        this one's, in shared memory (held for it meanwhile)."""
        kl_coef = self.actor.kl_ctrl.value
        if self.cfg.rollout.async_mode != "process":
            return lambda plan: self.sample(step, idx, kl_coef, plan=plan)
        from verl_core.parts.sampler_process import SamplerProcess

        # rollout.async_samplers: step t on sampler t mod n (which one changes no byte)
        j = step % self.cfg.rollout.async_samplers
        if j == 0:
            if self._sampler is None:
                self._sampler = SamplerProcess(json.dumps(self.cfg.to_dict()), self.assets,
                                               self.model, type(self))
            sampler, using = self._sampler, self._using
        else:
            slot = self._slots.get(j)
            if slot is None:
                # a copy of its own: the worker's behaviour model holds one version at a time,
                # and this sampler samples another one beside it
                slot = self._slots[j] = _Slot(copy.deepcopy(self.model), threading.Lock())
            if slot.sampler is not None and not slot.sampler.proc.is_alive():
                dead, slot.sampler = slot.sampler, None  # died since: a new one
                dead.close()
            if slot.sampler is None:
                slot.sampler = SamplerProcess(json.dumps(self.cfg.to_dict()), self.assets,
                                              slot.model, type(self))
            sampler, using = slot.sampler, functools.partial(self._slot_using, slot)

        def job(plan):
            with using(plan[0]):
                return sampler.sample(step, idx, plan[0])
        job.sampler = j
        return job

    @contextlib.contextmanager
    def _slot_using(self, slot: _Slot, version: int):
        """``slot``'s model holding the weights of ``version`` (a copy in the queue: with
        ``rollout.async_samplers`` > 1 the lag is >= 2), for its sampler process."""
        with slot.lock:
            if slot.held != version:
                with self._lock:
                    weights = dict(self.queue).get(version)
                if weights is None:
                    raise RuntimeError(f"the behaviour weights of version {version} are not "
                                       f"held (the queue holds {self.versions()})")
                from torch.distributed.checkpoint.state_dict import set_model_state_dict

                set_model_state_dict(slot.model, weights)  # in place: the child's aliases
                slot.held = version
            yield

    def _start_prefetch(self, step: int, plan: list[int], job) -> None:
        """Start ``job`` (the rollout of ``step`` from the weights of ``plan``) in a background
        thread, after the background rollout started before it. A job only reads the behaviour
        weights (the model, while it holds the model lock), the prompts and the tool host, and
        draws only from its own seeded generators."""
        box: dict = {}
        j = getattr(job, "sampler", 0)  # after the rollout started before it on its sampler
        before = self._last.get(j)

        def body():
            if before is not None:
                before.join()
            t0 = time.perf_counter()
            try:
                if self._cancel:
                    raise Cancelled(f"step {step}")
                faults.maybe_inject("background_rollout", step)  # a VERL_FAULTS drill
                batch, metrics = job(plan)
                box["out"] = (batch, {**metrics, "rollout/prefetched": 1.0})
            except BaseException as e:  # noqa: BLE001 - reported where the rollout is taken
                box["error"] = e
            box["span"] = (t0, time.perf_counter())

        thread = threading.Thread(target=body, name=f"verl-rollout-step-{step}", daemon=True)
        self._prefetch[step] = Prefetch(step=step, plan=list(plan), thread=thread, box=box)
        self._last[j] = thread
        thread.start()

    def take(self, step: int) -> tuple[Batch, dict] | None:
        """The background rollout of ``step`` from the plan it samples with now, waited for;
        None when there is none (or it failed, or it sampled other weights: the phase samples
        again, and raises if that fails too). Those of earlier steps are dropped."""
        for s in [s for s in self._prefetch if s < step]:
            self._prefetch.pop(s).thread.join()
        p = self._prefetch.pop(step, None)
        if p is None:
            return None
        t0 = time.perf_counter()
        p.thread.join()
        if p.plan != self.plan():
            return None
        if "error" in p.box:
            log.warning("the background rollout of step %d failed (%s); sampling it again",
                        step, p.box["error"])
            if self._sampler is not None and not self._sampler.proc.is_alive():
                sampler, self._sampler = self._sampler, None  # the next one starts a new one
                sampler.close()
            for slot in self._slots.values():
                if slot.sampler is not None and not slot.sampler.proc.is_alive():
                    sampler, slot.sampler = slot.sampler, None
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
        """Give up the background rollouts (the state they belong to is changing): a partial
        rollout waiting for a version stops waiting, the others are waited for (a thread cannot
        be stopped half-way; they only ever read the behaviour weights, which is why they are
        waited for before those change), and their results are discarded."""
        if self._last:
            with self._pushed:
                self._cancel = True
                self._pushed.notify_all()
            for last in self._last.values():  # each sampler's newest: it joined those before
                last.join()
            with self._lock:
                self._cancel = False
        self._prefetch.clear()
        self._last = {}
