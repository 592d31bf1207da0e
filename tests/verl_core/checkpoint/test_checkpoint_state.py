"""Nested state <-> (tensors, JSON) without pickle; RNG capture/restore."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from verl_core.checkpoint import (
    CheckpointSaveError,
    CorruptObjectError,
    capture_rng_state,
    flatten_state,
    restore_rng_state,
    unflatten_state,
)
from verl_core.checkpoint.state import check_state_tree


def test_optimizer_state_roundtrip():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    tensors, tree = flatten_state(sd)
    json.dumps(tree)  # plain JSON
    assert set(tensors) == {"state/0/step", "state/0/exp_avg", "state/0/exp_avg_sq",
                            "state/1/step", "state/1/exp_avg", "state/1/exp_avg_sq"}
    back = unflatten_state(tensors, json.loads(json.dumps(tree)))
    assert back["param_groups"][0]["betas"] == (0.8, 0.9)  # tuple survives
    assert list(back["state"]) == [0, 1]  # int keys survive
    opt2 = torch.optim.AdamW(model.parameters())
    opt2.load_state_dict(back)


def test_awkward_values():
    state = {"nan": float("nan"), "inf": -float("inf"), "b": b"\x00\x01", "t": (1, [2, 3]),
             "$weird": 1, 5: "int key", "np": np.arange(3, dtype=np.uint32),
             "npf": np.float32(1.5), "dtype": torch.bfloat16, "size": torch.Size([2, 3]),
             "none": None}
    tensors, tree = flatten_state(state)
    back = unflatten_state(tensors, json.loads(json.dumps(tree)))
    assert np.isnan(back["nan"]) and back["inf"] == -float("inf") and back["b"] == b"\x00\x01"
    assert back["t"] == (1, [2, 3]) and back["$weird"] == 1 and back[5] == "int key"
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2]
    assert back["npf"] == np.float32(1.5) and back["dtype"] is torch.bfloat16
    assert tuple(back["size"]) == (2, 3) and back["none"] is None


def test_unsupported_values_are_refused_not_pickled():
    class Thing:
        pass

    with pytest.raises(CheckpointSaveError, match="sampler/obj.*Thing.*pickle is never used"):
        flatten_state({"sampler": {"obj": Thing()}})


def test_malformed_tree_is_refused():
    with pytest.raises(CorruptObjectError, match="not stored"):
        unflatten_state({}, {"$t": "missing"})
    with pytest.raises(CorruptObjectError, match="unknown tag"):
        unflatten_state({}, {"$pickle": "gASV..."})


def _deep(n):
    tree = []
    for _ in range(n):
        tree = [tree]
    return tree


@pytest.mark.parametrize("bad", [
    {"$np": "x", "dtype": "object"}, {"$np": "h", "dtype": "float32"}, {"$np": "x"},
    {"$t": ["x"]}, {"$t": "missing"}, {"$dtype": "object"}, {"$dtype": ["float32"]},
    {"$bytes": "not base64!"}, {"$npscalar": "uint8", "v": 300},
    {"$npscalar": "float64", "v": [1, 2]}, {"$npscalar": None, "v": 1}, {"$device": "gpu:x"},
    {"$dict": [[[1], 2]]}, {"$pickle": "gASV"}, _deep(5000),
], ids=lambda b: "deep" if isinstance(b, list) else json.dumps(b))
def test_check_state_tree_refuses_exactly_what_unflatten_refuses(bad):
    # verify runs check_state_tree (dtypes from the index, no data); load runs unflatten_state
    tensors = {"x": torch.arange(3), "h": torch.zeros(2, dtype=torch.bfloat16)}
    dtypes = {k: v.dtype for k, v in tensors.items()}
    with pytest.raises(CorruptObjectError, match="here: malformed state tree"):
        unflatten_state(tensors, {"a": bad}, what="here")
    with pytest.raises(CorruptObjectError, match="here: malformed state tree"):
        check_state_tree({"a": bad}, dtypes, what="here")


def test_check_state_tree_accepts_what_flatten_writes():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {"opt": opt.state_dict(), "rng": capture_rng_state(),
             "perm": np.arange(5, dtype=np.uint32),
             "k": (1, float("nan"), b"\x00", torch.float16, np.float32(2.5), {3: "int key"})}
    tensors, tree = flatten_state(state)
    check_state_tree(json.loads(json.dumps(tree)), {k: v.dtype for k, v in tensors.items()})


def test_rng_state_restores_every_generator():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = capture_rng_state()
    tensors, tree = flatten_state(state)
    first = (random.random(), np.random.rand(), torch.rand(2).tolist(), np.random.randn())
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    restore_rng_state(unflatten_state(tensors, json.loads(json.dumps(tree))))
    again = (random.random(), np.random.rand(), torch.rand(2).tolist(), np.random.randn())
    assert first == again
