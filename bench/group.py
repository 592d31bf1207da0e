"""Update throughput of the worker group: W = 1 against W = 2 data-parallel workers (FSDP2, gloo).

The real update (``verl_core.training.ppo.ppo_update``, the same call the worker group makes) on
the same batch, start weights and seed, one thread per worker so W = 2 uses two cores where
W = 1 uses one (the comparison a node with W accelerators makes). Each worker is its own process
(torch.multiprocessing, a gloo process group over loopback); W = 1 runs in a process of its own
too, measured in the same run. Prints samples/s per W and the ratio.

The model must be large enough that compute dominates: FSDP2 all-gathers every layer's weights
before its forward and backward and reduce-scatters its gradients, once per micro-batch, which on
gloo over loopback costs about as much as a small model's compute. The default (hidden 512, 4
layers, 17.8M parameters, 64 rows of 16+32 tokens per update, 32-row micro-batches) is such a
model; ``--hidden 64 --layers 2 --vocab 64`` is the size of the tiny CPU default model, where
the group gains almost nothing. The last line measures what two cores give two independent
processes with no communication at all, the ceiling any W = 2 ratio here is bounded by.

    python bench/group.py
    python bench/group.py --hidden 64 --layers 2      # the tiny CPU default model
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp


def _batch(vocab: int, rows: int, prompt_len: int, resp_len: int, seed: int = 0):
    from verl_core.data.batch import Batch

    g = torch.Generator().manual_seed(seed)
    resp = torch.randint(3, vocab, (rows, resp_len), generator=g)
    lengths = torch.randint(resp_len // 2, resp_len + 1, (rows,), generator=g)
    mask = (torch.arange(resp_len)[None, :] < lengths[:, None]).float()
    adv = torch.randn(rows, 1, generator=g).expand(rows, resp_len) * mask
    return Batch(prompt_ids=torch.randint(3, vocab, (rows, prompt_len), generator=g),
                 prompt_mask=torch.ones(rows, prompt_len, dtype=torch.long),
                 response_ids=resp, response_mask=mask, response_logprobs=torch.zeros(rows, resp_len),
                 group=torch.arange(rows) // 4, uid=[str(i) for i in range(rows)],
                 ground_truth=["0"] * rows, data_source=["bench"] * rows, extra_info=[{}] * rows,
                 advantages=adv.contiguous())


def _worker(rank: int, world: int, args, init: str, out: dict) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_core.config import AlgorithmConfig, OptimConfig
    from verl_core.training import sharding
    from verl_core.training.dist import SINGLE, init_process_group
    from verl_core.training.optim import make_optimizer, make_scheduler
    from verl_core.training.ppo import UpdateOptions, ppo_update

    torch.set_num_threads(1)
    dp = init_process_group("gloo", init, rank, world, 600) if world > 1 else SINGLE
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    if dp.distributed:
        sharding.shard(model)
    ocfg = OptimConfig(lr=1e-5, warmup_steps=0)
    opt = make_optimizer(model.parameters(), ocfg, ocfg.lr)
    sched = make_scheduler(opt, ocfg, 1000)
    batch = _batch(args.vocab, args.rows, args.prompt_len, args.resp_len)
    times = []
    for i in range(args.warmup + args.repeats):
        if dp.distributed:
            dp.barrier()
        t0 = time.perf_counter()
        ppo_update(model, opt, sched, batch,
                   UpdateOptions(algo=AlgorithmConfig(), temperature=1.0, mini_batch_rows=args.rows,
                                 micro_batch_rows=args.micro, epochs=1, grad_clip=1.0),
                   seed=i, dp=dp)
        if dp.distributed:
            dp.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out[world] = (statistics.median(times), sum(p.numel() for p in model.parameters()))
    if dp.distributed:
        import torch.distributed as dist

        dist.destroy_process_group()


def _matmuls(q) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    t0 = time.perf_counter()
    for _ in range(60):
        a @ b
    q.put(time.perf_counter() - t0)


def _ceiling() -> float:
    """Throughput of 2 independent single-threaded matmul processes over 1: what this machine's
    two cores give any data-parallel job with no communication at all (shared caches, memory
    bandwidth and clocks keep it below 2)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()

    def run(n: int) -> float:
        ps = [ctx.Process(target=_matmuls, args=(q,)) for _ in range(n)]
        for p in ps:
            p.start()
        for p in ps:
            p.join()
        return max(q.get() for _ in ps)

    one, two = [], []
    for _ in range(3):  # alternated, best of 3: the machine's noise hits both
        one.append(run(1))
        two.append(run(2))
    return 2 * min(one) / min(two)


def _measure(world: int, args) -> tuple[float, int]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as mgr, tempfile.TemporaryDirectory() as d:
        out = mgr.dict()
        procs = [ctx.Process(target=_worker, args=(r, world, args, f"file://{d}/pg", out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"worker failed with exit code {p.exitcode}")
        return out[world]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--rows", type=int, default=64, help="responses per update (one mini-batch)")
    p.add_argument("--micro", type=int, default=32, help="rows per forward/backward per worker")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--resp-len", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ceiling = _ceiling()
    res = {w: _measure(w, args) for w in (1, 2)}
    params = res[1][1]
    print(f"model: hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f}M parameters; "
          f"{args.rows} rows x {args.prompt_len}+{args.resp_len} tokens per update, "
          f"micro-batch {args.micro} rows per worker, 1 thread per worker")
    print(f"{'workers':>8} {'s/update':>9} {'samples/s':>10} {'vs W=1':>7}")
    base = args.rows / res[1][0]
    for w, (t, _) in sorted(res.items()):
        print(f"{w:>8} {t:>9.3f} {args.rows / t:>10.1f} {args.rows / t / base:>6.2f}x")
    print(f"machine ceiling: 2 independent 1-thread matmul processes give {ceiling:.2f}x of one")


if __name__ == "__main__":
    main()
