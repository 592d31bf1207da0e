"""Load any Hugging Face causal LM, its tokenizer, and a critic initialised from it.

Only local folders are loaded (``local_files_only=True``): a training job must never reach out to
a hub at run time. Store URIs are materialised into a local folder by the caller first.
"""

from __future__ import annotations

import json
import math
import os
import struct

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer
from transformers.utils import logging as hf_logging

from verl_core.errors import PermanentError


class ModelLoadError(PermanentError, ValueError):
    """The model folder is missing or incomplete; the message names the folder and the fix.
    Permanent: a retry reads the same folder."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _check_folder(path: str, what: str = "model.path") -> None:
    if not path or not os.path.isdir(path):
        hint = (" or leave model.path empty to build the tiny model" if what == "model.path"
                else "")
        raise ModelLoadError(
            f"{what}: model folder {path!r} does not exist; pass a local Hugging Face folder "
            f"(config.json + *.safetensors + tokenizer files){hint}")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model folder {path!r} has no config.json; is it a Hugging Face "
                             "model folder (save_pretrained output)?")


# bytes per element of each safetensors dtype (the format's own list)
_ST_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2,
             "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
             "F64": 8, "C64": 8}
_PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_HEADER = 100 << 20  # the safetensors library's own limit on a header (100 MB)


def check_model_folder(path: str, what: str = "model.path") -> None:
    """Check a model folder without loading (or unpickling) anything: ``config.json`` parses, the
    weights are safetensors (a pickle-only folder is refused: loading it could run code), every
    safetensors header parses, its tensors' byte sizes add up to the file's size, and embedding
    shapes agree with the config's ``vocab_size`` x ``hidden_size``. Reads only headers (a few KB
    per file), so prepare runs it before anything is copied or warm-started. Raises
    :class:`ModelLoadError` naming ``what``, the file and the fix."""
    where = f"{what}={path!r}"
    _check_folder(path, what)
    try:
        with open(os.path.join(path, "config.json"), "rb") as f:
            config = json.loads(f.read())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{where}: config.json does not parse ({e}); save the folder again "
                             "with save_pretrained") from e
    if not isinstance(config, dict):
        raise ModelLoadError(f"{where}: config.json is not a JSON object")
    names = sorted(os.listdir(path))
    shards = [n for n in names if n.endswith(".safetensors")]
    if not shards:
        pickles = [n for n in names if n.endswith(_PICKLE_WEIGHTS)]
        if pickles:
            raise ModelLoadError(
                f"{where}: its weights are pickle files only ({', '.join(pickles)}), which are "
                "never loaded (unpickling can run arbitrary code); convert it to safetensors: in "
                "an environment you trust, load it and save_pretrained(folder, "
                "safe_serialization=True)")
        raise ModelLoadError(f"{where}: no *.safetensors weights; save the model into the folder "
                             "with save_pretrained(folder, safe_serialization=True)")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, "rb") as f:
                wanted = set(json.loads(f.read())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{where}: model.safetensors.index.json does not parse ({e}); "
                                 "save the folder again with save_pretrained") from e
        missing = sorted(str(w) for w in wanted if w not in shards)
        if missing:
            raise ModelLoadError(f"{where}: model.safetensors.index.json names shards that are "
                                 f"not in the folder: {', '.join(missing[:5])}; copy the whole "
                                 "folder")
    for name in shards:
        _check_safetensors(os.path.join(path, name), where, config)


def _check_safetensors(file: str, where: str, config: dict) -> None:
    """One safetensors file: ``<u64 header length N><N bytes of JSON header><tensor bytes>``;
    every tensor's ``data_offsets`` span prod(shape) x its dtype's size, and the spans tile the
    byte buffer exactly (what the safetensors library checks when it opens the file)."""
    name = os.path.basename(file)
    size = os.path.getsize(file)

    def bad(why: str) -> ModelLoadError:
        return ModelLoadError(f"{where}: {name} is not a valid safetensors file ({why}); the "
                              "file is damaged or truncated: copy or save the model again")

    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise bad(f"{size} bytes, shorter than its 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise bad(f"header length {n} does not fit in the file's {size} bytes")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise bad(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    spans, buffer = [], size - 8 - n
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            numel = math.prod(int(d) for d in shape)
            want = numel * _ST_BYTES[dtype]
        except (KeyError, TypeError, ValueError) as e:
            raise bad(f"tensor {tensor!r} has a malformed entry ({e!r})") from None
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
            raise bad(f"tensor {tensor!r} has data_offsets {info['data_offsets']!r}")
        if end - begin != want:
            raise bad(f"tensor {tensor!r} ({dtype} {list(shape)}) spans {end - begin} bytes, "
                      f"its shape needs {want}")
        spans.append((begin, end, tensor))
        _check_shape(tensor, shape, config, where, name)
    at = 0
    for begin, end, tensor in sorted(spans):
        if begin != at:
            raise bad(f"tensor {tensor!r} starts at byte {begin}, expected {at} (a gap or an "
                      "overlap)")
        at = end
    if at != buffer:
        raise bad(f"its tensors span {at} bytes, the file holds {buffer} after the header")


def _check_shape(tensor: str, shape, config: dict, where: str, name: str) -> None:
    """Embedding and output matrices are (vocab_size, hidden_size) in every HF causal LM (and
    the sequence classifiers built on them): the one shape check that needs no architecture."""
    vocab, hidden = config.get("vocab_size"), config.get("hidden_size")
    if not (isinstance(vocab, int) and isinstance(hidden, int)):
        return
    if tensor.endswith(("embed_tokens.weight", "wte.weight", "lm_head.weight")):
        if list(shape) != [vocab, hidden]:
            raise ModelLoadError(
                f"{where}: {name}: {tensor} has shape {list(shape)}, but config.json says "
                f"vocab_size={vocab} x hidden_size={hidden}; the weights and the config belong to "
                "different models: save the folder again with save_pretrained")


def _load_failed(what: str, path: str, e: Exception) -> ModelLoadError:
    """A load error with the folder named. torch's advice for a refused pickle ("Re-running
    torch.load with weights_only=False will likely succeed") would run the pickle: it is
    replaced by the safe fix."""
    text = str(e)
    if "weights_only" in text:
        text = ("its weights are a pickle that is refused (unpickling can run arbitrary code); "
                "convert it to safetensors: in an environment you trust, load it and "
                "save_pretrained(folder, safe_serialization=True)")
    return ModelLoadError(f"cannot load {what} from {path!r}: {text}")


def _json_eos(path: str, name: str) -> set[int]:
    """The ``eos_token_id`` (an int, a list of ints, or absent) of ``name`` in the folder."""
    file = os.path.join(path, name)
    if not os.path.exists(file):
        return set()
    try:
        with open(file, "rb") as f:
            eos = json.loads(f.read()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{file} does not parse ({e}); save the folder again with "
                             "save_pretrained") from e
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
        raise ModelLoadError(f"{file}: eos_token_id={eos!r} is not a token id or a list of token "
                             "ids; fix the file (e.g. [151645, 151643])")
    return set(eos)


def resolve_eos_token_ids(path: str, tokenizer) -> tuple[int, ...]:
    """Every id that ends a response of the model in ``path`` (sorted): the tokenizer's EOS,
    ``generation_config.json``'s ``eos_token_id`` and ``config.json``'s (each an int or a list).

    Why the union: vLLM (verl's rollout) stops at the tokenizer's EOS plus the generation config's
    list, Hugging Face ``generate`` at the generation config's (``config.json``'s when there is no
    generation config). A Qwen2.5-Instruct model ends a turn with ``<|im_end|>`` or
    ``<|endoftext|>``, a Llama-3.1 one with any of three ids: a response stopped at any of them
    by either engine is stopped here too, and scored without the stop token."""
    ids = _json_eos(path, "generation_config.json") | _json_eos(path, "config.json")
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def load_tokenizer(path: str):
    """Tokenizer from a local folder, left-padded (generation appends on the right). Its
    ``stop_token_ids`` attribute holds the model's EOS set (:func:`resolve_eos_token_ids`), which
    the engines stop at and the reward decode cuts at
    (:func:`verl_core.reward.decode.stop_token_ids`)."""
    _check_folder(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder named
        raise ModelLoadError(f"cannot load a tokenizer from {path!r}: {e}") from e
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ModelLoadError(f"tokenizer in {path!r} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise ModelLoadError(f"tokenizer in {path!r} has no eos token: generation could not stop")
    tok.stop_token_ids = resolve_eos_token_ids(path, tok)
    return tok


def _from_pretrained(auto, what: str, path: str, dtype: str, fresh: tuple[str, ...] = (),
                     **kwargs) -> torch.nn.Module:
    """``auto.from_pretrained`` of a local folder, every weight accounted for: transformers
    initialises a weight missing from the safetensors at random and only logs a table about it
    (a truncated or hand-edited checkpoint would train from noise), so the missing keys are
    checked here; ``fresh`` names the prefixes that are new by design (a critic's value head),
    whose LOAD REPORT table is noise and is silenced for the load."""
    _check_folder(path)
    verbosity = hf_logging.get_verbosity()
    if fresh:
        hf_logging.set_verbosity_error()
    try:
        model, info = auto.from_pretrained(path, local_files_only=True, dtype=_DTYPES[dtype],
                                           output_loading_info=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with the folder named
        raise _load_failed(what, path, e) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(fresh or ("\0",)))
    if missing:
        raise ModelLoadError(
            f"cannot load {what} from {path!r}: the weights {missing[:5]} are not in the folder's "
            f"safetensors ({len(missing)} missing; they would start as random noise): give a "
            "complete folder (re-export or re-download it)")
    model.eval()
    return model


def load_causal_lm(path: str, dtype: str = "float32") -> torch.nn.Module:
    """``AutoModelForCausalLM`` from a local folder, in training mode off (eval)."""
    return _from_pretrained(AutoModelForCausalLM, "a causal LM", path, dtype)


def load_critic(path: str, dtype: str = "float32") -> torch.nn.Module:
    """A value model: the policy's backbone + a fresh scalar head per token (verl's critic is
    ``AutoModelForTokenClassification(num_labels=1)`` initialised from the actor)."""
    _check_folder(path)
    try:
        # classifier_dropout=0: a value head should regress, not be regularised by noise (and
        # dropout would make the update depend on global RNG)
        config = AutoConfig.from_pretrained(path, num_labels=1, local_files_only=True)
        config.classifier_dropout = 0.0
    except Exception as e:  # noqa: BLE001
        raise _load_failed("a critic", path, e) from None
    return _from_pretrained(AutoModelForTokenClassification, "a critic", path, dtype,
                            fresh=("score.", "classifier."), config=config)


_ST_FLOATS = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
              "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def stored_dtype(path: str) -> str:
    """The dtype a model folder's weights are stored in: the floating dtype holding most elements
    of its safetensors files (headers only), else config.json's ``torch_dtype``/``dtype``, else
    "unknown"."""
    count: dict[str, int] = {}
    for name in sorted(os.listdir(path)) if os.path.isdir(path) else []:
        if not name.endswith(".safetensors"):
            continue
        try:
            with open(os.path.join(path, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(min(n, _MAX_HEADER)))
            for tensor, info in header.items():
                if tensor != "__metadata__" and info.get("dtype") in _ST_FLOATS:
                    dt = _ST_FLOATS[info["dtype"]]
                    count[dt] = count.get(dt, 0) + math.prod(int(d) for d in info["shape"])
        except (OSError, ValueError, struct.error, AttributeError, TypeError):
            continue  # check_model_folder names a damaged file; this is only the console line
    if count:
        return max(count, key=count.get)
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        return str(config.get("torch_dtype") or config.get("dtype") or "unknown")
    except (OSError, ValueError, AttributeError):
        return "unknown"


def precision_line(path: str, dtype: str) -> str:
    """The run's one console line on precision: what the folder stores, what training computes
    in and keeps as master weights (``dtype``: ``model.dtype``)."""
    stored = stored_dtype(path)
    if dtype == "bfloat16":
        how = ("trains in bfloat16 compute over float32 master weights and float32 AdamW state; "
               "reference and rollout weights bfloat16")
    else:
        how = (f"trains in {dtype} throughout; model.dtype=bfloat16 would compute in bf16 over "
               "float32 master weights")
    return f"[verl] model weights stored in {stored}; model.dtype={dtype}: {how}"


def check_config_overrides(source: str, overrides: dict) -> None:
    """Every key of ``overrides`` (``model.override_config``) names a field of the model's
    config (config.json's own, or a default of its config class), else :class:`ModelLoadError`
    naming the fields: run at prepare, before any work."""
    known = AutoConfig.from_pretrained(source).to_dict()
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ModelLoadError(
            f"model.override_config names {unknown}, which the config of {source} "
            f"({known.get('model_type')}) has no field for; its fields: "
            f"{', '.join(sorted(known))}")


def write_overridden_folder(source: str, folder: str, overrides: dict) -> str:
    """``folder``: the model folder ``source`` with ``overrides`` (``model.override_config``)
    written into its config.json; every other file hard-linked (copied across file systems).
    Each override must name a field the model's config has (config.json's own, or a default of
    its config class): a typo is refused naming the fields, as :class:`ModelLoadError`."""
    import shutil

    check_config_overrides(source, overrides)
    os.makedirs(folder, exist_ok=True)
    for name in sorted(os.listdir(source)):
        src, dst = os.path.join(source, name), os.path.join(folder, name)
        if name == "config.json" or not os.path.isfile(src):
            continue
        try:
            os.link(src, dst)
        except OSError:  # another file system: the bytes, once
            shutil.copy2(src, dst)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.update(overrides)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return folder
