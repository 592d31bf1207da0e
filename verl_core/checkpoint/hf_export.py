"""Hugging Face export: a checkpoint's policy -> a folder ``from_pretrained`` (and vLLM) can load.

Conventions (what the trainer saves so export works):

* group ``"policy"`` is ``model.state_dict()`` (flat ``{name: tensor}``);
* ``meta["hf_config"]`` is ``model.config.to_dict()`` (optionally ``meta["hf_generation_config"]``);
* the user's model folder is recorded once per run with :func:`store_tokenizer` (shared doc
  ``shared/tokenizer.json`` listing content-addressed files, kept alive by garbage collection):
  its tokenizer files and ``generation_config.json`` as the user gave them, and the dtype its
  weights are stored in.

Faithful to the user's folder (:func:`write_hf_folder`, which the CLI export, the workflow's
finalize and the plain loop's ``final_model`` all go through): ``generation_config.json`` (the EOS
list, sampling defaults) and the tokenizer files are the user's own bytes, never our in-memory
tokenizer (left padding, a pad token added where the model has none); tied weights stay tied (no
``lm_head.weight`` when ``config.tie_word_embeddings``); the weights are in the folder's stored
dtype unless ``dtype`` says otherwise (a bfloat16 model trained in float32 exports in bfloat16).

The folder gets ``config.json``, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` +
``model.safetensors.index.json`` above ``max_shard_bytes``), the carried files and
``verl_checkpoint.json`` (provenance: store, checkpoint name, step). It is assembled in a temporary
sibling folder and renamed into place, so a crash never leaves a half-written export behind.

Every export (this one, and the final model a run's finalize phase publishes into its store with
:func:`publish_export`) ends with a completion marker, ``verl_export.json``: the name, size and
sha256 of every other file, written last. A rename is atomic on a local or NFS folder, but S3 has
none, so there the files are uploaded with ``config.json`` (what makes a folder look like a
model) just before the marker: a crash mid-upload leaves a folder without ``config.json``, and
:func:`verify_export` (what readers call) refuses anything without a matching marker.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from typing import Any, Callable, Optional, Union

import torch

from verl_core.errors import CorruptObjectError, UnsafeManifestError
from verl_core.checkpoint.manager import CheckpointManager
from verl_core.checkpoint.manifest import CheckpointInfo
from verl_core.layout import TOKENIZER_DOC
from verl_core.store import RunStore, check_sha256, sha256_hex

__all__ = ["store_tokenizer", "load_tokenizer_files", "export_hf", "publish_export", "verify_export",
           "write_hf_folder", "export_trained", "model_folder_files", "TOKENIZER_DOC",
           "EXPORT_MARKER"]

log = logging.getLogger(__name__)

EXPORT_MARKER = "verl_export.json"
"""Completion marker of an export folder, written last (:func:`write_export_marker`)."""
EXPORT_FORMAT = "verl-export/1"
_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,199}$")
# the files of a model folder an export carries over byte for byte: every tokenizer file
# transformers writes or reads (fast and slow tokenizers, chat templates) and the generation
# config; never weights, config.json (rewritten from the trained model's) or anything else
_CARRIED_RE = re.compile(r"^(tokenizer[\w.\-]*|special_tokens_map\.json|added_tokens\.json|"
                         r"chat_template[\w.\-]*|vocab\.(json|txt)|merges\.txt|[\w.\-]*\.tiktoken|"
                         r"[\w.\-]*sentencepiece[\w.\-]*\.model|spiece\.model|"
                         r"generation_config\.json)$")


def _check_file_name(name: Any) -> str:
    if not isinstance(name, str) or not _FILE_RE.match(name) or ".." in name:
        raise UnsafeManifestError(f"tokenizer file name {name!r} is not a plain file name")
    return name


def model_folder_files(folder: str) -> dict[str, bytes]:
    """``{name: bytes}`` of the files an export carries over from a model folder as they are: its
    tokenizer files and ``generation_config.json`` (top level only)."""
    data = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if _CARRIED_RE.match(name) and os.path.isfile(path):
            with open(path, "rb") as f:
                data[_check_file_name(name)] = f.read()
    return data


def store_tokenizer(store: RunStore, tokenizer: Any) -> dict:
    """Record what an export carries over, once per run, as shared objects. ``tokenizer``: the
    user's model folder (a path: its :func:`model_folder_files` and the dtype its weights are
    stored in), or a tokenizer object (anything with ``save_pretrained``: its saved files only).
    Returns the doc ``{"files": {name: {"sha", "size"}}, "objects": {sha: size}[, "dtype"]}``."""
    files, objects, data, extra = {}, {}, {}, {}
    if isinstance(tokenizer, (str, os.PathLike)):
        data = model_folder_files(os.fspath(tokenizer))
        dtype = folder_export_dtype(os.fspath(tokenizer))
        if dtype is not None:
            extra["dtype"] = dtype
    else:
        with tempfile.TemporaryDirectory() as d:
            tokenizer.save_pretrained(d)
            for name in sorted(os.listdir(d)):
                path = os.path.join(d, name)
                if not os.path.isfile(path):
                    continue
                _check_file_name(name)
                with open(path, "rb") as f:
                    data[name] = f.read()
    for name, b in data.items():
        sha = sha256_hex([b])
        files[name] = {"sha": sha, "size": len(b)}
        objects[sha] = len(b)
    doc = {"files": files, "objects": objects, **extra}
    # the doc (a gc root) first, then the objects it names: a concurrent gc never sees them
    # without their root
    store.put_json(TOKENIZER_DOC, doc)
    for name, b in data.items():
        store.put_parts([b], sha=files[name]["sha"])
    return doc


def _tokenizer_doc(store: RunStore) -> Optional[dict]:
    doc = store.get_json(TOKENIZER_DOC, default=None)
    if doc is not None and (not isinstance(doc, dict) or not isinstance(doc.get("files"), dict)):
        raise CorruptObjectError(f"{TOKENIZER_DOC}.json in {store.uri} is malformed")
    return doc


def stored_export_dtype(store: RunStore) -> Optional[str]:
    """The dtype the run's model folder stored its weights in (recorded by
    :func:`store_tokenizer`), or None when the run recorded none (an older run, a tokenizer
    object): an export then keeps the checkpoint's dtype."""
    doc = _tokenizer_doc(store)
    dtype = doc.get("dtype") if doc else None
    return dtype if dtype in _EXPORT_DTYPES else None


