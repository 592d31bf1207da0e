"""Checkpoint benchmark: throughput vs torch.save/torch.load, incremental bytes, async blocking.

    python bench/checkpoint.py --repeat 5           # 27M-param Llama + AdamW (326 MB) on CPU
    python bench/checkpoint.py --layers 12 --dir /mnt/nfs/tmp

Everything is measured in the same process on the same filesystem (``--dir``, default a temp dir):

* hash throughput on 16 MiB objects (the chunk size): sha256 and BLAKE3, one thread and the
  store's I/O pool;
* save/load MB/s of the full training state (policy + AdamW state + RNG) with ``CheckpointManager``
  (every save through torch.distributed.checkpoint with the run store as its storage layer;
  objects named and verified by sha256 or by BLAKE3, atomic renames, manifest verify; with and
  without fsync) against ``torch.save`` / ``torch.load`` of the same state dict
  (``weights_only=True`` cannot load it: the numpy RNG state is refused, so the baseline needs a
  full unpickle);
* the same as a resume does it: into a live model and optimizer (``load_state_dict``), ours
  reading the weights straight into the parameters (``load(out=)``, as ``RunWorker`` does, and
  ``load_distributed``, DCP's in-place load as a data-parallel worker does it);
* bytes written by a 2nd checkpoint after one optimizer step, full fine-tune vs the bottom half of
  the decoder layers (and the embeddings) frozen;
* time the training loop is blocked by ``AsyncCheckpointer.save`` vs a synchronous save;
* the local-disk tier (``checkpoint.local_dir``): time blocked by a synchronous save into the run
  store (``--store``, default a folder under ``--dir``; pass ``s3://…`` for shared storage) vs one
  committed to local disk with replication to the store in the background.
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

from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

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


def hash_rates(repeat: int) -> list[tuple[str, str, str]]:
    """GB/s of sha256 and BLAKE3 over 16 MiB objects, one thread and the store's I/O pool."""
    from concurrent.futures import ThreadPoolExecutor

    from verl_core.store import hash_hex

    bufs = [os.urandom(16 << 20) for _ in range(8)]
    rows = []
    for algo in ("sha256", "blake3"):
        for threads in (1, 4):
            times = []
            with ThreadPoolExecutor(threads) as ex:
                for _ in range(repeat + 1):
                    t0 = time.perf_counter()
                    list(ex.map(lambda b: hash_hex([b], algo), bufs))
                    times.append(time.perf_counter() - t0)
            rate = len(bufs) * (16 << 20) / statistics.median(times[1:]) / 1e9
            rows.append((f"hash  {algo}, 16 MiB objects, {threads} thread(s)", "",
                         f"{rate:7.2f} GB/s"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--repeat", type=int, default=3, help="median of this many runs")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--store", default=None,
                    help="run store of the local-tier rows (default: a folder under --dir)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    rows: list[tuple[str, str, str]] = hash_rates(args.repeat)
    algos = ("sha256", "blake3")
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

        def ours_save(i, fsync, algo):
            root = os.path.join(base, f"store-{algo}-{int(fsync)}-{i}")
            mgr = CheckpointManager(RunStore(root, fsync=fsync), hash_algo=algo)
            return mgr, mgr.save(1, state, {"step": 1})

        res: dict[str, list[float]] = {}
        saved: dict[str, tuple] = {}
        for i in range(args.repeat + 1):
            saves = [("ts", lambda: torch_save(i)), ("tsf", lambda: torch_save(i, True))]
            for a in algos:
                saves += [(f"os-{a}", lambda a=a: ours_save(i, False, a)),
                          (f"osf-{a}", lambda a=a: ours_save(i, True, a))]
            k = i % len(saves)
            for key, fn in saves[k:] + saves[:k]:  # rotate who goes first
                os.sync()  # start every write with no dirty-page backlog (page cache throttling)
                t0 = time.perf_counter()
                out = fn()
                res.setdefault(key, []).append(time.perf_counter() - t0)
                if key == "ts":
                    pt = out
                if key.startswith("osf-"):
                    saved[key[4:]] = out
            loads = [("tl", lambda: torch.load(pt, weights_only=False))]
            # weights_only=True refuses this state (numpy RNG arrays): the baseline needs a full
            # unpickle
            loads += [(f"ol-{a}", lambda a=a: saved[a][0].load(saved[a][1].name)) for a in algos]
            k = i % len(loads)
            for key, fn in loads[k:] + loads[:k]:
                os.sync()
                t0 = time.perf_counter()
                fn()
                res.setdefault(key, []).append(time.perf_counter() - t0)
            for name in os.listdir(base):  # keep the disk small
                if name.endswith(f"-{i - 1}") or name.endswith(f"-{i - 1}.pt"):
                    p = os.path.join(base, name)
                    shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
        t = {k: statistics.median(v[1:]) for k, v in res.items()}
        rows += [
            ("save  torch.save", f"{t['ts']:6.2f} s", f"{mb / t['ts']:7.0f} MB/s"),
            ("save  torch.save + fsync", f"{t['tsf']:6.2f} s", f"{mb / t['tsf']:7.0f} MB/s"),
        ]
        for a in algos:
            rows += [
                (f"save  CheckpointManager {a} (fsync off)", f"{t['os-' + a]:6.2f} s",
                 f"{mb / t['os-' + a]:7.0f} MB/s"),
                (f"save  CheckpointManager {a} (fsync on, default)", f"{t['osf-' + a]:6.2f} s",
                 f"{mb / t['osf-' + a]:7.0f} MB/s"),
            ]
        rows.append(("load  torch.load (full unpickle: the only way this state loads)",
                     f"{t['tl']:6.2f} s", f"{mb / t['tl']:7.0f} MB/s"))
        rows += [(f"load  CheckpointManager {a} (every object re-hashed)", f"{t['ol-' + a]:6.2f} s",
                  f"{mb / t['ol-' + a]:7.0f} MB/s") for a in algos]
        for a in algos:
            rows += [
                (f"ratio save CheckpointManager {a} / torch.save (fsync on / off)",
                 f"{t['tsf'] / t['osf-' + a]:6.2f}x",
                 f"{t['ts'] / t['os-' + a]:.2f}x without fsync (>= 1: not slower)"),
                (f"ratio load CheckpointManager {a} / torch.load",
                 f"{t['tl'] / t['ol-' + a]:6.2f}x", "(>= 1: not slower)"),
            ]
        # ---------------------------------------------------------------- resume into a model
        # What a resume does: torch.load + load_state_dict, against a verified load straight into
        # the live parameters (as RunWorker does) and DCP's in-place load_distributed (as a
        # data-parallel worker does); all then load the optimizer moments.
        m2, o2 = build(args, freeze_half=False)
        train_step(m2, o2, args.vocab)
        live = {"policy": m2.state_dict()}

        def torch_resume():
            sd = torch.load(pt, weights_only=False)
            m2.load_state_dict(sd["policy"])
            o2.load_state_dict(sd["optimizer"])

        def ours_resume(a):
            mgr, info = saved[a]
            groups, _, _ = mgr.load(info.name, out=live)
            m2.load_state_dict(groups["policy"])  # the same tensors: nothing is copied
            o2.load_state_dict(groups["optimizer"])

        fqn_saved = {}  # the same state keyed by parameter name, as FSDP2 workers save it
        for a in algos:
            mgr = saved[a][0]
            fqn_saved[a] = mgr, mgr.save(2, {"policy": get_model_state_dict(model),
                                             "optimizer": get_optimizer_state_dict(model, opt),
                                             "rng": state["rng"]}, {"step": 2})

        def dcp_resume(a):
            mgr, info = fqn_saved[a]
            target = {"policy": get_model_state_dict(m2),
                      "optimizer": get_optimizer_state_dict(m2, o2)}
            mgr.load_distributed(info.name, target, groups=["policy", "optimizer"])
            set_model_state_dict(m2, target["policy"])
            set_optimizer_state_dict(m2, o2, target["optimizer"])

        resumes = [("t", torch_resume)] + [(f"o-{a}", lambda a=a: ours_resume(a)) for a in algos]
        resumes += [(f"d-{a}", lambda a=a: dcp_resume(a)) for a in algos]
        rt: dict[str, list[float]] = {}
        for i in range(args.repeat + 1):
            k = i % len(resumes)
            for key, fn in resumes[k:] + resumes[:k]:
                t0 = time.perf_counter()
                fn()
                rt.setdefault(key, []).append(time.perf_counter() - t0)
        r = {k: statistics.median(v[1:]) for k, v in rt.items()}
        rows.append(("resume torch.load + load_state_dict (model, optimizer)", f"{r['t']:6.2f} s",
                     f"{mb / r['t']:7.0f} MB/s"))
        for a in algos:
            rows += [
                (f"resume CheckpointManager.load(out=live params) + optimizer, {a}",
                 f"{r['o-' + a]:6.2f} s",
                 f"{mb / r['o-' + a]:7.0f} MB/s, {r['t'] / r['o-' + a]:.2f}x of torch (>= 1: not "
                 "slower)"),
                (f"resume CheckpointManager.load_distributed (DCP, in place), {a}",
                 f"{r['d-' + a]:6.2f} s",
                 f"{mb / r['d-' + a]:7.0f} MB/s, {r['t'] / r['d-' + a]:.2f}x of torch"),
            ]
        mgr, info = saved[algos[0]]

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

        # ---------------------------------------------------------------- local-disk tier
        from verl_core.checkpoint.local_tier import Replicator, open_local_store

        remote = CheckpointManager(RunStore(args.store or os.path.join(base, "run-store")))
        local = CheckpointManager(open_local_store(os.path.join(base, "local"), remote.store))
        rep = Replicator(local, remote)
        direct_times, tier_times, repl_times = [], [], []
        try:
            for i in range(args.repeat):
                train_step(m, o, args.vocab)
                os.sync()
                t0 = time.perf_counter()
                remote.save(2 * i + 1, state_of(m, o), {})
                direct_times.append(time.perf_counter() - t0)
                train_step(m, o, args.vocab)
                os.sync()
                t0 = time.perf_counter()
                rep.submit(local.save(2 * i + 2, state_of(m, o), {}))
                tier_times.append(time.perf_counter() - t0)
                if rep.flush(600):
                    raise RuntimeError(f"replication to {remote.store.uri} did not finish")
                repl_times.append(time.perf_counter() - t0)
        finally:
            rep.close()
        t_direct, t_tier = statistics.median(direct_times), statistics.median(tier_times)
        rows += [
            (f"blocked: sync save to the run store ({remote.store.uri if args.store else '--dir'})",
             f"{t_direct:6.2f} s", ""),
            ("blocked: sync save with checkpoint.local_dir", f"{t_tier:6.2f} s",
             f"{t_tier / t_direct:6.1%} of direct (replicated after "
             f"{statistics.median(repl_times):.2f} s)"),
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
