"""LoRA adapters on the policy with PEFT (``model.lora_rank`` > 0, verl's ``lora_*`` keys).

* :func:`apply_lora` wraps the loaded causal LM in a ``peft.PeftModel``: fresh adapters (B = 0,
  so the adapted model starts as the base; A drawn from a generator seeded by the run's seed, so
  every worker builds the same) or the adapter folder ``model.lora_adapter_path``. The base's
  weights are frozen; only the adapters train.
* The reference model is the policy with its adapters off (``Actor.reference``, PEFT's
  ``disable_adapter``), as verl does when ``lora_rank > 0``: no second copy of the base.
* Whether the policy is LoRA is the actor's to say (``verl_core/parts/actor.py``,
  ``Actor.lora``); nothing here sniffs a model for it.
* Checkpoints split the policy in two groups (:func:`split_state`): ``policy`` holds the
  adapters (what trains) and ``base`` the frozen weights, a shared group stored once per run.
* :func:`merged_state` is the policy as one plain model's state dict (W' = W + s B A, base
  names): what the rollout copy (W > 1), the vLLM engine and the final model export load.
* :func:`check_lora` refuses, when the run is prepared, targets that match no module and an
  adapter folder that is not an adapter of this base, naming the key and the fix.
"""

from __future__ import annotations

import json
import os
import re

import torch

from verl_core.errors import PermanentError

ADAPTER = "default"  # PEFT's name of the one adapter
PREFIX = "base_model.model."  # what PEFT puts before the wrapped model's parameter names


class LoRAConfigError(PermanentError, ValueError):
    """A ``model.lora_*`` value this run cannot use (names the key and the fix)."""


def module_names(text: str) -> list[str] | str:
    """``model.target_modules`` / ``exclude_modules`` -> what PEFT takes (``all-linear`` stays a
    string)."""
    text = text.strip()
    if text == "all-linear":
        return text
    return [n.strip() for n in text.split(",") if n.strip()]


def lora_config(mc):
    """The ``peft.LoraConfig`` of the ``model`` section (dropout 0: the update's log-probs must
    be the rollout's, and verl's default is 0 too)."""
    import peft

    return peft.LoraConfig(r=mc.lora_rank, lora_alpha=mc.lora_alpha,
                           target_modules=module_names(mc.target_modules),
                           exclude_modules=module_names(mc.exclude_modules) or None,
                           lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")


def apply_lora(model: torch.nn.Module, mc, seed: int) -> torch.nn.Module:
    """``model`` (float32 masters) wrapped with the adapters of ``mc`` (a ``ModelConfig``);
    the base frozen. Fresh adapters are drawn under ``seed`` and nothing else, so W workers
    build identical ones."""
    import peft

    if mc.lora_adapter_path:
        return peft.PeftModel.from_pretrained(model, mc.lora_adapter_path, is_trainable=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, lora_config(mc))


def split_state(model, state: dict) -> tuple[dict, dict]:
    """A LoRA policy's state dict (``get_model_state_dict``) -> (trainable, frozen): the
    adapters and the base weights, by the parameters' ``requires_grad``."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return ({k: v for k, v in state.items() if k in trainable},
            {k: v for k, v in state.items() if k not in trainable})


def scalings(model) -> dict[str, float]:
    """Each adapted layer's name -> its scale (``lora_alpha / r``, or PEFT's rsLoRA scale)."""
    return {name: float(m.scaling[ADAPTER]) for name, m in model.named_modules()
            if isinstance(getattr(m, "scaling", None), dict) and ADAPTER in m.scaling}


def merged_state(state: dict[str, torch.Tensor],
                 scale: dict[str, float] | dict) -> dict[str, torch.Tensor]:
    """A LoRA policy's full state dict (PEFT names, plain tensors: gathered when sharded) ->
    the merged model's: W + s B A on each adapted weight, under the base model's names.

    By hand rather than PEFT's ``merge_and_unload``: that merges modules in place (the live,
    possibly sharded policy) or needs a deep copy of the model; this reads a state dict the
    caller already has, and is PEFT's ``get_delta_weight`` for a linear layer (B @ A x s)."""
    if "r" in scale and "lora_alpha" in scale:  # a checkpoint's meta["lora"]: one scale
        s = meta_scale(scale)
        scale = {k.rsplit(".base_layer.", 1)[0]: s for k in state if ".base_layer." in k}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        name = key.removeprefix(PREFIX).replace(".base_layer.", ".")
        layer = key.rsplit(".base_layer.", 1)[0] if ".base_layer." in key else None
        if layer is not None and key.endswith(".base_layer.weight") and layer in scale:
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            value = (value.float() + scale[layer] * (b @ a)).to(value.dtype)
        out[name] = value
    return out