def load_tokenizer_files(store: RunStore) -> dict[str, bytes]:
    """``{file name: verified bytes}`` of the stored tokenizer files (and generation config) ({} if
    none was stored)."""
    doc = _tokenizer_doc(store)
    if doc is None:
        return {}
    out = {}
    for name, ent in doc["files"].items():
        _check_file_name(name)
        sha = check_sha256(ent.get("sha") if isinstance(ent, dict) else None, f"tokenizer {name}")
        out[name] = store.get_bytes(sha, what=f"tokenizer file {name}")
    return out


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    return x


_EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tied_keys(config: dict, state: dict[str, torch.Tensor]) -> list[str]:
    """The state's keys that ``from_pretrained`` ties to another (``lm_head.weight`` to the input
    embedding when ``tie_word_embeddings``): saved once, under the embedding's name, as
    ``save_pretrained`` does. A key is dropped only if it equals its source tensor."""
    if not config.get("tie_word_embeddings", False):
        return []
    import transformers

    tied: Any = None
    for arch in config.get("architectures") or []:
        tied = getattr(getattr(transformers, str(arch), None), "_tied_weights_keys", None)
        if tied:
            break
    if not isinstance(tied, dict):  # transformers 5: {tied name: source name}
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
    return [k for k, src in tied.items() if k in state and src in state
            and state[k].shape == state[src].shape and torch.equal(state[k], state[src])]


