"""Checkpoint benchmark: throughput vs torch.save/torch.load, incremental bytes, async blocking.

    python bench/checkpoint.py --repeat 5           # 27M-param Llama + AdamW (326 MB) on CPU
    python bench/checkpoint.py --layers 12 --dir /mnt/nfs/tmp

Everything is measured in the same process on the same filesystem (``--dir``, default a temp dir):

* the same as a resume does it: into a live model and optimizer (``load_state_dict``), ours
  reading the weights straight into the parameters (``out=``), as ``RunWorker`` does;
* save/load MB/s of the full training state (policy + AdamW state + RNG) with ``CheckpointManager``
  (sha256 of every object, atomic renames, manifest verify; with and without fsync) against
  ``torch.save`` / ``torch.load`` of the same state dict (``weights_only=True`` cannot load
  it: the numpy RNG state is refused, so the baseline needs a full unpickle);
* bytes written by a 2nd checkpoint after one optimizer step, full fine-tune vs the bottom half of
  the decoder layers (and the embeddings) frozen;
* time the training loop is blocked by ``AsyncCheckpointer.save`` vs a synchronous save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_core.checkpoint import (  # noqa: E402
    AsyncCheckpointer,
    CheckpointManager,
    RunStore,
    capture_rng_state,
)


def build(args, freeze_half: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=8,
                      vocab_size=args.vocab, max_position_embeddings=128)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if freeze_half:
        model.model.embed_tokens.requires_grad_(False)
        for layer in model.model.layers[: args.layers // 2]:
            layer.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def train_step(model, opt, vocab):
    ids = torch.randint(0, vocab, (2, 16))
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_of(model, opt):
    return {"policy": model.state_dict(), "optimizer": opt.state_dict(), "rng": capture_rng_state()}


def nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--repeat", type=int, default=3, help="median of this many runs")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    rows: list[tuple[str, str, str]] = []
    try:
        model, opt = build(args, freeze_half=False)
        train_step(model, opt, args.vocab)  # AdamW state exists
        state = state_of(model, opt)
        params_mb = nbytes(state["policy"]) / 1e6
        total = nbytes(state)
        mb = total / 1e6
        print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params "
              f"({params_mb:.0f} MB fp32); full state with AdamW: {mb:.0f} MB; dir {base}; "
              f"{os.cpu_count()} CPUs; median of {args.repeat}")

        # ---------------------------------------------------------------- throughput
        # Interleaved (A B A B …, rotating who goes first), every save to a new file/store, each
        # started after os.sync(), median of --repeat after one warm-up round: the machine's noise
        # and the kernel's dirty-page throttling hit both sides alike.
        def torch_save(i, fsync=False):
            path = os.path.join(base, f"state-{int(fsync)}-{i}.pt")
            torch.save(state, path)
            if fsync:
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            return path

        def ours_save(i, fsync):
            root = os.path.join(base, f"store-{int(fsync)}-{i}")
            mgr = CheckpointManager(RunStore(root, fsync=fsync))
            return mgr, mgr.save(1, state, {"step": 1})

        res: dict[str, list[float]] = {k: [] for k in ("ts", "tsf", "os", "osf", "tl", "ol")}
        for i in range(args.repeat + 1):
            saves = [("ts", lambda: torch_save(i)), ("os", lambda: ours_save(i, False)),
                     ("tsf", lambda: torch_save(i, True)), ("osf", lambda: ours_save(i, True))]
            for key, fn in saves[i % 4:] + saves[: i % 4]:  # rotate who goes first
                os.sync()  # start every write with no dirty-page backlog (page cache throttling)
                t0 = time.perf_counter()
                out = fn()
                res[key].append(time.perf_counter() - t0)
                if key == "ts":
                    pt = out
                if key == "osf":
                    mgr, info = out
            for key, fn in (("tl", lambda: torch.load(pt, weights_only=False)),
                            ("ol", lambda: mgr.load(info.name))):
                # weights_only=True refuses this state (numpy RNG arrays): the baseline needs
                # a full unpickle
                os.sync()
                t0 = time.perf_counter()
                fn()
                res[key].append(time.perf_counter() - t0)
            for name in os.listdir(base):  # keep the disk small
                if name.endswith(f"-{i - 1}") or name.endswith(f"-{i - 1}.pt"):
                    p = os.path.join(base, name)
                    shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
        t_ts, t_tsf, t_os, t_osf, t_tl, t_ol = (statistics.median(res[k][1:]) for k in
                                                 ("ts", "tsf", "os", "osf", "tl", "ol"))
        rows += [
            ("save  torch.save", f"{t_ts:6.2f} s", f"{mb / t_ts:7.0f} MB/s"),
            ("save  torch.save + fsync", f"{t_tsf:6.2f} s", f"{mb / t_tsf:7.0f} MB/s"),
            ("save  CheckpointManager (fsync off)", f"{t_os:6.2f} s", f"{mb / t_os:7.0f} MB/s"),
            ("save  CheckpointManager (fsync on, default)", f"{t_osf:6.2f} s",
             f"{mb / t_osf:7.0f} MB/s"),
            ("load  torch.load (full unpickle: the only way this state loads)", f"{t_tl:6.2f} s",
             f"{mb / t_tl:7.0f} MB/s"),
            ("load  CheckpointManager (every object re-hashed)", f"{t_ol:6.2f} s",
             f"{mb / t_ol:7.0f} MB/s"),
            ("ratio save CheckpointManager / torch.save (fsync on / off)",
             f"{t_tsf / t_osf:6.2f}x", f"{t_ts / t_os:.2f}x without fsync (>= 1: not slower)"),
            ("ratio load CheckpointManager / torch.load", f"{t_tl / t_ol:6.2f}x",
             "(>= 1: not slower)"),
        ]
        # ---------------------------------------------------------------- resume into a model
        # What a resume does: torch.load + load_state_dict, against a verified load straight into
        # the live parameters (as RunWorker does); both then load the optimizer moments.
        m2, o2 = build(args, freeze_half=False)
        train_step(m2, o2, args.vocab)
        live = {"policy": m2.state_dict()}

        def torch_resume():
            sd = torch.load(pt, weights_only=False)
            m2.load_state_dict(sd["policy"])
            o2.load_state_dict(sd["optimizer"])

        def ours_resume():
            groups, _, _ = mgr.load(info.name, out=live)
            m2.load_state_dict(groups["policy"])  # the same tensors: nothing is copied
            o2.load_state_dict(groups["optimizer"])

        rt: dict[str, list[float]] = {"t": [], "o": []}
        for i in range(args.repeat + 1):
            for key, fn in ((("t", torch_resume), ("o", ours_resume)) if i % 2 else
                            (("o", ours_resume), ("t", torch_resume))):
                t0 = time.perf_counter()
                fn()
                rt[key].append(time.perf_counter() - t0)
        t_rt, t_ro = statistics.median(rt["t"][1:]), statistics.median(rt["o"][1:])
        rows += [
            ("resume torch.load + load_state_dict (model, optimizer)", f"{t_rt:6.2f} s",
             f"{mb / t_rt:7.0f} MB/s"),
            ("resume CheckpointManager.load(out=live params) + optimizer", f"{t_ro:6.2f} s",
             f"{mb / t_ro:7.0f} MB/s, {t_rt / t_ro:.2f}x of torch (>= 1: not slower)"),
        ]

        _, manifest = mgr.read_manifest(info.name)
        n_tensors = sum(len(g["tensors"]) for g in manifest["groups"].values())
        rows.append(("objects per checkpoint (small tensors packed)",
                     f"{len(manifest['objects']):>6}", f"for {n_tensors} tensors"))

        # ---------------------------------------------------------------- incremental bytes
        full_ckpt_bytes = None
        for label, freeze in (("full fine-tune", False), ("half the layers frozen", True)):
            m, o = build(args, freeze_half=freeze)
            train_step(m, o, args.vocab)
            store = RunStore(os.path.join(base, f"incr-{int(freeze)}"))
            mgr2 = CheckpointManager(store)
            mgr2.save(1, state_of(m, o), {"step": 1})
            first = store.reset_stats().bytes_written
            full_ckpt_bytes = full_ckpt_bytes or first
            train_step(m, o, args.vocab)
            mgr2.save(2, state_of(m, o), {"step": 2})
            second = store.reset_stats().bytes_written
            trainable = sum(p.numel() for p in m.parameters() if p.requires_grad) / \
                sum(p.numel() for p in m.parameters())
            rows.append((f"2nd ckpt, {label} (trainable {trainable:.0%} of params)",
                         f"{second / 1e6:6.1f} MB",
                         f"{second / first:6.1%} of its 1st, {second / full_ckpt_bytes:6.1%} "
                         "of a full-FT ckpt"))

        # ---------------------------------------------------------------- async blocking
        m, o = build(args, freeze_half=False)
        train_step(m, o, args.vocab)
        amgr = CheckpointManager(RunStore(os.path.join(base, "async")))
        amgr.save(0, state_of(m, o), {})
        sync_times, block_times, bg_times = [], [], []
        with AsyncCheckpointer(amgr) as ac:
            for i in range(args.repeat):
                train_step(m, o, args.vocab)
                os.sync()
                t0 = time.perf_counter()
                amgr.save(2 * i + 1, state_of(m, o), {})
                sync_times.append(time.perf_counter() - t0)
                train_step(m, o, args.vocab)
                os.sync()
                t0 = time.perf_counter()
                ac.save(2 * i + 2, state_of(m, o), {})
                block_times.append(ac.last_blocking_s)
                ac.wait()
                bg_times.append(time.perf_counter() - t0)
        t_sync, t_block = statistics.median(sync_times), statistics.median(block_times)
        rows += [
            ("blocked: sync save (all weights changed)", f"{t_sync:6.2f} s", ""),
            ("blocked: AsyncCheckpointer.save (CPU snapshot)", f"{t_block:6.2f} s",
             f"{t_block / t_sync:6.1%} of sync (write took "
             f"{statistics.median(bg_times):.2f} s in the background)"),
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)

    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    print(f"\n| {'measurement'.ljust(w0)} | {'time/bytes'.rjust(w1)} | rate / ratio")
    print(f"|{'-' * (w0 + 2)}|{'-' * (w1 + 2)}|{'-' * 40}")
    for a, b, c in rows:
        print(f"| {a.ljust(w0)} | {b.rjust(w1)} | {c}")


if __name__ == "__main__":
    main()
