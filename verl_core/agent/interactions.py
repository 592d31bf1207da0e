"""Simulated users for multi-turn rollouts, on verl's interaction contract (issue 45, item 2).

- **The config**: verl's YAML (``actor_rollout_ref.rollout.multi_turn.interaction_config_path``,
  ``rollout.interaction_config_path`` here): ``interaction: [{name, class_name, config}]``,
  ``class_name`` a dotted ``module.Class`` or ``path/to/file.py:Class``; a missing ``name`` is
  derived from the class as verl derives it (``Gsm8kInteraction`` -> ``gsm8k``).
  ``builtin:guess`` names the built-in scripted user of the guessing game
  (:class:`GuessInteraction`, ``data.synthetic_task=guess``). A row picks its interaction by
  ``extra_info["interaction_kwargs"]["name"]``, as in verl.
- **The contract** (verl's ``BaseInteraction``, no verl import needed): ``__init__(config)``,
  async ``start_interaction(instance_id, **interaction_kwargs)``, async
  ``generate_response(instance_id, messages, **interaction_kwargs) -> (should_terminate_sequence,
  response, turn_score, extra)``, async ``finalize_interaction(instance_id)``
  (``calculate_score`` is the class's own business: verl's loop never calls it).
- **Isolation**: the classes are imported, built and called in a child process, the same
  :class:`~verl_core.agent.tools.ToolHost` as tools (a second one), each class wrapped as a tool
  (:class:`HostedInteraction`): a call that raises, returns something else than the 4-tuple, a
  non-finite score, hangs past ``rollout.tool_timeout_s`` or kills its process is an ``error`` /
  ``timeout`` answer, which ends that row's episode; the run goes on.
- **Determinism**: before each ``generate_response`` the host seeds Python's ``random`` with the
  turn's seed (a hash of the step's seed, the row and the turn), so a user that draws from
  ``random`` answers the same on a replay.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

from verl_core.agent.tools import ToolConfigError, ToolEntry, load_tool_class

BUILTIN_GUESS = "builtin:guess"
"""``rollout.interaction_config_path`` of the guessing game's scripted user
(:class:`GuessInteraction`), with no YAML to write."""

BUILTIN_LLM_USER = "builtin:llm_user"
"""``rollout.interaction_config_path`` (or an entry's ``class_name``) of the LLM user: the
rollout engine itself, given the conversation with the roles swapped and its own system prompt,
writes the user's turn (``rollout/multi_turn.py``); ``config``: :data:`LLM_USER_DEFAULTS`."""

LLM_USER_DEFAULTS: dict[str, Any] = {
    "system_prompt": "You are the user talking to an assistant. Reply with the user's next "
                     "message only. Write [END] when you are satisfied.",
    "max_tokens": 64,
    "temperature": 1.0,
    "stop_phrase": "[END]",
}
"""The LLM user's settings (an entry's ``config`` overrides them): its system prompt, the most
tokens of a user turn, its sampling temperature, and the phrase that ends the episode (the
turn's text is kept, the phrase included). Its turns score ``None`` (no turn score)."""

_HOSTED = f"{__name__}.HostedInteraction"
_METHODS = ("start_interaction", "generate_response")


@dataclass(frozen=True)
class InteractionEntry:
    """One interaction of the config: its name (what rows choose), class and ``config``."""

    name: str
    class_name: str
    config: dict

    def tool_entry(self) -> ToolEntry:
        """This interaction as the tool host serves it (:class:`HostedInteraction`)."""
        return ToolEntry(_HOSTED, {"class_name": self.class_name, "config": self.config},
                         {"type": "function",
                          "function": {"name": self.name, "parameters": {"type": "object"}}})


def _default_name(class_name: str) -> str:
    simple = class_name.replace(":", ".").rsplit(".", 1)[-1]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def load_interaction_config(path: str) -> list[InteractionEntry]:
    """The interactions of a verl interaction YAML, every entry checked (a wrong one is named
    with the fix)."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise ToolConfigError(f"interaction config {path!r} cannot be read ({e}); "
                              "multi_turn.interaction_config_path names a local YAML file") from e
    except yaml.YAMLError as e:
        raise ToolConfigError(f"interaction config {path!r} is not valid YAML: {e}") from e
    items = doc.get("interaction") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise ToolConfigError(f"interaction config {path!r}: expected a top-level 'interaction' "
                              "list with at least one entry (verl's layout: interaction: [{name, "
                              "class_name, config}])")
    out: list[InteractionEntry] = []
    for i, it in enumerate(items):
        where = f"interaction config {path!r}, interaction[{i}]"
        if not isinstance(it, dict):
            raise ToolConfigError(f"{where}: expected a mapping with name, class_name and config")
        cls = it.get("class_name")
        if not isinstance(cls, str) or not cls.strip():
            raise ToolConfigError(f"{where}: class_name must name the interaction's class "
                                  "('package.module.Class' or 'path/to/file.py:Class')")
        config = it.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}: config must be a mapping (the class's settings)")
        name = it.get("name") or _default_name(cls.strip())
        if not isinstance(name, str):
            raise ToolConfigError(f"{where}: name must be a string (what rows' "
                                  "extra_info.interaction_kwargs.name choose)")
        if any(e.name == name for e in out):
            raise ToolConfigError(f"{where}: a second interaction named {name!r}; names must be "
                                  "unique")
        cls = cls.strip()
        if cls == BUILTIN_GUESS:
            cls = f"{__name__}.GuessInteraction"
        out.append(InteractionEntry(name, cls, {**config, "name": name}))
        llm_user_config(out[-1])  # checked now
    return out


def interaction_entries(path: str) -> list[InteractionEntry]:
    """The interactions ``rollout.interaction_config_path`` names: :data:`BUILTIN_GUESS` or a
    verl interaction YAML (:func:`load_interaction_config`)."""
    if path == BUILTIN_GUESS:
        return [InteractionEntry("guess", f"{__name__}.GuessInteraction", {"name": "guess"})]
    if path == BUILTIN_LLM_USER:
        return [InteractionEntry("llm_user", BUILTIN_LLM_USER,
                                 {**LLM_USER_DEFAULTS, "name": "llm_user"})]
    return load_interaction_config(path)


def llm_user_config(entry: InteractionEntry) -> dict | None:
    """The LLM user's settings of ``entry`` (:data:`LLM_USER_DEFAULTS` under the entry's
    ``config``), checked; None for an interaction class."""
    if entry.class_name != BUILTIN_LLM_USER:
        return None
    cfg = {**LLM_USER_DEFAULTS, **entry.config}
    if not (isinstance(cfg["max_tokens"], int) and cfg["max_tokens"] > 0):
        raise ToolConfigError(f"interaction {entry.name!r} (builtin:llm_user): config.max_tokens "
                              f"must be a positive integer, got {cfg['max_tokens']!r}")
    if not (isinstance(cfg["temperature"], (int, float)) and cfg["temperature"] >= 0):
        raise ToolConfigError(f"interaction {entry.name!r} (builtin:llm_user): "
                              f"config.temperature must be >= 0, got {cfg['temperature']!r}")
    return cfg


def row_interaction(kwargs: Any, names: list[str], row: int) -> dict:
    """A row's ``extra_info["interaction_kwargs"]`` checked: a mapping whose ``name`` is one of
    the config's interactions (verl raises the same)."""
    if not isinstance(kwargs, dict) or "name" not in kwargs:
        raise ToolConfigError(f"row {row}: extra_info.interaction_kwargs must be a mapping with "
                              f"a 'name' (one of {names}), as verl requires with "
                              "interaction_config_path")
    if kwargs["name"] not in names:
        raise ToolConfigError(f"row {row}: interaction {kwargs['name']!r} is not in the "
                              f"interaction config (its interactions: {names})")
    return dict(kwargs)


