"""Reading verl's values and files: a command-line value and override list as Hydra reads them,
a verl YAML config (flat, or composed with Hydra), and verl's vendored defaults."""

from __future__ import annotations

import ast
import functools
import os
import re

import yaml

from verl_core.config import ConfigError

DEFAULTS_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "verl_defaults",
                             "ppo_trainer.yaml")


class _Loader(yaml.SafeLoader):
    """PyYAML implements YAML 1.1, where ``1e-6`` (no dot) is a string; verl's configs go through
    OmegaConf, which reads it as a float. This resolver (the well-known fix) does the same."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                  |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                  |\.[0-9_]+(?:[eE][-+][0-9]+)?
                  |[-+]?\.(?:inf|Inf|INF)
                  |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


def parse_value(text: str):
    """A command-line value as Hydra reads it: ``1e-6``, ``True``, ``'["console","wandb"]'``,
    ``[console,wandb]``, ``null``; anything else stays a string (``$HOME/x.parquet``, and
    ``off``: ``validation.mode=off``)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError:
        return text
    if isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        return text  # YAML 1.1's on/off/yes/no: Hydra's grammar has true/false only
    return value if value is None or isinstance(value, (bool, int, float, list)) else text


def parse_cli(items: list[str]) -> dict[str, object]:
    """``["key=value", ...]`` (verl's / Hydra's positional overrides) -> ``{key: value}``.
    Hydra's ``+key=`` (add) is the same as ``key=`` here; ``~key`` (delete) is refused."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if key.startswith("~"):
            raise ConfigError(f"override {item!r}: Hydra's ~key (delete) has no meaning here; "
                              "leave the key out")
        if not sep or not key:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. "
                              "actor_rollout_ref.actor.optim.lr=1e-6")
        out[key.lstrip("+")] = parse_value(value)
    return out


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """A nested mapping -> dotted keys; lists and empty mappings are leaves."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_yaml(path: str, command_line: dict | None = None) -> dict[str, object]:
    """A verl YAML config file -> flat dotted keys: a flat one (``_generated_ppo_trainer.yaml``'s
    layout, or the config.yaml Hydra saves in a run), or one with a Hydra ``defaults:`` list (verl's
    example configs: ``defaults: [ppo_trainer, _self_]``), which Hydra composes against verl's
    defaults (:func:`compose_yaml`)."""
    try:
        with open(os.path.expanduser(path)) as f:
            tree = yaml.load(f, Loader=_Loader)
    except OSError as e:
        raise ConfigError(f"verl config {path!r}: cannot read it ({e}); give a local YAML file")
    except yaml.YAMLError as e:
        raise ConfigError(f"verl config {path!r}: not valid YAML ({e})") from e
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(f"verl config {path!r}: must be a mapping of sections, e.g. "
                          "'actor_rollout_ref: {actor: {optim: {lr: 1e-6}}}'")
    if "defaults" in tree:
        return compose_yaml(os.path.expanduser(path), command_line)
    tree.pop("hydra", None)  # Hydra's own settings (a search path): nothing to compose
    return flatten(tree)


def compose_yaml(path: str, command_line: dict | None = None) -> dict[str, object]:
    """A verl config with a ``defaults:`` list, composed by Hydra (hydra-core, as verl composes it)
    -> flat dotted keys. ``ppo_trainer`` (verl's ``defaults`` entry) is verl's generated default
    (``verl_defaults/ppo_trainer.yaml``); other entries are found next to the file, as verl's
    ``--config-path`` finds them. The file's own ``hydra.searchpath`` (verl's checkout,
    ``file://verl/trainer/config``) is replaced by those two folders. A value the file writes as an
    interpolation (``${data.max_response_length}``) is resolved against the composed config with
    ``command_line``'s verl keys applied, as verl resolves it after its command line (DAPO's
    ``gen_batch_size: ${data.train_batch_size}`` follows a ``data.train_batch_size=`` given
    there)."""
    import tempfile

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    folder = os.path.dirname(os.path.abspath(path))
    with open(path) as f:
        tree = yaml.load(f, Loader=_Loader)
    tree["hydra"] = {"searchpath": [f"file://{folder}", f"file://{os.path.dirname(DEFAULTS_FILE)}"]}
    GlobalHydra.instance().clear()
    try:
        with tempfile.TemporaryDirectory(prefix="verl-compose-") as tmp:
            with open(os.path.join(tmp, "primary.yaml"), "w") as f:
                yaml.safe_dump(tree, f, sort_keys=False)
            with initialize_config_dir(config_dir=tmp, version_base=None, job_name="verl_core"):
                cfg = compose(config_name="primary")
    except (HydraException, OmegaConfBaseException, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"verl config {path!r}: Hydra cannot compose its defaults list "
                          f"({first}); its entries must be ppo_trainer (verl's generated "
                          "default) or YAML files next to it: verl's own config groups "
                          "(actor/dp_actor, ...) are not shipped here, so for verl's "
                          "ppo_trainer.yaml itself give its _generated_ppo_trainer.yaml") from None
    finally:
        GlobalHydra.instance().clear()
    flat = flatten(OmegaConf.to_container(cfg, resolve=False))
    for key, value in (command_line or {}).items():
        key = str(key).lstrip("+")
        if key in flat and not (isinstance(value, str) and "${" in value):
            OmegaConf.update(cfg, key, value)  # what the file's interpolations will read
    defaults = verl_defaults()
    for key, value in flat.items():
        if isinstance(value, str) and "${" in value and not _same(value, defaults.get(key)):
            try:  # the file's own interpolation: its value in the composed config
                v = OmegaConf.select(cfg, key)
                flat[key] = OmegaConf.to_container(v, resolve=True) \
                    if OmegaConf.is_config(v) else v
            except OmegaConfBaseException:
                pass  # left as written: refused naming the interpolation
    return flat


@functools.cache
def verl_defaults() -> dict[str, object]:
    """verl's default value of every key (vendored ``_generated_ppo_trainer.yaml``)."""
    with open(DEFAULTS_FILE) as f:
        return flatten(yaml.load(f, Loader=_Loader))


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b
