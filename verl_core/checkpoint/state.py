"""Nested training state <-> (flat tensors, JSON tree), with no pickle anywhere.

What belongs here: the encoding of optimizer/scheduler ``state_dict()``s, RNG states, sampler
positions, counters, guard state and metrics history. Tensors go to ``tensors.py`` (safetensors
chunks); everything else becomes plain JSON. A value that is neither raises
:class:`CheckpointSaveError` naming its path: there is deliberately no "pickle it" fallback, so a
checkpoint can never execute code when it is read.

JSON tree encoding (a plain JSON value stays itself; a few ``$``-tagged objects mark the rest)::

    {"$t": name}                     a tensor, stored in the flat tensor dict under ``name``
    {"$np": name, "dtype": "uint32"} a numpy array (stored as a tensor)
    {"$tuple": [...]}                a tuple (``torch.Size`` too)
    {"$dict": [[k, v], ...]}         a dict whose keys are not all str, or start with "$"
    {"$f": "nan" | "inf" | "-inf"}   a non-finite float
    {"$bytes": "<base64>"}           bytes
    {"$dtype": "float32"}            a torch dtype
    {"$device": "cpu"}               a torch device
    {"$npscalar": "float64", "v": x} a numpy scalar

Tensor names are the '/'-joined key path (``state/0/exp_avg``), so a flat ``model.state_dict()``
keeps its own keys, which is what resharding and HF export rely on. This tree is also where the
non-tensor values of a torch.distributed.checkpoint save go (``manager.save_distributed``): DCP
itself only ever sees the tensors, so its default of pickling everything else never applies.
"""

from __future__ import annotations

import base64
import math
import random
from typing import Any, Mapping

import numpy as np
import torch

from verl_core.errors import CheckpointSaveError, CorruptObjectError

__all__ = ["flatten_state", "unflatten_state", "check_state_tree", "to_json", "from_json",
           "capture_rng_state", "restore_rng_state"]

_NP_TO_TORCH = {np.dtype(k): v for k, v in [
    ("float64", torch.float64), ("float32", torch.float32), ("float16", torch.float16),
    ("int64", torch.int64), ("int32", torch.int32), ("int16", torch.int16), ("int8", torch.int8),
    ("uint8", torch.uint8), ("bool", torch.bool)]}
_NP_WIDEN = {np.dtype("uint32"): np.dtype("int64"), np.dtype("uint16"): np.dtype("int32")}
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def flatten_state(obj: Any, *, allow_tensors: bool = True) -> tuple[dict[str, Any], Any]:
    """Split nested state into ``(tensors, tree)``: ``tensors`` maps path names to tensors (or
    DTensors, kept as they are), ``tree`` is JSON-able and references them by name."""
    tensors: dict[str, Any] = {}

    def name_for(path: list[str]) -> str:
        base = "/".join(path) if path else "_"
        name, k = base, 1
        while name in tensors:
            name, k = f"{base}#{k}", k + 1
        return name

    def enc(v: Any, path: list[str]) -> Any:
        where = "/".join(path) or "<root>"
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, int) and not isinstance(v, bool):
            return v
        if isinstance(v, float):
            if math.isfinite(v):
                return v
            return {"$f": "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")}
        if isinstance(v, torch.Tensor):  # DTensors too: torch.distributed.checkpoint plans them
            if not allow_tensors:
                raise CheckpointSaveError(f"{where}: tensors are not allowed here (meta must be "
                                          "JSON-able); put them in a tensor group instead")
            name = name_for(path)
            tensors[name] = v
            return {"$t": name}
        if isinstance(v, np.ndarray):
            if not allow_tensors:
                raise CheckpointSaveError(f"{where}: numpy arrays are not allowed in meta")
            arr = v.astype(_NP_WIDEN[v.dtype]) if v.dtype in _NP_WIDEN else v
            if arr.dtype not in _NP_TO_TORCH:
                raise CheckpointSaveError(f"{where}: numpy dtype {v.dtype} is not supported")
            name = name_for(path)
            tensors[name] = torch.from_numpy(np.ascontiguousarray(arr)).clone()
            return {"$np": name, "dtype": str(v.dtype)}
        if isinstance(v, np.generic):
            return {"$npscalar": str(v.dtype), "v": enc(v.item(), path)}
        if isinstance(v, torch.dtype):
            return {"$dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"$device": str(v)}
        if isinstance(v, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(v)).decode()}
        if isinstance(v, tuple):
            return {"$tuple": [enc(x, path + [str(i)]) for i, x in enumerate(v)]}
        if isinstance(v, list):
            return [enc(x, path + [str(i)]) for i, x in enumerate(v)]
        if isinstance(v, Mapping):
            if all(isinstance(k, str) and not k.startswith("$") for k in v):
                return {k: enc(x, path + [k]) for k, x in v.items()}
            return {"$dict": [[enc(k, path + ["key"]), enc(x, path + [str(k)])]
                              for k, x in v.items()]}
        raise CheckpointSaveError(
            f"{where}: values of type {type(v).__module__}.{type(v).__qualname__} cannot be "
            "checkpointed (only tensors, numpy arrays, JSON scalars, lists, tuples and dicts; "
            "pickle is never used). Convert it with its own state_dict()/to_dict().")

    tree = enc(obj, [])
    return tensors, tree


def unflatten_state(tensors: Mapping[str, torch.Tensor], tree: Any, *, what: str = "state") -> Any:
    """Inverse of :func:`flatten_state`. Malformed trees raise :class:`CorruptObjectError`."""
    return _decode(tree, tensors, what, data=True)