def write_hf_folder(folder: str, state: dict[str, torch.Tensor], config: dict,
                    files: dict[str, bytes], *, dtype: Union[str, torch.dtype, None] = None,
                    max_shard_bytes: int = 5 << 30) -> None:
    """Write a Hugging Face folder into the existing local ``folder``: ``config.json`` (``config``,
    the trained model's ``config.to_dict()``, with its dtype set to the one written), the
    safetensors weights of ``state`` (``model.state_dict()``) cast to ``dtype`` (floating tensors;
    None keeps them) without the tied copies, and ``files`` (:func:`model_folder_files` of the
    user's folder, or :func:`load_tokenizer_files`) byte for byte. The one writer behind every
    export (see the module docstring)."""
    if isinstance(dtype, str):
        if dtype not in _EXPORT_DTYPES:
            raise ValueError(f"export dtype {dtype!r}: known: {', '.join(_EXPORT_DTYPES)}")
        dtype = _EXPORT_DTYPES[dtype]
    drop = set(_tied_keys(config, state))
    state = {k: v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()
             for k, v in state.items() if k not in drop}
    floats = [v.dtype for v in state.values() if v.is_floating_point()]
    if floats:  # the dtype from_pretrained(dtype="auto") loads in
        name = str(max(set(floats), key=floats.count)).removeprefix("torch.")
        config = {**config, "dtype": name}
        if "torch_dtype" in config:
            config["torch_dtype"] = name
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(_jsonable(config), f, indent=2, sort_keys=True)
    _write_weights(state, folder, max_shard_bytes)
    for name, data in files.items():
        with open(os.path.join(folder, _check_file_name(name)), "wb") as f:
            f.write(data)


def folder_export_dtype(folder: str) -> Optional[str]:
    """The dtype a model folder stores its weights in, if an export can write it (else None)."""
    from verl_core.models.loading import stored_dtype

    dtype = stored_dtype(folder)
    return dtype if dtype in _EXPORT_DTYPES else None


ADAPTER_FOLDER = "adapter"
"""Where a LoRA run's final model folder keeps its adapters (a PEFT adapter folder)."""


def export_trained(model: Any, folder: str, source: str,
                   state: Optional[dict[str, torch.Tensor]] = None, *,
                   merged: Optional[dict[str, torch.Tensor]] = None,
                   lora: Optional[dict] = None) -> None:
    """The trained ``model`` as a Hugging Face folder faithful to the user's model folder
    ``source`` (its tokenizer files and generation config as given, its stored dtype, tied
    weights once): the plain loop's ``final_model`` and the workflow's finalize (through
    ``Actor.export``). ``state``: the full state dict when ``model`` is sharded (gathered on this
    rank); default ``model.state_dict()``. A LoRA policy (``lora``: its adapters' settings,
    ``Actor.lora``) gives its ``merged`` weights (W + s B A: what vLLM and from_pretrained load)
    and gets its adapters written as PEFT writes them in adapter/
    (PeftModel.from_pretrained(base, folder/adapter))."""
    from verl_core.models.lora import adapter_weights, write_adapter_files

    os.makedirs(folder, exist_ok=True)
    full = model.state_dict() if state is None else state
    write_hf_folder(folder, full if merged is None else merged, model.config.to_dict(),
                    model_folder_files(source), dtype=folder_export_dtype(source))
    if lora is not None:
        write_adapter_files(os.path.join(folder, ADAPTER_FOLDER), adapter_weights(full),
                            lora, base=source)