def check_lora(mc, model) -> None:
    """Refuse, before any work, LoRA settings that cannot apply to ``model`` (the base causal
    LM, loaded): targets or exclusions that match no module, an adapter folder that is missing,
    is not a PEFT LoRA adapter, or was made for another base or another rank."""
    if not mc.lora_rank:
        return
    import peft

    if mc.lora_adapter_path:
        _check_adapter(mc, model)
        return
    names = [n for n, _ in model.named_modules()]
    for key in ("target_modules", "exclude_modules"):
        wanted = module_names(getattr(mc, key))
        if wanted == "all-linear" or not wanted:
            continue
        missing = [w for w in wanted if not any(n == w or n.endswith("." + w) for n in names)]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                             if isinstance(m, torch.nn.Linear)})
            raise LoRAConfigError(
                f"model.{key}={getattr(mc, key)!r}: {missing} match no module of this model; "
                f"its linear layers are {linear} (or use all-linear)")
    try:
        peft.get_peft_model(_skeleton(model), lora_config(mc))
    except ValueError as e:  # PEFT's own refusal (e.g. a target that is not a supported layer)
        raise LoRAConfigError(f"model.target_modules={mc.target_modules!r}: {e}") from e


def _skeleton(model):
    """``model``'s structure on the meta device (no memory), for PEFT to try its config on."""
    with torch.device("meta"):
        return type(model)(model.config)


def _check_adapter(mc, model) -> None:
    path = mc.lora_adapter_path
    conf_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(conf_file):
        raise LoRAConfigError(f"model.lora_adapter_path={path!r}: no adapter_config.json there; "
                              "point it at a PEFT adapter folder (what "
                              "`python -m verl_core.checkpoint export` writes for a LoRA run)")
    with open(conf_file) as f:
        conf = json.load(f)
    if str(conf.get("peft_type", "")).upper() != "LORA":
        raise LoRAConfigError(f"model.lora_adapter_path={path!r}: a {conf.get('peft_type')!r} "
                              "adapter, not LoRA")
    if int(conf.get("r", -1)) != mc.lora_rank:
        raise LoRAConfigError(f"model.lora_adapter_path={path!r}: an adapter of rank "
                              f"{conf.get('r')}, but model.lora_rank={mc.lora_rank}; set "
                              f"model.lora_rank={conf.get('r')}")
    from safetensors import SafetensorError, safe_open

    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        raise LoRAConfigError(f"model.lora_adapter_path={path!r}: no adapter_model.safetensors")
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    try:  # the header and the file's length: a copy cut short is refused here, not by PEFT
        opened = safe_open(weights, "pt")
    except SafetensorError as e:
        raise LoRAConfigError(
            f"model.lora_adapter_path={path!r}: {weights} is not a readable safetensors file "
            f"({e}): damaged or incomplete (a copy cut short?); copy or export the adapter "
            "again") from None
    with opened as f:
        for key in f.keys():
            # PEFT's saved names: base_model.model.<module>.lora_A.weight -> <module>.weight
            m = re.match(rf"{re.escape(PREFIX)}(.+)\.lora_([AB])\.weight$", key)
            if m is None:
                continue
            base = shapes.get(f"{m.group(1)}.weight")
            got = tuple(f.get_slice(key).get_shape())
            want = None if base is None else ((mc.lora_rank, base[1]) if m.group(2) == "A"
                                              else (base[0], mc.lora_rank))
            if got != want:
                raise LoRAConfigError(
                    f"model.lora_adapter_path={path!r}: {key} has shape {list(got)}, but this "
                    f"model's {m.group(1)} needs {None if want is None else list(want)}: an "
                    "adapter made for another base model (set model.path to its base)")


def lora_meta(model) -> dict:
    """The adapters' settings, as a checkpoint's meta keeps them (JSON): what an export rebuilds
    them with."""
    conf = model.peft_config[ADAPTER]

    def names(v):
        return v if v is None or isinstance(v, str) else sorted(v)
    return {"r": int(conf.r), "lora_alpha": float(conf.lora_alpha),
            "target_modules": names(conf.target_modules),
            "exclude_modules": names(conf.exclude_modules), "use_rslora": bool(conf.use_rslora)}


def meta_model(path: str):
    """The causal LM of the Hugging Face folder ``path`` built on the meta device from its
    config (structure and shapes, no memory): what :func:`check_lora` checks against."""
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(conf)


def meta_scale(meta: dict) -> float:
    """The adapters' scale from a checkpoint's ``meta["lora"]`` (PEFT's: alpha / r, or
    alpha / sqrt(r) with rsLoRA)."""
    r = meta["r"]
    return meta["lora_alpha"] / (r ** 0.5 if meta.get("use_rslora") else r)


def adapter_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A LoRA policy's state dict -> its adapters under the names PEFT saves them with (the
    adapter's name dropped: ``...q_proj.lora_A.weight``). By hand because an export from a
    checkpoint has no model to give PEFT's ``get_peft_model_state_dict`` (one way for both
    exports); the tests load the result with ``PeftModel.from_pretrained``."""
    return {k.replace(f".{ADAPTER}.", "."): v for k, v in state.items() if ".lora_" in k}


def write_adapter_files(folder: str, weights: dict[str, torch.Tensor], meta: dict,
                        base: str = "") -> None:
    """``adapter_model.safetensors`` and the ``adapter_config.json`` of ``meta`` (a
    checkpoint's ``meta["lora"]``) into ``folder``."""
    import peft
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()},
              os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    peft.LoraConfig(r=meta["r"], lora_alpha=meta["lora_alpha"],
                    target_modules=meta["target_modules"],
                    exclude_modules=meta.get("exclude_modules"),
                    use_rslora=bool(meta.get("use_rslora")), lora_dropout=0.0, bias="none",
                    task_type="CAUSAL_LM",
                    base_model_name_or_path=base or None).save_pretrained(folder)
