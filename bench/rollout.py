"""Rollout throughput: the ``hf`` engine against ``transformers``' ``generate``.

Same model, same prompts, same sampling settings (temperature 1, top-p 1, top-k off, stop on EOS,
max new tokens), measured in the same process, alternating the two so drift hits both. Prints a
table of generated tokens per second and the ratio engine / generate.

    python bench/rollout.py                      # default tiny model (the CPU default)
    python bench/rollout.py --hidden 256 --layers 4 --batch 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verl_core.models import build_tiny_model
from verl_core.rollout import SamplingParams, make_engine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=256, help="sequences per call (B * G)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = build_tiny_model(hidden_size=args.hidden, layers=args.layers, seed=0)
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 51, (args.batch, 2), generator=g).tolist()
    prompts = [f"{x}+{y}=" for x, y in a]
    enc = tok(prompts, return_tensors="pt", padding=True)
    eng = make_engine("hf", model=model, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, micro_batch_size=args.batch)
    T = args.max_new_tokens

    def run_engine(seed):
        out = eng.generate(enc.input_ids, enc.attention_mask,
                           SamplingParams(temperature=1.0, max_new_tokens=T, seed=seed))
        return float(out.response_mask.sum())

    @torch.no_grad()
    def run_generate(seed):
        torch.manual_seed(seed)
        out = model.generate(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                             do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=T, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)
        resp = out[:, enc.input_ids.shape[1]:]
        # count tokens up to and including the first EOS (what the engine counts)
        is_eos = (resp == tok.eos_token_id).int()
        after_eos = (is_eos.cumsum(-1) - is_eos) > 0
        return float((~after_eos).sum())

    run_engine(0), run_generate(0)  # warm up both
    rates = {"hf engine": [], "transformers generate": []}
    for r in range(args.repeats):
        for name, fn in (("hf engine", run_engine), ("transformers generate", run_generate)):
            t0 = time.perf_counter()
            tokens = fn(r + 1)
            rates[name].append(tokens / (time.perf_counter() - t0))
    base = statistics.median(rates["transformers generate"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: Llama hidden={args.hidden} layers={args.layers} ({n_params / 1e6:.2f}M params), "
          f"batch={args.batch}, max_new_tokens={T}, threads={torch.get_num_threads()}, "
          f"repeats={args.repeats} (median)")
    print(f"| {'engine':<22} | {'tokens/s':>10} | {'ratio vs generate':>17} |")
    print(f"|{'-' * 24}|{'-' * 12}|{'-' * 19}|")
    for name, xs in rates.items():
        med = statistics.median(xs)
        print(f"| {name:<22} | {med:>10.0f} | {med / base:>17.2f} |")


if __name__ == "__main__":
    main()
