"""Rollout throughput: the ``hf`` and ``vllm`` engines against ``transformers``' ``generate``.

One command, two models: (a) the default tiny model (``build_tiny_model()``: Llama, hidden 64, 2
layers, 2 heads of 32; 64 prompts x 8 samples = 512 rows, 8 new tokens) and (b) a ~30M-parameter
Qwen2-shaped model (hidden 512, 8 layers, 8 heads of 64, 2 KV heads, intermediate 1408, vocab
16384, tied embeddings; random init, seeded; 32 rows of 32 random prompt ids, 128 new tokens).
Same sampling for every engine: temperature 1, top-p 1, top-k off, stop on EOS; tokens/s counts
the tokens each engine generated (up to and including a row's EOS) over the call's wall time. The
tiny model stops on its tokenizer's EOS, as the default rollout does. The Qwen2 model's stop id is
an ordinary token (vLLM refuses stop ids outside the vocabulary, and the engines have no
ignore-EOS switch), drawn with probability ~1/16384 a step from the random model, so nearly every
row runs the full 128 tokens (expected loss ~0.4% of the tokens, the same for every engine); the
"tokens" column shows what each engine generated per call.

Each (engine, model) pair lives in its own fresh subprocess; a model's three are built (vLLM's
~15 s build included, untimed), warmed up with an untimed 8-token call, then called in
alternation, ``--repeats`` timed calls each (median reported), so load from other jobs hits all
engines alike. "peak RSS" is that
child's peak resident set size from ``os.wait4`` (the kernel's ru_maxrss): the Python
interpreter, torch, the model's weights, the engine (for vLLM: its copy of the weights, the KV
cache of ``kv_gib`` below, its scheduler), the prompts and outputs. Everything runs on CPU in
float32 with the same torch thread count. The ratio is tokens/s over ``transformers.generate``'s
in the same run.

    python bench/rollout.py            # in .venv-vllm for the vllm row (bash .ci/install vllm)
    python bench/rollout.py --quick    # 1 timed repeat instead of 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ENGINES = ("transformers.generate", "hf", "vllm")
MODELS = ("tiny", "qwen2-30m")


def build(name: str):
    """``(model, prompt_ids (N, P), prompt_mask (N, P), eos_id, pad_id, max_new_tokens, label)``."""
    g = torch.Generator().manual_seed(0)
    if name == "tiny":
        from verl_core.models import build_tiny_model

        model, tok = build_tiny_model(seed=0)
        a = torch.randint(0, 51, (64, 2), generator=g).tolist()
        prompts = [f"{x}+{y}=" for x, y in a for _ in range(8)]  # B = 64 prompts, G = 8
        enc = tok(prompts, return_tensors="pt", padding=True)
        return (model, enc.input_ids, enc.attention_mask, tok.eos_token_id, tok.pad_token_id, 8,
                "tiny Llama")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=16384, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=16383, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(1, cfg.vocab_size - 1, (32, 32), generator=g)  # N = 32 rows, P = 32
    return model, ids, torch.ones_like(ids), cfg.eos_token_id, 0, 128, "Qwen2"


def kv_gib(model, rows: int, seq_len: int) -> float:
    """vLLM's CPU KV cache: room for every row at once, each rounded up to 256-token blocks
    (K and V, float32), so its scheduler never queues rows for lack of cache."""
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * \
        (c.hidden_size // c.num_attention_heads) * 4
    return rows * -(-seq_len // 256) * 256 * per_token / 2**30


def child(engine: str, name: str) -> None:
    """Build ``engine`` on model ``name``, say ready, then time one call per line of stdin
    (``seed new_tokens``) and answer each with ``RESULT {json}`` (vLLM logs on stdout too)."""
    from verl_core.rollout import SamplingParams, make_engine

    model, ids, mask, eos_id, pad_id, T, label = build(name)
    n_params = sum(p.numel() for p in model.parameters())
    folder = None  # vLLM's Hugging Face folder, removed at the end
    t0 = time.perf_counter()
    if engine == "transformers.generate":
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = pad_id

        @torch.no_grad()
        def run(seed, new_tokens):
            torch.manual_seed(seed)
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                                 pad_token_id=pad_id, eos_token_id=eos_id)
            resp = out[:, ids.shape[1]:]
            # tokens up to and including each row's first EOS (what the engines count)
            is_eos = (resp == eos_id).int()
            return int(((is_eos.cumsum(-1) - is_eos) == 0).sum())
    else:
        kwargs = dict(model=model, eos_token_id=eos_id, pad_token_id=pad_id)
        if engine == "hf":
            kwargs["micro_batch_size"] = ids.shape[0]
        else:
            folder = tempfile.mkdtemp(prefix="bench-rollout-")
            model.save_pretrained(folder, safe_serialization=True)
            kwargs.update(model_path=folder, dtype="float32", seed=0,
                          cpu_kv_cache_gib=kv_gib(model, ids.shape[0], ids.shape[1] + T),
                          max_model_len=ids.shape[1] + T)
        eng = make_engine(engine, **kwargs)

        def run(seed, new_tokens):
            out = eng.generate(ids, mask, SamplingParams(temperature=1.0, top_p=1.0, top_k=-1,
                                                         max_new_tokens=new_tokens, seed=seed))
            return int(out.response_mask.sum())
    n_prompt = ids.shape[1]
    say({"build_s": time.perf_counter() - t0, "label": label, "params": n_params,
         "rows": ids.shape[0], "prompt_len": n_prompt, "T": T})
    for line in sys.stdin:
        seed, new_tokens = map(int, line.split())
        t0 = time.perf_counter()
        n = run(seed, min(new_tokens, T))
        say({"tokens": n, "s": time.perf_counter() - t0})
    if folder:
        shutil.rmtree(folder)


def say(obj: dict) -> None:
    print("RESULT " + json.dumps(obj), flush=True)


class Child:
    """One (engine, model) measurement in its own interpreter; :meth:`call` times a call."""

    def __init__(self, engine: str, name: str, threads: int):
        self.err = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", engine, name,
             "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.info = None

    def read(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        self.proc.wait()
        self.err.seek(0)
        tail = self.err.read().strip().splitlines()[-1:] or [f"exit code {self.proc.returncode}"]
        raise ChildFailed(tail[0][:200])

    def call(self, seed: int, new_tokens: int) -> dict:
        self.proc.stdin.write(f"{seed} {new_tokens}\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> float:
        """Stop the child; its peak RSS in MiB (the kernel's ru_maxrss, KiB on Linux)."""
        self.proc.stdin.close()
        _, _, usage = os.wait4(self.proc.pid, 0)
        self.proc.returncode = 0
        return usage.ru_maxrss / 1024


class ChildFailed(RuntimeError):
    pass


def measure(name: str, engines: list[str], repeats: int, threads: int) -> dict:
    """Per engine: its info, tokens/s of ``repeats`` calls and peak RSS, or ``{"error"}``. The
    children are built one after another, then called in alternation (engine order rotated
    each round) so load from other jobs on the machine spreads over all of them."""
    kids, res = {}, {}
    for e in engines:
        try:
            kids[e] = Child(e, name, threads)
            kids[e].info = kids[e].read()
            kids[e].call(0, 8)  # warm-up: first-call allocations, vLLM's first scheduling
            res[e] = {**kids[e].info, "rates": [], "tokens": []}
        except ChildFailed as err:
            res[e] = {"error": str(err)}
            kids.pop(e)
    order = list(kids)
    for r in range(1, repeats + 1):
        k = r % len(order)
        for e in order[k:] + order[:k]:
            out = kids[e].call(r, 10**6)
            res[e]["rates"].append(out["tokens"] / out["s"])
            res[e]["tokens"].append(out["tokens"])
    for e, kid in kids.items():
        res[e]["peak_mib"] = kid.close()
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="timed calls per engine")
    p.add_argument("--quick", action="store_true", help="1 timed call per engine")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--child", nargs=2, metavar=("ENGINE", "MODEL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        child(*args.child)
        return
    repeats = 1 if args.quick else args.repeats
    has_vllm = importlib.util.find_spec("vllm") is not None
    print(f"torch {torch.__version__}, threads={args.threads or torch.get_num_threads()}, "
          f"vllm {'installed' if has_vllm else 'not installed'}, {repeats} timed repeat(s) "
          f"(median), load average before: {os.getloadavg()[0]:.2f}")
    print(f"| {'model, rows x (prompt + new)':<34} | {'engine':<21} | {'tokens':>7} "
          f"| {'tokens/s':>9} | {'vs generate':>11} | {'peak RSS MiB':>12} |")
    print(f"|{'-' * 36}|{'-' * 23}|{'-' * 9}|{'-' * 11}|{'-' * 13}|{'-' * 14}|")
    for name in args.models:
        base = None
        results = measure(name, [e for e in ENGINES if has_vllm or e != "vllm"], repeats,
                          args.threads)
        for engine in ENGINES:
            res = results.get(engine, {"error": "not installed"})
            if "error" in res:
                print(f"| {name:<34} | {engine:<21} | {res['error']}")
                continue
            med = statistics.median(res["rates"])
            base = med if engine == "transformers.generate" else base
            ratio = f"{med / base:.2f}" if base else "-"
            desc = (f"{res['label']} {res['params'] / 1e6:.1f}M, {res['rows']}x"
                    f"({res['prompt_len']}+{res['T']})")
            n = statistics.median(res["tokens"])
            print(f"| {desc:<34} | {engine:<21} | {n:>7.0f} | {med:>9.0f} | {ratio:>11} "
                  f"| {res['peak_mib']:>12.0f} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
