"""Training-guard anomaly detectors: pure functions from one step's metrics, and the metrics of the
steps before it, to :class:`Anomaly` records.

What belongs here: each detector's rule (the phase it runs in, the metrics it reads, the bound
it checks), the robust statistics behind the bounds, counting non-finite entries of a batch's
tensors, and reading accelerator utilisation from NVML. What does not: what happens when a
detector fires (the policies), the event log, deadlines and hangs: see the rest of
``verl_core/guard``.

The rule of every windowed detector. ``w`` = the last ``guard.window`` finite values of the
signal in the history (oldest first), ``m`` = median(w), ``s`` = 1.4826 * median(|w - m|) (the
MAD, scaled to estimate the standard deviation of normal data; Rousseeuw & Croux 1993), robust
z = (x - m) / s. The detector fires on a value x when

    len(w) >= guard.warmup_steps                                        (warm-up)
    x > m + max(z_max * s, floor_up)    or    x < m - max(z_max * s, floor_down)

for the directions it watches: the z-score passes the detector's ``<name>_z`` AND the change
passes an absolute or relative floor, so a flat series (s = 0, e.g. a reward stuck at 0.5)
does not fire on noise. The bound it crossed is the Anomaly's ``threshold``.

Which phase checks which metric: every metric key belongs to the phase that produces it
(:func:`metric_phase`), and a phase checks only its own keys, so ``current`` may hold either
that phase's metrics or everything the step has produced so far (what the plain loop keeps)
and no anomaly is reported twice. The exception is ``gpu/utilization``, judged after both phases
that use the accelerator: give it once per phase, each against that phase's own history (as
``runlog.watch_phase`` does), or use :func:`replay` for a table with one value per step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from verl_core.algorithms.registry import Registry
from verl_core.guard.config import GuardConfig

PHASES = ("rollout", "reward", "advantage", "update")
"""The phases :func:`detect` is called for, in order."""

GPU_UTILIZATION = "gpu/utilization"
"""The metric of :func:`gpu_utilization` (percent, 0..100), recorded only when NVML answers."""

_KEY_PHASE = (  # (exact key, or a prefix ending in "/"; phase): the first match wins
    ("timing/rollout_s", "rollout"), ("timing/reward_s", "reward"),
    ("timing/advantage_s", "advantage"), ("timing/update_s", "update"),
    ("actor/reward_kl", "advantage"), ("critic/values_mean", "advantage"),
    ("rollout/zero_variance_", "reward"),  # counted from the scores (guard/checks.py)
    ("rollout/", "rollout"), ("response_length/", "rollout"), ("reward/", "reward"),
    ("advantages/", "advantage"),
)


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def metric_phase(key: str) -> str:
    """The phase that produces metric ``key``: ``rollout/*``, ``response_length/*`` and
    ``timing/rollout_s`` the rollout; ``reward/*`` the reward phase; ``advantages/*``,
    ``actor/reward_kl``, ``critic/values_mean`` the advantage phase. Anything else
    (``actor/*``, ``critic/*``, ``update/*``, ``gpu/*``, ``timing/step_s`` …) belongs to the
    update, the last phase, so a metric this table does not know is still checked once per step
    when ``current`` accumulates."""
    for k, phase in _KEY_PHASE:
        if key == k or (k.endswith(("/", "_")) and key.startswith(k)):
            return phase
    return "update"


@dataclass(frozen=True)
class Anomaly:
    """One detector firing on one signal at one phase of one step."""

    detector: str
    """``nonfinite`` or a registered detector's name; ``guard.<detector>_policy`` applies."""
    phase: str
    """rollout, reward, advantage or update."""
    step: int
    """The RL step the phase belongs to."""
    signal: str
    """The metric key (or the batch column, for a caller reporting :func:`nonfinite_counts`)."""
    value: float
    """The offending value (NaN or +-inf for a non-finite metric)."""
    threshold: float
    """The bound it crossed (``nonfinite``: inf, the bound of every finite value)."""
    message: str
    """One line for a human: what, how far from the median, over which window."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Window:
    """Robust statistics of a signal's last finite values."""

    values: np.ndarray  # (n,) float64, oldest first
    median: float
    mad: float  # scaled by 1.4826: an estimate of the standard deviation for normal data

    @classmethod
    def of(cls, signal: str, history: list[dict], size: int) -> "Window":
        """The last ``size`` finite values of ``signal`` in ``history`` (oldest first); steps that
        lack it, or hold a non-number or a non-finite value, are passed over."""
        vals = []
        for h in reversed(history):  # newest first, so a long history costs only the window
            v = h.get(signal)
            if _finite_number(v):
                vals.append(float(v))
                if len(vals) == size:
                    break
        x = np.asarray(vals[::-1], dtype=np.float64)
        if not len(x):
            return cls(x, math.nan, math.nan)
        med = float(np.median(x))
        # the MAD by its definition, with numpy: scipy.stats.median_abs_deviation(scale="normal")
        # is the same two lines and would be a new dependency (and a slow import) for them
        return cls(x, med, 1.4826 * float(np.median(np.abs(x - med))))

    def bounds(self, z: float, up: Optional[float] = None,
               down: Optional[float] = None) -> tuple[float, float]:
        """(lower, upper): ``median -/+ max(z * MAD, floor)`` for each watched direction (a
        direction whose floor is None is not watched: its bound is -inf / +inf)."""
        spread = z * self.mad
        lower = self.median - max(spread, down) if down is not None else -math.inf
        upper = self.median + max(spread, up) if up is not None else math.inf
        return lower, upper

    def z(self, x: float) -> float:
        """Robust z-score of ``x`` (+-inf when the MAD is 0 and x is off the median)."""
        d = x - self.median
        if self.mad > 0:
            return d / self.mad
        return 0.0 if d == 0 else math.copysign(math.inf, d)


@dataclass(frozen=True)
class DetectorTraits:
    """What a windowed detector reads: ``(phase, metric key)`` pairs, and a label for messages."""

    signals: tuple[tuple[str, str], ...] = ()
    what: str = ""


def _detector_prototype(signal: str, w: Window, current: dict,
                        cfg: GuardConfig) -> tuple[float, float]:
    """Every windowed detector: the metric key it checks, that signal's window, this step's
    metrics so far, the config -> the (lower, upper) bounds of the signal's value."""


DETECTORS = Registry("anomaly detector", prototype=_detector_prototype, traits=DetectorTraits)
"""The windowed detectors (``nonfinite`` is not windowed: it is :func:`detect`'s first pass)."""


@DETECTORS.register("grad_explosion", what="gradient norm exploded",
                    signals=(("update", "actor/grad_norm"), ("update", "critic/grad_norm")))
def grad_explosion(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """Gradient norm (before clipping; mean over the step's optimizer steps) above
    ``median + max(grad_explosion_z * MAD, (grad_explosion_min_ratio - 1) * median)``. The
    default ratio is large (10x) because the policy is ``skip_batch``: on the default demos the
    pre-clip norm wanders up to about 3.7x its median (PPO's critic) without harm."""
    return w.bounds(cfg.grad_explosion_z, up=(cfg.grad_explosion_min_ratio - 1) * abs(w.median))


@DETECTORS.register("loss_spike", what="loss spike",
                    signals=(("update", "actor/pg_loss"), ("update", "critic/vf_loss")))
def loss_spike(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """Policy loss more than ``max(loss_spike_z * MAD, loss_spike_min_change)`` from its median,
    either way (it has no natural sign); value loss only above it. The floor is in loss units:
    the policy loss is in advantage units (about 1 after GRPO's normalisation; the demos stay
    within 0.013 of 0), the value loss in squared reward units."""
    floor = cfg.loss_spike_min_change
    return w.bounds(cfg.loss_spike_z, up=floor,
                    down=floor if signal == "actor/pg_loss" else None)


@DETECTORS.register("kl_spike", what="KL spike",
                    signals=(("advantage", "actor/reward_kl"), ("update", "actor/kl_loss")))
def kl_spike(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """KL to the reference policy (the KL loss, or the reward-penalty KL) above
    ``median + max(kl_spike_z * MAD, kl_spike_min_change, (kl_spike_min_ratio - 1) * median)``
    (nats). The ratio floor is there because the batch KL is the mean of a positive per-token
    estimate with a long right tail (k3 = ratio - log ratio - 1 grows without bound in the
    ratio, while it is >= 0 below), so the MAD understates how far up a healthy step can go;
    the absolute floor is about one clipped PPO step's move of a log-prob (``GuardConfig``).
    Healthy GRPO + KL runs of the default demo reached z = +5.9 and +6.7, 0.15 and 0.18 nats
    (1.7x and 2.2x) above their medians."""
    return w.bounds(cfg.kl_spike_z, up=max(cfg.kl_spike_min_change,
                                           (cfg.kl_spike_min_ratio - 1) * abs(w.median)))


@DETECTORS.register("reward_collapse", what="reward collapsed",
                    signals=(("reward", "reward/mean"),))
def reward_collapse(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """Mean reward below ``median - max(reward_collapse_z * MAD, reward_collapse_min_drop)``:
    the batch mean of 0/1 scores moves by about 0.06 from step to step on the default demo
    (robust z down to -2.7), and the policy is ``rollback``, so the defaults ask for z < -5 and
    a drop of 0.25."""
    return w.bounds(cfg.reward_collapse_z, down=cfg.reward_collapse_min_drop)


@DETECTORS.register("entropy_collapse", what="entropy collapsed",
                    signals=(("update", "actor/entropy"),))
def entropy_collapse(signal: str, w: Window, current: dict,
                     cfg: GuardConfig) -> tuple[float, float]:
    """Policy entropy (reported when ``algorithm.entropy_coeff > 0``) below
    ``median - max(entropy_collapse_z * MAD, entropy_collapse_min_drop * median)``."""
    return w.bounds(cfg.entropy_collapse_z, down=cfg.entropy_collapse_min_drop * abs(w.median))


@DETECTORS.register("length_anomaly", what="response length collapsed or ran away",
                    signals=(("rollout", "response_length/mean"),))
def length_anomaly(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """Mean response length (tokens) beyond the median by ``max(length_anomaly_z * MAD, ...)``
    with floors that make it a ratio: below ``median / length_anomaly_min_ratio`` (collapse) or
    above ``median * length_anomaly_min_ratio`` (runaway)."""
    r, m = cfg.length_anomaly_min_ratio, abs(w.median)
    return w.bounds(cfg.length_anomaly_z, up=(r - 1) * m, down=(1 - 1 / r) * m)


@DETECTORS.register("latency_spike", what="phase latency spike",
                    signals=tuple((p, f"timing/{p}_s") for p in PHASES))
def latency_spike(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """Wall time of the phase above ``median + max(latency_spike_z * MAD,
    (latency_spike_min_ratio - 1) * median, latency_spike_min_s)``. The seconds floor keeps a
    busy machine quiet: on the 2-core demo machine, shared with other jobs, phases of 0.02 to
    0.1 s stalled for up to 19 s (z up to +640) with nothing wrong; hangs are the deadlines'
    job."""
    return w.bounds(cfg.latency_spike_z, up=max((cfg.latency_spike_min_ratio - 1) * abs(w.median),
                                                cfg.latency_spike_min_s))


@DETECTORS.register("throughput_drop", what="rollout throughput dropped",
                    signals=(("rollout", "rollout/tokens_per_s"),))
def throughput_drop(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """Rollout tokens/s below ``median - max(throughput_drop_z * MAD, throughput_drop_min_drop *
    median, median * throughput_drop_min_lost_s / t)``, t = this rollout's generation time
    ``rollout/time_s`` (else the phase's ``timing/rollout_s``, a little longer): the drop must
    cost seconds, as for :func:`latency_spike`. (At the median rate the same tokens take
    t * x / median, so the seconds lost are t * (1 - x / median); the last floor is that
    >= min_lost_s solved for x. With neither time in ``current`` it is left out.)"""
    m = abs(w.median)
    down = cfg.throughput_drop_min_drop * m
    t = next((current[k] for k in ("rollout/time_s", "timing/rollout_s")
              if _finite_number(current.get(k)) and current[k] > 0), None)
    if t is not None:
        down = max(down, m * cfg.throughput_drop_min_lost_s / t)
    return w.bounds(cfg.throughput_drop_z, down=down)


@DETECTORS.register("gpu_util_drop", what="accelerator utilisation dropped",
                    signals=(("rollout", GPU_UTILIZATION), ("update", GPU_UTILIZATION)))
def gpu_util_drop(signal: str, w: Window, current: dict, cfg: GuardConfig) -> tuple[float, float]:
    """Accelerator utilisation (percent, from :func:`gpu_utilization`; the metric is absent on a
    machine without NVML, and then this detector never runs) below ``median -
    max(gpu_util_drop_z * MAD, gpu_util_drop_min_drop)`` (percentage points). Checked after the
    two phases that use the accelerator, each against a history of that phase's own samples
    (``runlog.watch_phase`` keeps one per phase: reward and advantage leave it idle)."""
    return w.bounds(cfg.gpu_util_drop_z, down=cfg.gpu_util_drop_min_drop)


def _nonfinite(phase: str, step: int, current: dict) -> list[Anomaly]:
    """``nonfinite``, no window and no warm-up: a metric of this phase that is NaN or +-inf.
    Non-finite gradients show as a non-finite ``actor/grad_norm`` (the mean of the step's norms;
    the optimizer refuses those steps itself); for a batch's tensors see
    :func:`nonfinite_counts`."""
    out = []
    for key, v in current.items():
        if metric_phase(key) != phase or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        v = float(v)
        if not math.isfinite(v):
            out.append(Anomaly("nonfinite", phase, step, key, v, math.inf,
                               f"non-finite value: {key}={v} at step {step} ({phase} phase)"))
    return out


NO_SIGNAL = "rollout/zero_variance_frac"
"""The share of the step's groups whose rewards were all equal (``guard/checks.py``)."""


def _no_signal(phase: str, step: int, current: dict, history: list[dict],
               cfg: GuardConfig) -> list[Anomaly]:
    """``no_signal``, no window: every group of this step and of the ``no_signal_steps - 1``
    steps before it (those that recorded the signal, newest first, without a gap of a step
    that had signal) had equal rewards. Fires when the run of such steps reaches a multiple of
    ``no_signal_steps``, so a lasting one is said again, not on every step. The message names
    the likely cause from this step's numbers."""
    if phase != "reward" or current.get(NO_SIGNAL) != 1.0:
        return []
    run = 1
    for h in reversed(history):
        v = h.get(NO_SIGNAL)
        if v is None:
            continue
        if v != 1.0:
            break
        run += 1
    if run % cfg.no_signal_steps:
        return []
    reward, clip = current.get("reward/mean"), current.get("response_length/clip_ratio")
    causes = []
    if reward is not None and reward == current.get("reward/min", reward) and reward <= 0:
        causes.append("every response scored 0: the answer format the scorer reads is never "
                      "produced (look at a sample: `[response]` in the console or the Deck; a "
                      "short supervised format warm start, model.format_warmup_steps, or "
                      "verl's flexible extraction helps) or the scorer is too strict for this "
                      "model")
    elif reward is not None and reward == current.get("reward/max", reward):
        causes.append(f"every response scored the same ({_fmt(reward)}): the task is too easy "
                      "or the scorer gives one value to everything")
    if clip is not None and clip > 0.5:
        causes.append(f"{clip:.0%} of the responses hit rollout.max_new_tokens and are cut before "
                      "their answer (raise it)")
    if not causes:
        causes.append("the answer format never produced, responses cut at "
                      "rollout.max_new_tokens, or a scorer too strict")
    return [Anomaly("no_signal", phase, step, NO_SIGNAL, 1.0, 1.0,
                    f"no learning signal: every group's rewards were equal (zero advantage on "
                    f"every row, grad_norm 0 from the policy loss) for {run} steps in a row; "
                    f"likely: {'; '.join(causes)}")]


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def _message(what: str, phase: str, step: int, signal: str, x: float, bound: float,
             w: Window) -> str:
    z = w.z(x)
    ratio = f", {x / w.median:.2f}x the median" if w.median != 0 else ""
    return (f"{what}: {signal}={_fmt(x)} at step {step} ({phase} phase) is {_fmt(x - w.median)} "
            f"from the median {_fmt(w.median)}{ratio} of its last {len(w.values)} values "
            f"(robust z {z:+.1f}, MAD {_fmt(w.mad)}); bound {_fmt(bound)}")


@dataclass(frozen=True)
class Check:
    """One windowed detector evaluated on one signal (fired or not): what :func:`detect`
    reports when it fires, and what a calibration (the largest |z| seen) reads."""

    detector: str
    signal: str
    value: float
    window: Window
    lower: float
    upper: float

    @property
    def fired(self) -> bool:
        return self.value < self.lower or self.value > self.upper


def checks(phase: str, step: int, current: dict, history: list[dict],
           cfg: GuardConfig) -> list[Check]:
    """Every windowed detector that can run at ``phase`` on ``current`` (its signal present and
    finite, its window past warm-up), fired or not; see :func:`detect`."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}: unknown; detectors run at {', '.join(PHASES)}")
    out = []
    for name in DETECTORS:
        fn, traits = DETECTORS.get(name), DETECTORS.traits(name)
        for p, signal in traits.signals:
            if p != phase or not _finite_number(current.get(signal)):
                continue
            w = Window.of(signal, history, cfg.window)
            if len(w.values) < cfg.warmup_steps:
                continue
            lower, upper = fn(signal, w, current, cfg)
            out.append(Check(name, signal, float(current[signal]), w, lower, upper))
    return out


def detect(phase: str, step: int, current: dict[str, float], history: list[dict],
           cfg: GuardConfig) -> list[Anomaly]:
    """The anomalies of ``phase`` at ``step``: ``nonfinite`` first (see :func:`_nonfinite`),
    then every registered detector whose signal belongs to ``phase`` (module docstring: the rule;
    each detector's docstring: its bounds). ``current`` holds this step's metrics so far,
    ``history`` the previous steps' metric dicts, oldest first. A signal that is absent from
    ``current`` or non-finite there (``nonfinite`` reports that) is not checked. Nothing fires
    when ``cfg.enabled`` is False. Pure: no I/O, no state."""
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r}: unknown; detectors run at {', '.join(PHASES)}")
    if not cfg.enabled:
        return []
    out = _nonfinite(phase, step, current) + _no_signal(phase, step, current, history, cfg)
    for c in checks(phase, step, current, history, cfg):
        if c.fired:
            bound = c.lower if c.value < c.lower else c.upper
            what = DETECTORS.traits(c.detector).what
            out.append(Anomaly(c.detector, phase, step, c.signal, c.value, bound,
                               _message(what, phase, step, c.signal, c.value, bound, c.window)))
    return out


def replay(rows: list[dict], cfg: GuardConfig, step_key: str = "step") -> list[Anomaly]:
    """:func:`detect` over a finished run's per-step metrics (e.g. the run store's metrics table
    as records, or ``train()``'s history), step by step and phase by phase, each step's row
    standing for ``current`` and the rows before it for the history: what the guard would have
    reported on that run. A row holds one value per signal, so a signal judged at two phases
    (``gpu/utilization``) is reported once per step."""
    found: list[Anomaly] = []
    for i, row in enumerate(rows):
        step = int(row.get(step_key, i))
        seen = set()
        for phase in PHASES:
            for a in detect(phase, step, row, rows[:i], cfg):
                if (a.detector, a.signal) not in seen:
                    seen.add((a.detector, a.signal))
                    found.append(a)
    return found


# ----------------------------------------------------------------- tensors and accelerators
def nonfinite_counts(batch) -> dict[str, int]:
    """Non-finite (NaN, +-inf) entries per floating-point tensor column of a
    :class:`~verl_core.data.batch.Batch` present in it: ``score``/``baseline_score`` (N,) whole;
    ``response_logprobs``, ``ref_logprobs``, ``values``, ``advantages``, ``returns``,
    ``sum_pi_squared`` (N, T) only on real response tokens (``response_attn``: padding holds
    whatever it holds); the masks themselves whole. Columns the batch does not hold are left
    out; 0 means clean."""
    mask = batch.response_attn.bool()  # (N, T)
    out = {}
    for f in dataclasses.fields(batch):
        x = getattr(batch, f.name)
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            continue
        bad = ~torch.isfinite(x)
        if f.name not in ("response_mask", "response_attention_mask") and x.shape == mask.shape:
            bad = bad & mask  # (N, T): generated tokens only
        out[f.name] = int(bad.sum())
    return out


def _visible_devices(pynvml) -> list:
    """NVML handles of the GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` (indices or
    UUIDs, as CUDA and Ray write it) when set, else all of them."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    handles = []
    for item in filter(None, (s.strip() for s in env.split(","))):
        if item.isdigit():
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(item)))
        else:
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(item))
    return handles


_NVML_MISSING = False
"""Set when NVML failed to start in this process (no NVIDIA driver or library)."""


def gpu_utilization() -> Optional[float]:
    """Mean utilisation (percent of the last sample period, 0..100) of the GPUs visible to this
    process, read from NVML (``nvidia-ml-py``, imported here so machines without it import this
    module fine). None when it cannot be known: the package is missing, no NVIDIA driver or
    GPU, no visible device, or NVML does not report utilisation (e.g. a MIG slice). Never a
    made-up number: record :data:`GPU_UTILIZATION` only when this is not None."""
    global _NVML_MISSING
    if _NVML_MISSING:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver / library: no NVIDIA GPU here, now or later
        _NVML_MISSING = True  # a failed init would search the library path again every phase
        return None
    try:
        rates = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in _visible_devices(pynvml)]
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()
    return float(sum(rates)) / len(rates) if rates else None


__all__ = ["Anomaly", "Check", "DETECTORS", "GPU_UTILIZATION", "PHASES",
           "Window", "checks", "detect", "gpu_utilization", "metric_phase", "nonfinite_counts",
           "replay"]
