"""The ``rollout`` section of :class:`~verl_core.config.RunConfig`: how responses are sampled and
the engines' memory (``hf`` or ``vllm``), beside the engines. Composed into the run, checked
against the other sections and hashed in ``verl_core/config.py``, where the demo's temperature
and the presets are.
"""

from __future__ import annotations

from dataclasses import dataclass

from verl_core.config_fields import (_check_types, _fail, _non_negative, _one_of, _positive,
                                     in_trajectory, not_in_trajectory)
from verl_core.rollout.registry import engine_names


def _multi_turn_on(run) -> bool:
    """``rollout.multi_turn`` off: the multi-turn fields do nothing, and the run hashes as
    before they existed."""
    return run.rollout.multi_turn


def _openai_on(run) -> bool:
    """``rollout.openai_agent`` unset: its fields do nothing, and the run hashes as before they
    existed."""
    return bool(run.rollout.openai_agent)


def _agent_loops_on(run) -> bool:
    """No agent loop configured: the run hashes as before the fields existed."""
    return bool(run.rollout.agent_loop or run.rollout.agent_loop_config_path)


def _staleness_on(run) -> bool:
    """``rollout.max_staleness`` 0: on-policy, and the run hashes as before the field existed."""
    return run.rollout.max_staleness > 0


def _partial_on(run) -> bool:
    """``rollout.partial_rollout`` off: the run hashes as before the field existed."""
    return run.rollout.partial_rollout


_TRUNCATE_SIDES = {"left", "right", "middle"}
MAX_STALENESS = 4
"""The largest ``rollout.max_staleness`` offered (docs/async.md): each version in flight is one
more copy of the weights in memory and in every checkpoint."""


