"""Where the Hopper wgmma NVFP4 kernel's time goes: each instance timed as built and without its decode
(``-DNVFP4_WGMMA_PROFILE=1`` multiplies the undecoded codes: wrong products, same loads and MMAs), against bf16
`F.linear` on the same shape, all in one run (CUDA-graph replays, median).

Usage (an H100/H200):
    python scripts/profile_wgmma.py --json profile.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from trl_qerl.nvfp4 import cuda_wgmma
from trl_qerl.nvfp4.cuda_wgmma import WgmmaConfig
from trl_qerl.nvfp4.format import quantize


# (rows M, weights of one launch as (N, K), instances): 7B gate/up at 64 and 256 rows, down at 512 rows
CASES = [
    (256, [(18944, 3584)] * 2, [WgmmaConfig(2, 2, 128, 4), WgmmaConfig(2, 1, 256, 3), WgmmaConfig(2, 2, 64, 3)]),
    (64, [(18944, 3584)] * 2, [WgmmaConfig(2, 2, 64, 3), WgmmaConfig(2, 1, 64, 4)]),
    (512, [(3584, 18944)], [WgmmaConfig(2, 2, 128, 4, 4), WgmmaConfig(2, 1, 256, 3, 4)]),
]
BUILDS = {"as built": (), "no decode": ("-DNVFP4_WGMMA_PROFILE=1",)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="write the microseconds here")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    results = {}
    print("| M | weights (N x K) | instance | " + " | ".join(f"{b} µs (/bf16)" for b in BUILDS) + " | bf16 µs |")
    print("|---|---|---|" + "---|" * len(BUILDS) + "---|")
    for m, shapes, configs in CASES:
        weights = [quantize((torch.randn(n, k, generator=generator) * 0.05).cuda()) for n, k in shapes]
        x = torch.randn(m, shapes[0][1], device="cuda", dtype=torch.bfloat16)
        dense = torch.randn(sum(n for n, _ in shapes), shapes[0][1], device="cuda", dtype=torch.bfloat16)
        bf16 = triton.testing.do_bench_cudagraph(lambda: torch.nn.functional.linear(x, dense), rep=20) * 1000
        for config in configs:
            times = {}
            for build, options in BUILDS.items():
                call = lambda c=config, o=options: cuda_wgmma.wgmma_matmul(x, weights, c, options=o)  # noqa: E731
                call()
                times[build] = triton.testing.do_bench_cudagraph(call, rep=20) * 1000
            results[f"{m}|{shapes}|{config}"] = {**times, "bf16": bf16}
            cells = " | ".join(f"{t:.1f} ({t / bf16:.2f})" for t in times.values())
            print(f"| {m} | {len(shapes)} x {shapes[0]} | {config} | {cells} | {bf16:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)


if __name__ == "__main__":
    main()
