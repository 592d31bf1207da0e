"""The model side of a run as parts that own their state (docs/design.md#layers, the model side).

- :class:`Actor`: the policy (LoRA adapters if any: the one holder of that fact), its optimizer
  and schedule, the reference policy, the KL controller; ``update()``.
- :class:`Behaviour`: the weights that sample, their version, the rollout engine and the
  background rollout (on-policy is staleness 0 of the same object).
- :class:`Critic`: the value model, its optimizer and schedule.
- :class:`Teacher`: on-policy distillation's frozen teacher (no state: rebuilt from the assets).

Each hands its state to a checkpoint as groups (``state_dict``), names the groups a resume
fills in place (``load_targets``) and takes them back (``load_state_dict``): a checkpoint is one
loop over the parts (``RLTrainer.state``)."""

from verl_core.parts.actor import Actor
from verl_core.parts.behaviour import Behaviour
from verl_core.parts.critic import Critic
from verl_core.parts.teacher import Teacher

__all__ = ["Actor", "Behaviour", "Critic", "Teacher"]
