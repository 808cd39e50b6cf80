"""The CUDA decode kernel on twiddled codes (`trl_qerl.nvfp4.twiddle`, built with ``-DNVFP4_TWIDDLED=1``) against
the shipped build on the standard codes, per projection group of a Qwen2.5 layer at decode sizes, in one run
(CUDA-graph replays, median µs per call).

Columns: ``bf16``: ``F.linear`` with a bf16 weight of the group's fused shape (the issue's baseline); ``standard``:
the chooser's instance as the fused step launches it (with the LoRA epilogue when ``--rank``
> 0); ``twiddled``: the same instance on twiddled codes; ``best twiddled``: the fastest decode-kernel instance on
twiddled codes (every instance the chooser could pick); ratios: best twiddled / standard, standard / bf16 and best
twiddled / bf16. ``rel. err``: twiddled
output against the standard one (float64 norm), which differs only in the order of fp32 sums. The question this
answers: does a load-time bit order that cuts the main loop from ~3.4 to ~2.4 instructions per weight (sm_90 SASS)
make the products faster?

Usage (a CUDA GPU):
    python scripts/bench_twiddle.py --model qwen2.5-7b --rows 1 8 --rank 32 --json twiddle.json
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_lora_epilogue import layer_groups
from graph_timing import time_us
from model_shapes import NAMES, qwen25_config

from trl_qerl.nvfp4 import cuda_mma, kernels, twiddle
from trl_qerl.nvfp4.format import quantize, relative_error


TWIDDLED = ("-DNVFP4_TWIDDLED=1",)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank of the epilogue (0: no LoRA terms)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = qwen25_config(args.model)
    results = []
    print(f"Twiddled codes, {args.model} shapes, LoRA r{args.rank}, {torch.cuda.get_device_name()}")
    print("| group | M | instance | bf16 µs | standard µs | twiddled µs | best twiddled | best twiddled µs | "
          "twiddled / standard | standard / bf16 | twiddled / bf16 | rel. err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, (rows, k) in layer_groups(config).items():
        weights = [tuple(t.cuda() for t in quantize(torch.randn(n, k) * 0.02)) for n in rows]
        twiddled = [(twiddle.twiddle(packed), scale, gs) for packed, scale, gs in weights]
        dense = torch.randn(sum(rows), k, device="cuda", dtype=torch.bfloat16) * 0.02
        lora_b = [torch.randn(n, args.rank, device="cuda") * 0.01 for n in rows] if args.rank else None
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            lora = None
            if args.rank:
                hidden = torch.randn(m, args.rank * len(rows), device="cuda")
                lora = cuda_mma.LoraInputs(hidden, lora_b, [2.0] * len(rows))
                choice = kernels.CHOOSER.choose_with_lora(x, weights, args.rank)
            else:
                choice = kernels.chosen(x, weights)
            if not isinstance(choice, cuda_mma.MMAConfig):
                print(f"| {name} | {m} | {choice} (not the decode kernel: skipped) |")
                continue

            def run(codes, instance, options=()):
                return lambda: cuda_mma.matmul(x, codes, instance, lora=lora, options=options)

            row = {"group": name, "m": m, "instance": str(choice),
                   "bf16_us": time_us(lambda: torch.nn.functional.linear(x, dense)),
                   "standard_us": time_us(run(weights, choice)),
                   "twiddled_us": time_us(run(twiddled, choice, TWIDDLED))}  # fmt: skip
            candidates = [c for c in cuda_mma.candidate_configs(m, sum(rows), k) if not lora or cuda_mma.lora_fits(c)]
            row["sweep_us"] = {str(c): time_us(run(twiddled, c, TWIDDLED)) for c in candidates}
            best = min(row["sweep_us"], key=row["sweep_us"].get)
            row["best_twiddled"], row["best_twiddled_us"] = best, row["sweep_us"][best]
            standard = run(weights, choice)().double()
            row["relative_error"] = relative_error(standard, run(twiddled, choice, TWIDDLED)())
            results.append(row)
            standard_us, best_us, bf16_us = row["standard_us"], row["best_twiddled_us"], row["bf16_us"]
            print(f"| {name} | {m} | {choice} | {bf16_us:.1f} | {standard_us:.1f} | {row['twiddled_us']:.1f} | {best} | "
                  f"{best_us:.1f} | {best_us / standard_us:.2f} | {standard_us / bf16_us:.2f} | {best_us / bf16_us:.2f} | "
                  f"{row['relative_error']:.1e} |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": results}, handle, indent=1)


if __name__ == "__main__":
    main()