async def _maybe_await(value):
    import asyncio

    return await value if asyncio.iscoroutine(value) else value


class HostedInteraction:
    """An interaction class served by the tool host as a tool: ``create`` starts an
    interaction, ``execute`` (``parameters``: ``messages``, ``kwargs``, ``seed``) is one
    ``generate_response``, answered as JSON (``terminate``, ``response``, ``score``),
    ``release`` finalizes it."""

    def __init__(self, config: dict, tool_schema: Any = None):
        cls = load_tool_class(config["class_name"], _METHODS, "interaction")
        self.name = config["config"].get("name", "")
        self.inner = cls(config=dict(config["config"]))

    async def create(self, instance_id: str, **kwargs) -> str:
        await _maybe_await(self.inner.start_interaction(instance_id, **kwargs))
        return instance_id

    async def execute(self, instance_id: str, parameters: dict, **_):
        random.seed(int(parameters.get("seed", 0)))
        out = await _maybe_await(self.inner.generate_response(
            instance_id, parameters["messages"], **dict(parameters.get("kwargs") or {})))
        if not (isinstance(out, tuple) and len(out) == 4):
            raise TypeError(f"generate_response returned {type(out).__name__}, not "
                            "(should_terminate_sequence, response, turn_score, extra)")
        terminate, response, score, _extra = out
        if not isinstance(response, str):
            raise TypeError(f"generate_response's response is a {type(response).__name__}, "
                            "not a str")
        if score is not None:
            score = float(score)
            if not math.isfinite(score):
                raise ValueError(f"generate_response's turn score is {score}; a score must be "
                                 "a finite number (or None)")
        return json.dumps({"terminate": bool(terminate), "response": str.__str__(response),
                           "score": score}), 0.0, {}

    async def calc_reward(self, instance_id: str, **_) -> float:
        return 0.0

    async def release(self, instance_id: str, **_) -> None:
        fin = getattr(self.inner, "finalize_interaction", None)
        if callable(fin):
            try:
                await _maybe_await(fin(instance_id))
            except TypeError:  # verl's BaseInteraction.finalize_interaction(self)
                await _maybe_await(fin())


# ---------------------------------------------------------------- the built-in scripted user
GUESS_RANGE = (1, 7)
"""The guessing game's numbers (``data.synthetic_task=guess``): interval halving finds any of
them in 3 guesses."""


class GuessInteraction:
    """The guessing game's scripted user: a hidden integer (``interaction_kwargs["target"]``, in
    ``low``..``high``); after each assistant turn it reads the last assistant message as a
    number and answers ``higher``, ``lower`` or ``correct`` (then the episode ends, turn score
    1.0); anything else gets ``low-high?`` (turn score 0)."""

    def __init__(self, config: dict):
        self.config = config
        self.name = config.get("name", "guess")
        self._target: dict[str, tuple[int, int, int]] = {}

    async def start_interaction(self, instance_id: str | None = None, target: int = 0,
                                low: int = GUESS_RANGE[0], high: int = GUESS_RANGE[1],
                                **_) -> str:
        self._target[instance_id] = (int(target), int(low), int(high))
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict], **_):
        target, low, high = self._target[instance_id]
        last = next((m.get("content") or "" for m in reversed(messages)
                     if m.get("role") == "assistant"), "")
        text = last.strip()
        if not (text.isdigit() and low <= int(text) <= high):
            return False, f"{low}-{high}?", 0.0, {}
        guess = int(text)
        if guess == target:
            return True, "correct", 1.0, {}
        return False, "higher" if target > guess else "lower", 0.0, {}

    async def finalize_interaction(self, instance_id: str | None = None, **_) -> None:
        self._target.pop(instance_id, None)