def _write_weights(state: dict[str, torch.Tensor], folder: str, max_shard_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in state:  # keep the model's own order
        t = state[name].contiguous()
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, os.path.join(folder, fname), metadata={"format": "pt"})
        names.append(fname)
        for k, t in sh.items():
            weight_map[k] = fname
            total += t.numel() * t.element_size()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def export_hf(manager: Union[CheckpointManager, RunStore, str], ref: str, out_dir: str, *,
              group: str = "policy", dtype: Optional[torch.dtype] = None,
              max_shard_bytes: int = 5 << 30, overwrite: bool = False,
              merge: bool = False) -> CheckpointInfo:
    """Write checkpoint ``ref`` (``latest``, ``auto``, a name …) of ``manager`` as a HF folder.

    Args:
        group: the group holding ``model.state_dict()``.
        dtype: the weights' dtype (``torch.bfloat16``, ``"float32"``, ...); None: the dtype the
            run's model folder stored them in (:func:`stored_export_dtype`), else as saved.
        max_shard_bytes: split ``model.safetensors`` above this size (HF's default is 5 GB).
        overwrite: replace an existing non-empty ``out_dir``.
        merge: a LoRA checkpoint (``meta["lora"]``): write the merged full model. Without it a
            LoRA checkpoint exports as a PEFT adapter folder (``adapter_config.json``,
            ``adapter_model.safetensors``) for ``PeftModel.from_pretrained`` on the base.
    Returns the exported checkpoint's info. Every object read is verified.
    """
    if not isinstance(manager, CheckpointManager):
        manager = CheckpointManager(manager)
    out_dir = os.path.abspath(out_dir)
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True")
    groups, meta, info = manager.load(ref, groups=[group])
    state = groups[group]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CorruptObjectError(f"checkpoint {info.name} group {group!r} is not a flat "
                                 "{name: tensor} state dict; cannot export it")
    config = meta.get("hf_config")
    if not isinstance(config, dict):
        raise CorruptObjectError(f"checkpoint {info.name} has no meta['hf_config']; save with "
                                 "meta={'hf_config': model.config.to_dict(), ...} to export it")
    lora = meta.get("lora") if group == "policy" else None
    if lora is not None:  # the adapters; the frozen base is the shared group "base"
        from verl_core.models.lora import adapter_weights, merged_state, write_adapter_files
        full = {**manager.load(ref, groups=["base"])[0]["base"], **state}
        if not merge:  # a PEFT adapter folder
            with _assembled(out_dir, info, manager) as tmp:
                write_adapter_files(tmp, adapter_weights(full), lora)
            return info
        state = merged_state(full, lora)
    if dtype is None:
        dtype = stored_export_dtype(manager.store)
    tokenizer_files = load_tokenizer_files(manager.store)
    gen = meta.get("hf_generation_config")
    if isinstance(gen, dict) and "generation_config.json" not in tokenizer_files:
        tokenizer_files = {**tokenizer_files, "generation_config.json":
                           json.dumps(_jsonable(gen), indent=2, sort_keys=True).encode()}
    with _assembled(out_dir, info, manager) as tmp:
        write_hf_folder(tmp, state, config, tokenizer_files, dtype=dtype,
                        max_shard_bytes=max_shard_bytes)
    return info


