"""Translation of a mapping of our keys and verl's to our overrides (:func:`to_ours`), and the one
front door of both entry points (:func:`run_config`, with :func:`entry_options`)."""

from __future__ import annotations

import functools

from verl_core.config import (MOVED_KEYS, SECTIONS, ConfigError, RunConfig, _fields_of,
                              did_you_mean, dotted_keys, preset, typed_overrides, with_overrides)
from verl_core.verl_keys.files import _same, load_yaml, verl_defaults
from verl_core.verl_keys.table import (NO_EFFECT, OVERRIDE_CONFIG, PATTERN_NO_EFFECT, TOTAL_EPOCHS,
                                       VERL_TO_OURS, WARMUP_RATIO, Pairs, _refusal)


def is_our_key(key: str) -> bool:
    section, _, name = key.rpartition(".")
    if not section:
        return name in _fields_of(RunConfig) and name not in SECTIONS
    return section in SECTIONS and name in _fields_of(SECTIONS[section])


def to_ours(values: dict[str, object], *, from_file: str = "") -> dict[str, object]:
    """Our dotted overrides for ``values``, a mapping of our keys and verl's. ``from_file``
    (the YAML's path, for messages): keys at verl's default value are accepted and change
    nothing (our preset's value stands). A verl key and our key that set one field to different
    values fail naming both. Every key that cannot apply is named in one error, each with its
    reason (a command is fixed in one round trip, not one key at a time)."""
    where = f" (in {from_file})" if from_file else ""
    # Hydra's +key= (add) is key= here: a command line's (parse_cli) or a script's data
    values = _gather({str(k).lstrip("+"): v for k, v in values.items()}, OVERRIDE_CONFIG)
    defaults = verl_defaults()
    out: dict[str, object] = {}
    origin: dict[str, str] = {}
    refused: list[str] = []
    for key, value in values.items():
        try:
            pairs = _one_key(key, value, values, defaults, where, from_file)
        except ConfigError as e:
            refused.append(str(e))
            continue
        for target, v in pairs:
            if target in out and not _same(out[target], v):
                refused.append(f"{origin[target]}={values[origin[target]]!r} and "
                               f"{key}={value!r}{where} both set {target} "
                               f"({out[target]!r} vs {v!r}); give one of them")
                continue
            out[target], origin[target] = v, key
    if len(refused) == 1:
        raise ConfigError(refused[0])
    if refused:
        raise ConfigError(f"{len(refused)} config keys cannot apply:\n" +
                          "\n".join(f"  - {r}" for r in refused))
    return out


def _gather(values: dict, prefix: str) -> dict:
    """``values`` with every ``prefix.field`` key (and ``prefix`` itself, a mapping) collected
    into one ``prefix`` mapping: verl's ``override_config`` given field by field on a command
    line, or as a nested mapping in a YAML file (flattened)."""
    fields = {k[len(prefix) + 1:]: v for k, v in values.items() if k.startswith(prefix + ".")}
    if not fields:
        return values
    whole = values.get(prefix) or {}
    if not isinstance(whole, dict):
        return values  # refused by the transform, naming it
    out = {k: v for k, v in values.items() if not k.startswith(prefix + ".") and k != prefix}
    out[prefix] = {**whole, **fields}
    return out


def _one_key(key: str, value, values: dict, defaults: dict, where: str, from_file: str) -> Pairs:
    """``[(our key, value), ...]`` for one key of ``values``, or ConfigError with the reason."""
    if key in MOVED_KEYS:
        raise ConfigError(f"config key {key!r}{where} was renamed to {MOVED_KEYS[key]!r} "
                          f"(verl's trainer.* is the run loop); use {MOVED_KEYS[key]}")
    if from_file and key in defaults and _same(value, defaults[key]):
        return []
    if isinstance(value, str) and "${" in value:
        raise ConfigError(f"{key}={value!r}{where}: interpolations are not resolved here; "
                          "write the value")
    if key in VERL_TO_OURS:
        try:
            return VERL_TO_OURS[key](value, values)
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # a transform's arithmetic on a wrong type
            raise ConfigError(f"verl key {key}={value!r}{where} cannot apply here: not a value "
                              f"it takes ({e}); docs/verl-keys.md") from None
    if is_our_key(key):
        return [(key, value)]
    no_effect = NO_EFFECT.get(key)
    if no_effect is None and key in defaults:  # by pattern: verl's keys only, never a typo
        no_effect = next(((ok, why) for pattern, ok, why in PATTERN_NO_EFFECT
                          if pattern.search(key)), None)
    if no_effect is not None:
        ok, why = no_effect
        if not ok(value):
            raise ConfigError(f"verl key {key}={value!r}{where} cannot apply here: {why}")
        return []
    if key in defaults and _same(value, defaults[key]):
        return []
    why = _refusal(key)
    if why:
        raise ConfigError(f"verl key {key}={value!r}{where} cannot apply here: {why}")
    if key in defaults:
        raise ConfigError(
            f"verl key {key}={value!r}{where} is not built here yet (only verl's default "
            f"{defaults[key]!r} is accepted; docs/verl-keys.md lists what maps, and an issue is "
            "the way to ask for it)")
    raise ConfigError(f"unknown config key {key!r}{where}: neither ours "
                      "(docs/options.md) nor verl's at the commit the defaults come from "
                      "(verl_core/verl_defaults/ppo_trainer.yaml): a typo, or a key of a newer "
                      f"verl{did_you_mean(key, known_keys())}")