def check_state_tree(tree: Any, dtypes: Mapping[str, torch.dtype], *, what: str = "state") -> None:
    """Every check :func:`unflatten_state` makes, without the tensor data: ``dtypes`` maps each
    stored tensor's name to its dtype (what a manifest's index says). ``verify`` runs it on every
    group, so a checkpoint passes verification only with trees that load decodes."""
    _decode(tree, dtypes, what, data=False)


# torch dtypes a "$np" entry may name: those flatten_state stores numpy arrays as (not bf16)
_NP_TENSOR_DTYPES = frozenset(_NP_TO_TORCH.values())


def _decode(tree: Any, tensors: Mapping[str, Any], what: str, *, data: bool) -> Any:
    """The one decoder behind :func:`unflatten_state` (``data``: ``tensors`` holds tensors) and
    :func:`check_state_tree` (``tensors`` holds dtypes; tensor leaves decode to None). Anything it
    does not accept raises :class:`CorruptObjectError`, never another exception."""

    def bad(why: str):
        raise CorruptObjectError(f"{what}: malformed state tree ({why})")

    def np_dtype(name: str):
        """A numpy dtype named in the tree: numbers and bools only (never object)."""
        try:
            dtype = np.dtype(name)
        except (TypeError, ValueError):
            bad(f"unknown numpy dtype {name!r}")
        if dtype.kind not in "biuf":
            bad(f"numpy dtype {dtype} is not allowed")
        return dtype

    def stored(name: Any, tag: str):
        if not isinstance(name, str) or name not in tensors:
            bad(f"{tag} {name!r} is referenced but not stored")
        return tensors[name]

    def dec(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, list):
            return [dec(x) for x in v]
        if not isinstance(v, dict):
            bad(f"unexpected JSON value {type(v).__name__}")
        tags = [k for k in v if isinstance(k, str) and k.startswith("$")]
        if not tags:
            return {k: dec(x) for k, x in v.items()}
        tag = tags[0]
        if tag == "$t":
            t = stored(v["$t"], "tensor")
            return t if data else None
        if tag == "$np":
            t = stored(v["$np"], "numpy array")
            if (t.dtype if data else t) not in _NP_TENSOR_DTYPES:
                bad(f"numpy array {v['$np']!r} is stored as {t.dtype if data else t}, which "
                    "numpy cannot hold")
            if not isinstance(v.get("dtype"), str):
                bad(f"numpy array {v['$np']!r} has no dtype")
            dtype = np_dtype(v["dtype"])
            return t.numpy().astype(dtype) if data else None
        if tag == "$tuple" and isinstance(v["$tuple"], list):
            return tuple([dec(x) for x in v["$tuple"]])
        if tag == "$dict" and isinstance(v["$dict"], list):
            out = {}
            for kv in v["$dict"]:
                if not isinstance(kv, list) or len(kv) != 2:
                    bad("bad $dict item")
                k = dec(kv[0])
                try:
                    hash(k)
                except TypeError:
                    bad(f"unhashable dict key {k!r}")
                out[k] = dec(kv[1])
            return out
        if tag == "$f" and v["$f"] in ("nan", "inf", "-inf"):
            return float(v["$f"])
        if tag == "$bytes" and isinstance(v["$bytes"], str):
            try:
                return base64.b64decode(v["$bytes"], validate=True)
            except ValueError:  # binascii.Error
                bad("$bytes is not base64")
        if tag == "$dtype" and isinstance(v["$dtype"], str) and v["$dtype"] in _TORCH_DTYPES:
            return _TORCH_DTYPES[v["$dtype"]]
        if tag == "$device" and isinstance(v["$device"], str):
            try:
                return torch.device(v["$device"])
            except (RuntimeError, ValueError):
                bad(f"bad device {v['$device']!r}")
        if tag == "$npscalar" and isinstance(v["$npscalar"], str):
            dtype, x = np_dtype(v["$npscalar"]), dec(v.get("v"))
            if not isinstance(x, (bool, int, float)):
                bad(f"numpy scalar value {x!r} is not a number")
            try:
                return dtype.type(x)
            except (OverflowError, ValueError, TypeError) as e:
                bad(f"numpy scalar {x!r} does not fit {dtype} ({e})")
        bad(f"unknown tag {tag!r}")

    try:
        return dec(tree)
    except RecursionError:
        bad("nested too deeply")


def to_json(obj: Any) -> Any:
    """Encode a JSON-like value (NaN, tuples, int-keyed dicts allowed; no tensors)."""
    return flatten_state(obj, allow_tensors=False)[1]


def from_json(tree: Any, *, what: str = "meta") -> Any:
    return unflatten_state({}, tree, what=what)


# ---------------------------------------------------------------------------- RNG
def capture_rng_state() -> dict:
    """Every global RNG a training step may touch: python ``random``, numpy's legacy global RNG,
    torch CPU and (when initialised) every CUDA device. Returns nested state for a checkpoint group
    (tensors inside); ``flatten_state(capture_rng_state())`` gives the ``(tensors, json)`` form."""
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` captured. CUDA states are restored only when the
    same number of devices is visible (otherwise a warning is logged and they are skipped)."""
    import logging

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.asarray(npst[1], dtype=np.uint32), int(npst[2]), int(npst[3]),
                         float(npst[4])))
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    cuda = state.get("cuda")
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all([t.to(torch.uint8).cpu() for t in cuda])
        else:
            logging.getLogger(__name__).warning(
                "checkpoint has %d CUDA RNG states but %d devices are visible; not restoring them",
                len(cuda), torch.cuda.device_count() if torch.cuda.is_available() else 0)