@contextlib.contextmanager
def _assembled(out_dir: str, info: CheckpointInfo, manager: CheckpointManager):
    """A temporary sibling folder for an export of checkpoint ``info`` to fill; on success the
    provenance file and the completion marker are added and it is renamed to ``out_dir``
    (replacing it), on failure removed."""
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        yield tmp
        with open(os.path.join(tmp, "verl_checkpoint.json"), "w") as f:
            json.dump({"store": manager.store.uri, "checkpoint": info.name, "step": info.step,
                       "config_hash": info.config_hash, "package_version": info.package_version},
                      f, indent=2)
        write_export_marker(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---------------------------------------------------------------------- completion marker
def _sha256(f) -> str:
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def write_export_marker(folder: str) -> dict:
    """Write :data:`EXPORT_MARKER` into the finished local ``folder``: size and sha256 of every
    other file in it. Returns the marker doc."""
    files = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name == EXPORT_MARKER or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            files[_check_file_name(name)] = {"size": os.path.getsize(path), "sha256": _sha256(f)}
    doc = {"format": EXPORT_FORMAT, "files": files}
    with open(os.path.join(folder, EXPORT_MARKER), "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
    return doc


def verify_export(uri: str, storage_options: Optional[dict] = None, *,
                  hashes: bool = False) -> list[str]:
    """Problems that make ``uri`` not a complete export ([] when it is one): no completion marker
    (its write was interrupted, or it is not an export), or a file missing or of another size
    (``hashes``: or another sha256) than the marker says. Readers of exports call this before
    they trust the folder."""
    import fsspec

    from verl_core.store import resolve_storage_options

    fs, path = fsspec.core.url_to_fs(uri, **resolve_storage_options(uri, storage_options))
    path = path.rstrip("/")
    try:
        with fs.open(f"{path}/{EXPORT_MARKER}", "rb") as f:
            doc = json.loads(f.read())
    except FileNotFoundError:
        return [f"{uri} is not a complete export: it has no {EXPORT_MARKER} (the export was "
                "interrupted before it finished); run the run's command again to export it "
                "again"]
    except ValueError as e:
        return [f"{uri}/{EXPORT_MARKER} is not valid JSON ({e}); run the run's command again to "
                "export it again"]
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, dict) or doc.get("format") != EXPORT_FORMAT:
        return [f"{uri}/{EXPORT_MARKER} is malformed (format {EXPORT_FORMAT!r} expected)"]
    problems = []
    for name, ent in sorted(files.items()):
        p = f"{path}/{_check_file_name(name)}"
        try:
            size = fs.size(p)
        except FileNotFoundError:
            problems.append(f"{uri}: {name} is missing")
            continue
        if size != ent.get("size"):
            problems.append(f"{uri}: {name} has {size} bytes, the marker says {ent.get('size')}")
        elif hashes:
            with fs.open(p, "rb") as f:
                digest = _sha256(f)
            if digest != ent.get("sha256"):
                problems.append(f"{uri}: {name} does not match its sha256 in the marker")
    return problems


def publish_export(folder: str, fs: Any, path: str, *,
                   fence: Optional[Callable[[str], None]] = None) -> None:
    """Copy the finished local HF folder ``folder`` to ``path`` on the fsspec filesystem ``fs``
    so that no reader ever sees a half export as a model folder, even if this process is
    killed at any point.

    Local (or NFS) filesystem: copied into a hidden sibling ``.<name>.tmp-<id>``, then renamed
    into place (an existing export of the same name is renamed away first). Object stores:
    every file but ``config.json`` first, then ``config.json``, then the marker
    (:data:`EXPORT_MARKER`, any old one removed first). ``fence`` (the run's lease check) is
    called right before the export becomes visible and refuses it by raising."""
    from fsspec.implementations.local import LocalFileSystem

    write_export_marker(folder)
    path = path.rstrip("/")
    parent, base = path.rsplit("/", 1)
    what = f"the export {path}"
    if isinstance(fs, LocalFileSystem):
        os.makedirs(parent, exist_ok=True)
        for stale in os.listdir(parent):  # left by an export killed midway (one writer: ours)
            if stale.startswith(f".{base}.tmp-") or stale.startswith(f".{base}.old-"):
                shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
        tmp = os.path.join(parent, f".{base}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            shutil.copytree(folder, tmp)
            if fence is not None:
                fence(what)
            old = None
            if os.path.exists(path):
                old = os.path.join(parent, f".{base}.old-{uuid.uuid4().hex[:8]}")
                os.rename(path, old)
            os.rename(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return
    fs.makedirs(path, exist_ok=True)
    if fs.exists(f"{path}/{EXPORT_MARKER}"):  # an older export of this name: incomplete from now
        fs.rm(f"{path}/{EXPORT_MARKER}")
    last = ("config.json", EXPORT_MARKER)
    names = sorted(n for n in os.listdir(folder) if n not in last) + list(last)
    for name in names:
        if name == "config.json" and fence is not None:
            fence(what)
        src = os.path.join(folder, name)
        if os.path.isfile(src):
            fs.put_file(src, f"{path}/{name}")
    log.info("export %s published (%d files)", path, len(names))