@functools.cache
def known_keys() -> frozenset[str]:
    """Every key a command or YAML file may name: ours and verl's (its defaults file and the
    keys the tables map that it leaves out). verl's refused keys are here too: the near key's
    own message then says why it cannot apply, which is the answer the user was after."""
    verl = set(verl_defaults()) | set(VERL_TO_OURS) | set(NO_EFFECT)
    return frozenset(dotted_keys() | verl - set(MOVED_KEYS))


def is_verl_style(verl_config: str = "", overrides: dict | None = None) -> bool:
    """A verl YAML file, or a command with a key that is verl's and not ours (our keys such as
    ``data.train_batch_size`` are both): then verl's defaults of the algorithm apply."""
    return bool(verl_config) or any(not is_our_key(str(k)) for k in overrides or {})


def overrides_from(verl_config: str = "", overrides: dict | None = None) -> dict[str, object]:
    """Our dotted overrides from a verl YAML file (``verl_config``, may be empty) and a mapping of
    our keys and verl's; the mapping wins over the file, as Hydra's command line does."""
    if overrides is not None and not isinstance(overrides, dict):
        raise ConfigError(f"overrides={overrides!r}: must be a mapping of dotted keys to values, "
                          'e.g. {"actor_rollout_ref.actor.optim.lr": 1e-6}')
    out = to_ours(load_yaml(verl_config, overrides), from_file=verl_config) if verl_config else {}
    out.update(to_ours(overrides or {}))
    return out


def entry_options(*, steps: int | None = None, model: str = "", train_files: str = "",
                  val_files: str = "", batch_size: int = 0, rollout_n: int = 0) -> dict[str, object]:
    """The entry points' own options (``--steps``, ``--model`` …) as our dotted keys, for
    :func:`run_config`; None / "" / 0 keep the preset's value (``steps=0`` is a value: the config
    refuses it)."""
    options: dict[str, object] = {}
    if steps is not None:
        options["total_steps"] = steps
    if model:
        options["model.path"] = model
    if train_files or val_files:
        options["data.train_files"] = train_files
        options["data.val_files"] = val_files
    if batch_size:
        options["data.train_batch_size"] = batch_size
    if rollout_n:
        options["rollout.n"] = rollout_n
    return options


def run_config(algorithm: str = "", verl_config: str = "", overrides: dict | None = None,
               options: dict | None = None) -> RunConfig:
    """The one front door of both entry points (the plain loop's CLI and the workflow's
    ``configure``), so they build the same config from the same input: ``overrides`` (our keys
    and verl's) over ``verl_config`` (a verl YAML file), then ``options`` (our keys, from the
    entry point's own options such as ``--model``), on the preset of ``algorithm``, whose
    defaults the model decides (:func:`~verl_core.config.preset`: verl's with a model you bring,
    the micro-batch fitted to the mini-batch).

    ``algorithm`` empty: the estimator ``overrides`` name, else verl's default ``gae`` (PPO) when
    the input is verl-style (:func:`is_verl_style`), else our own default ``grpo``.
    ``trainer.total_epochs`` (verl's) is turned into RL steps once the training rows are counted
    (parquet footers): epochs x full batches per epoch, capped by ``trainer.total_training_steps``
    when that is given too, as verl's loop stops at whichever comes first. A batch size from
    ``options`` with no mini-batch in ``overrides`` makes two optimizer steps per RL step (the
    whole batch for an odd size)."""
    over = overrides_from(verl_config, overrides)
    epochs = over.pop(TOTAL_EPOCHS, None)
    ratios = {k: over.pop(k) for k in WARMUP_RATIO if k in over}
    options = dict(options or {})
    batch_size = options.get("data.train_batch_size")
    if batch_size and "actor.ppo_mini_batch_size" not in over:
        options.setdefault("actor.ppo_mini_batch_size",
                           batch_size // 2 if batch_size % 2 == 0 else batch_size)
    # typed first: a bad value is named even where an option then replaces it
    over = typed_overrides(over)
    over.update(options)
    if not algorithm:
        verl_style = is_verl_style(verl_config, overrides)
        algorithm = str(over.get("algorithm.adv_estimator") or
                        ("gae" if verl_style else "grpo"))
    cfg = preset("ppo" if algorithm == "gae" else algorithm, **over)
    late: dict[str, object] = {}  # what needs the run's length in RL steps
    if epochs is not None:
        from verl_core.validation import batches_per_epoch

        steps = epochs * batches_per_epoch(cfg)
        late["total_steps"] = min(steps, cfg.total_steps) if "total_steps" in over else steps
    total = late.get("total_steps", cfg.total_steps)
    for k, ratio in ratios.items():  # verl: int(ratio x total training steps) warmup RL steps
        late[WARMUP_RATIO[k]] = int(ratio * total)
    if cfg.checkpoint.last_step_only and "checkpoint.checkpoint_interval" not in over:
        late["checkpoint.checkpoint_interval"] = total  # no save between: the schedule agrees
    return with_overrides(cfg, late) if late else cfg