@dataclass(frozen=True)
class RolloutConfig:
    """Sampling of responses."""

    engine: str = in_trajectory("hf")
    """Rollout engine: ``hf`` (torch, CPU and GPU) or ``vllm`` (vLLM in the worker: on a CUDA GPU
    with ``pip install -e '.[vllm]'``, or on CPU with vLLM's CPU backend, ``bash .ci/install
    vllm``; checked when the run is prepared and when the engine is built)."""
    n: int = in_trajectory(8)
    """G: responses sampled per prompt (GRPO/RLOO need G > 1)."""
    temperature: float = in_trajectory(1.0)
    """Sampling temperature; 0 means greedy. Log-probs and the loss use the same temperature.
    1.0 is verl's default and ours for a model you bring; the built-in demo (no ``model.path``)
    samples at :data:`DEMO_TEMPERATURE` unless this is set (see :func:`grpo_preset`)."""
    top_p: float = in_trajectory(1.0)
    """Nucleus sampling mass in (0, 1]; 1 disables it."""
    top_k: int = in_trajectory(-1)
    """Keep the k most likely tokens; -1 disables it (verl's convention)."""
    max_new_tokens: int = in_trajectory(8)
    """T: most response tokens; generation stops earlier at EOS."""
    micro_batch_size: int = not_in_trajectory(512)
    """Sequences per generation forward pass (memory only; results do not depend on it)."""
    gpu_memory_utilization: float = in_trajectory(0.5)
    """vLLM on a GPU only: fraction of GPU memory for weights + KV cache. (vLLM's CPU backend
    would take this fraction of the machine's RAM; there ``cpu_kv_cache_gib`` sizes it.)"""
    cpu_kv_cache_gib: float = in_trajectory(0.5)
    """vLLM on CPU only: GiB of RAM for the KV cache (vLLM's ``kv_cache_memory_bytes``), set
    here so it never follows the machine's RAM. A token of cache takes 2 x layers x KV heads x
    head size x dtype bytes (1 KiB for the tiny model in float32: 0.5 GiB holds 512k tokens;
    56 KiB for Qwen2.5-7B in bfloat16: ~9k); vLLM refuses to start when one
    ``data.max_prompt_length + rollout.max_new_tokens`` sequence does not fit."""
    val_do_sample: bool = not_in_trajectory(False)
    """Held-out evaluation samples (verl's ``rollout.val_kwargs.do_sample``) with ``val_temperature``,
    ``val_top_p`` and ``val_top_k``, seeded by the run's seed and the step, so an evaluation is
    reproducible and a replayed phase gives the same numbers. False: greedy (the default)."""
    val_temperature: float = not_in_trajectory(0.0)
    """Evaluation temperature with ``val_do_sample`` (0 is greedy: verl's default)."""
    val_top_p: float = not_in_trajectory(1.0)
    """Evaluation nucleus mass with ``val_do_sample``."""
    val_top_k: int = not_in_trajectory(-1)
    """Evaluation top-k with ``val_do_sample`` (-1: off)."""
    val_n: int = not_in_trajectory(1)
    """Responses per held-out prompt with ``val_do_sample``: ``val/accuracy`` is the mean over
    all of them (verl's ``mean@n``) and ``val/best@n`` the mean of each prompt's best score."""
    max_num_seqs: int = not_in_trajectory(0)
    """Sequences in flight at once (verl's ``rollout.max_num_seqs``): vLLM's ``max_num_seqs``;
    the hf engine's sequences per generation pass (in place of ``micro_batch_size``). 0: the
    engine's default. Memory and speed only."""
    max_model_len: int = not_in_trajectory(0)
    """vLLM's context length (verl's ``rollout.max_model_len``); 0: ``data.max_prompt_length +
    rollout.max_new_tokens``, the longest sequence a run asks for (a shorter one is refused)."""
    enable_chunked_prefill: bool = not_in_trajectory(True)
    """vLLM on a GPU: split long prefills over scheduler steps (verl's
    ``rollout.enable_chunked_prefill``); vLLM's CPU backend always runs without (a seeded request
    split over two steps fails there). The hf engine prefills whole prompts."""
    enforce_eager: bool = in_trajectory(True)
    """vLLM only: run without CUDA graphs (faster start, less memory, slower decoding)."""
    free_cache_engine: bool = in_trajectory(True)
    """vLLM only: sleep after each generation (KV cache freed, weights offloaded to CPU) so
    training gets the GPU memory back; False keeps vLLM resident."""
    engine_own_process: bool = not_in_trajectory(False)
    """vLLM only: run vLLM's engine core in a process of its own (vLLM's V1 multiprocessing),
    watched: an engine that dies or hangs mid-call is killed, rebuilt with the weights it held,
    and the call made again with the same seeds (docs/vllm.md#engine-health); ~15 s more to
    build on 2 CPU cores, the weights serialised once per sync. False runs it in the worker's
    process (verl's colocated mode), where a dead engine takes the worker with it (a resume's
    case) and a hang is ``guard.phase_timeout_s``'s. W > 1 workers always run it in their own
    process (vLLM's external launcher)."""
    engine_timeout_s: float = not_in_trajectory(0.0)
    """vLLM in its own process: the deadline of one call into the engine (a ``generate``, a
    weight load); past it the engine counts as hung, is killed and rebuilt. 0: derived from the
    work asked: 300 s + 0.1 s per token (prompts and ``max_new_tokens`` of all the call's rows)
    + 0.1 s per MiB of weights loaded, loose enough for any working engine; set it to a few
    times a measured rollout's time to catch hangs sooner."""
    engine_max_restarts: int = not_in_trajectory(2)
    """vLLM in its own process: rebuilds of a dead or hung engine within one call (a rollout's
    ``generate``, a turn's, a weight load); one more failure raises ``RolloutEngineError``
    (transient: the phase is retried). Each rebuild is counted: ``rollout/engine_restarts``,
    the guard's ``engine_restarts`` and a guard event."""
    multi_turn: bool = in_trajectory(False, when=_multi_turn_on)
    """Multi-turn rollouts with tool calls (verl's ``multi_turn.enable``,
    ``rollout/multi_turn.py``, docs/agent.md): a response is assistant turns and the tools'
    responses between them, ``max_new_tokens`` tokens in all; the loss reads the sampled
    tokens only. Needs ``tool_config_path``."""
    tool_config_path: str = in_trajectory("", when=_multi_turn_on)
    """verl's tool YAML (``multi_turn.tool_config_path``): ``tools: [{class_name, config,
    tool_schema}]``, ``class_name`` a dotted ``module.Class`` or ``path/to/file.py:Class``;
    ``builtin:calculator`` names the built-in calculator."""
    interaction_config_path: str = in_trajectory("", when=_multi_turn_on)
    """verl's interaction YAML (``multi_turn.interaction_config_path``): ``interaction: [{name,
    class_name, config}]``, simulated users that answer an assistant turn without a tool call
    (``agent/interactions.py``, docs/agent.md); ``builtin:guess`` names the guessing game's
    scripted user. A row picks one by ``extra_info.interaction_kwargs.name``."""
    max_assistant_turns: int = in_trajectory(0, when=_multi_turn_on)
    """Most assistant turns per response; 0: until a turn makes no call or the budget is spent
    (verl's null)."""
    max_user_turns: int = in_trajectory(0, when=_multi_turn_on)
    """Most tool-response turns per response (verl counts them as user turns); 0: no limit."""
    max_parallel_calls: int = in_trajectory(1, when=_multi_turn_on)
    """Tool calls of one turn that run (the first ones; verl's default 1); the rest are
    dropped."""
    max_tool_response_length: int = in_trajectory(256, when=_multi_turn_on)
    """A tool's response is cut to this many tokens (verl's marks show the cut)."""
    tool_response_truncate_side: str = in_trajectory("middle", when=_multi_turn_on)
    """Which part of a long tool response is dropped: ``left``, ``right`` or ``middle``."""
    max_staleness: int = in_trajectory(0, when=_staleness_on)
    """k: updates the rollout may lag behind the update that consumes its batch (docs/async.md):
    0 samples step t with the weights after t updates (on-policy, the default); k >= 1 samples
    step t with the weights after t - k updates (fewer in the first k steps and after a guard
    rollback), so the worker samples steps t + 1 .. t + k in the background while update t and
    the phases after it run (1: one-step off-policy; at most :data:`MAX_STALENESS`). Every batch
    records the version it was sampled with (``meta["policy_version"]``); the update refuses
    one that lags by more. Needs the behaviour-policy correction (``algorithm.rollout_is`` or
    ``policy_loss=bypass_mode``)."""
    partial_rollout: bool = in_trajectory(False, when=_partial_on)
    """With ``max_staleness`` = k >= 2: a response is sampled in k segments of
    ceil(``max_new_tokens`` / k) tokens, segment j with the j-th oldest version the rollout may
    use (t - k + j for step t, up to t - 1), so a background rollout that started on old weights
    goes on, at a fixed token boundary, with each newer version as its update begins (verl's
    ``async_training.partial_rollout``, AReaL's interruptible generation): each segment re-reads
    the tokens so far with the new weights, and every token's log-prob is the one of the
    weights that sampled it. A multi-turn rollout goes on by turns instead: turn j with the j-th
    version. The boundaries are fixed, so a replay samples the same tokens (docs/async.md)."""
    async_mode: str = not_in_trajectory("thread")
    """Where the background rollout of ``max_staleness`` runs: ``thread`` (a thread of the
    worker, sampling from its behaviour copy) or ``process`` (a sampler process of its own,
    whose behaviour weights are the worker's, in shared memory: no interpreter lock shared with
    the update). The same batches either way (docs/async.md)."""
    async_samplers: int = not_in_trajectory(1)
    """With ``async_mode=process`` and ``max_staleness`` = k >= 2: how many background rollouts
    sample at once, each in a sampler process of its own with its own copy of the behaviour
    weights (1: one after another, in one process). Up to k: the rollouts of steps t + 1 ..
    t + k may all be in flight. Worth it where a rollout is longer than a step and waits on
    something else than this machine's cores (tool calls, a sandbox, a judge): one rollout's
    waits are covered by another's generation. Each one more costs a copy of the weights and a
    process (its engine and tool host). The same batches whatever the number (docs/async.md)."""
    tool_timeout_s: float = in_trajectory(30.0, when=_multi_turn_on)
    """A tool call that takes longer gives the model a timeout observation (counted in
    ``tool_calls/timeouts``); the tool host is replaced and the calls it held up are served
    again on the new one (docs/agent.md)."""
    tool_budget_s: float = in_trajectory(600.0, when=_multi_turn_on)
    """Wall time a rollout phase may spend in tool calls; past it every further call gives a
    timeout observation at once (the phase, and the run, go on)."""

    openai_agent: str = in_trajectory("", when=_openai_on)
    """An agent function that drives each row's episode through an OpenAI-compatible endpoint
    served over the rollout engine (``agent/openai_server.py``, docs/agent.md): ``path/to/file.py:
    function`` or ``package.module.function``, called as ``agent(base_url, row) -> float | None``
    (or async) with any OpenAI client; the episode's tokens are recorded as sampled and its
    returned float is added to the row's score. "": off."""
    openai_agent_timeout_s: float = in_trajectory(300.0, when=_openai_on)
    """Wall time each episode's agent function may take; past it the episode scores 0, is counted
    in ``agent/errors`` and its endpoint refuses further requests."""
    openai_max_turns: int = in_trajectory(0, when=_openai_on)
    """Most completions per episode; 0: until ``max_new_tokens`` (sampled and appended ids of
    all turns) is spent."""
    openai_host: str = not_in_trajectory("127.0.0.1")
    """The address the endpoint binds (an ephemeral port): the loopback by default; on a cluster
    whose agents run in other pods, the pod's address (e.g. from ``POD_IP``)."""

    agent_loop: str = in_trajectory("", when=_agent_loops_on)
    """The agent loop of rows that name none (verl's ``agent.default_agent_loop``;
    ``agent/loops.py``, docs/agent.md): a registered name (``single_turn_agent``,
    ``tool_agent``, a name of ``agent_loop_config_path``), a dotted ``module.Class`` or
    ``path/to/file.py:Class`` on verl's ``AgentLoopBase`` contract; "" follows
    ``multi_turn`` (``tool_agent`` when on, else plain sampling), as before loops existed."""
    agent_loop_config_path: str = in_trajectory("", when=_agent_loops_on)
    """verl's ``agent.agent_loop_config_path``: a YAML list of ``{name, _target_}`` naming the
    loops rows may give in their ``agent_name``."""
    agent_loop_timeout_s: float = in_trajectory(60.0, when=_agent_loops_on)
    """A loop whose own code (not its waits on the engine or a tool) runs longer is given up
    on: its row scores 0 (``agent_loop/timeouts``), the run goes on."""

    @property
    def generation_batch(self) -> int:
        """Sequences per hf-engine generation pass: ``max_num_seqs`` when set, else
        ``micro_batch_size``."""
        return self.max_num_seqs or self.micro_batch_size

    def __post_init__(self):
        _check_types("rollout", self)
        _one_of("rollout", "engine", self.engine, engine_names())
        _positive("rollout", self, "n", "max_new_tokens", "micro_batch_size", "cpu_kv_cache_gib",
                  "val_n")
        for prefix in ("", "val_"):  # the rollout's sampling, then the evaluation's
            self._check_sampling(prefix)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            _fail("rollout", "gpu_memory_utilization", self.gpu_memory_utilization,
                  "must be in (0, 1]")
        self._check_multi_turn()
        _non_negative("rollout", self, "max_staleness", "max_num_seqs", "max_model_len",
                      "engine_timeout_s", "engine_max_restarts")
        _one_of("rollout", "async_mode", self.async_mode, {"thread", "process"})
        _positive("rollout", self, "async_samplers")
        if self.async_samplers > 1:
            if self.async_mode != "process":
                _fail("rollout", "async_samplers", self.async_samplers,
                      f"runs each background rollout in a sampler process of its own: it needs "
                      f"rollout.async_mode=process (it is {self.async_mode!r})")
            if self.async_samplers > self.max_staleness:
                _fail("rollout", "async_samplers", self.async_samplers,
                      f"at most rollout.max_staleness={self.max_staleness} background rollouts "
                      "are ever in flight (those of steps t + 1 .. t + k)")
        if self.max_staleness > MAX_STALENESS:
            _fail("rollout", "max_staleness", self.max_staleness,
                  f"at most {MAX_STALENESS} is offered: every update of lag is one more copy of "
                  "the weights held in memory and in every checkpoint (docs/async.md)")
        if self.val_n > 1 and not (self.val_do_sample and self.val_temperature > 0):
            _fail("rollout", "val_n", self.val_n, "greedy evaluation gives one response per "
                  "prompt; set val_do_sample=True and val_temperature > 0 to draw several")

    def _check_multi_turn(self) -> None:
        _non_negative("rollout", self, "max_assistant_turns", "max_user_turns")
        _positive("rollout", self, "max_parallel_calls", "max_tool_response_length",
                  "tool_timeout_s", "tool_budget_s", "agent_loop_timeout_s")
        _one_of("rollout", "tool_response_truncate_side", self.tool_response_truncate_side,
                _TRUNCATE_SIDES)
        _positive("rollout", self, "openai_agent_timeout_s")
        _non_negative("rollout", self, "openai_max_turns")
        if self.openai_agent and self.multi_turn:
            _fail("rollout", "openai_agent", self.openai_agent, "the agent drives the episodes "
                  "and calls its own tools; set rollout.multi_turn=False (the built-in tool "
                  "loop) or leave openai_agent empty")
        if self.openai_agent and (self.agent_loop or self.agent_loop_config_path):
            _fail("rollout", "openai_agent", self.openai_agent, "an agent function drives every "
                  "row's episode itself; it is not an agent loop: leave rollout.agent_loop and "
                  "agent_loop_config_path empty, or openai_agent")
        if not self.multi_turn:
            return
        if not self.tool_config_path and not self.interaction_config_path:
            _fail("rollout", "tool_config_path", "", "rollout.multi_turn=True needs the tools: "
                  "a verl tool YAML (or builtin:calculator), or simulated users "
                  "(rollout.interaction_config_path)")

    def _check_sampling(self, prefix: str) -> None:
        """``{prefix}temperature``, ``top_p`` and ``top_k``: one set of rules for both."""
        temperature = getattr(self, f"{prefix}temperature")
        if self.engine == "vllm" and temperature > 2.0:
            _fail("rollout", f"{prefix}temperature", temperature,
                  "vLLM accepts temperatures in [0, 2]; lower it or use rollout.engine='hf'")
        _non_negative("rollout", self, f"{prefix}temperature")
        top_p, top_k = getattr(self, f"{prefix}top_p"), getattr(self, f"{prefix}top_k")
        if not 0.0 < top_p <= 1.0:
            _fail("rollout", f"{prefix}top_p", top_p, "must be in (0, 1]")
        if top_k == 0 or top_k < -1:
            _fail("rollout", f"{prefix}top_k", top_k, "must be -1 (disabled) or >= 1")
