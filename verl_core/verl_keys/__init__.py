"""verl's command line and YAML configs, translated to our dotted keys (docs/verl-keys.md).

A verl user's overrides (``actor_rollout_ref.actor.optim.lr=1e-6``, ``trainer.test_freq=5`` …)
and a verl YAML config file are accepted as they are: each verl key either lands on our field
(:data:`VERL_TO_OURS`, with a value transform where the units differ), or is a no-op whose value
is checked (:data:`NO_EFFECT`: bookkeeping or memory placement that cannot change a result here),
or is refused by name with the reason. A key at verl's default value (the vendored
``verl_defaults/ppo_trainer.yaml``) is accepted from a YAML file and changes nothing; any other
verl key is refused, never silently ignored. Our own keys (``RunConfig``'s sections: the
``config.py`` beside each component, composed in ``verl_core/config.py``) pass through.

What belongs here: key names and value transforms only. Range checks stay in the sections'
``__post_init__`` (every translated value is validated there, naming our field).

Modules: ``files`` (reading values, override lists and YAML files; verl's defaults), ``table``
(the key table and its transforms), ``translate`` (:func:`to_ours` and the front door
:func:`run_config`).
"""

from verl_core.verl_keys.files import (DEFAULTS_FILE, compose_yaml, flatten, load_yaml, parse_cli,
                                       parse_value, verl_defaults)
from verl_core.verl_keys.table import (DAPO_KEYS, MULTI_GPU, NO_EFFECT, OVERRIDE_CONFIG,
                                       PATTERN_NO_EFFECT, READ_WITH_GET, REFUSED, REFUSED_PATTERNS,
                                       RL_STEP_UNIT, RM_SERVING, SPEED_ONLY, TOTAL_EPOCHS,
                                       VERL_TO_OURS, WARMUP_RATIO, Pairs, Transform)
from verl_core.verl_keys.translate import (entry_options, is_our_key, is_verl_style, known_keys,
                                           overrides_from, run_config, to_ours)

__all__ = ["DEFAULTS_FILE", "compose_yaml", "flatten", "load_yaml", "parse_cli", "parse_value",
           "verl_defaults", "DAPO_KEYS", "MULTI_GPU", "NO_EFFECT", "OVERRIDE_CONFIG",
           "PATTERN_NO_EFFECT", "READ_WITH_GET", "REFUSED", "REFUSED_PATTERNS", "RL_STEP_UNIT",
           "RM_SERVING", "SPEED_ONLY", "TOTAL_EPOCHS", "VERL_TO_OURS", "WARMUP_RATIO", "Pairs",
           "Transform", "entry_options", "is_our_key", "is_verl_style", "known_keys",
           "overrides_from", "run_config", "to_ours"]
