"""The decode step's LoRA shrinks at Qwen2.5 shapes: each fused kernel layout against inductor's kernels for the
same formulas, per call, all in one run (CUDA-graph replays, median).

Per layer the fused step makes three inputs with their shrinks ``t = h @ A.T`` (`rollout.fused_shrink`): the input
norm with the q/k/v adapters (``qkv``), the post-attention norm with the gate and up adapters (``gate_up``), both
after a residual add, and SiLU·up with the down adapter (``down``). Columns (µs per call):

* ``inductor``: `torch.compile` of the torch formulas alone (`fused_shrink`'s references: add, norm, then the shrink
  as a matmul), several launches; in the fused step inductor fuses them with the layer's other ops instead, so this
  column is a standalone reference, not the step's cost without the fused ops (`bench_rollout.py`'s
  ``+shrink_unfused`` engine measures that);
* ``fused``: `_fused_shrink_kernel` (one program per row and rank block), with ``--variants``: settings of that
  module (``NAME=VALUE,...``) timed as more columns in the same run, for drafts of new layouts.

Each arm's ``t`` is checked against float64 (an error above 1e-5 is printed); the ratio is fused / inductor.

The eighth session's tensor-core tile draft (every row of a launch as one ``[16, 64]`` tile per step, 3xTF32
``tl.dot``; commit 4bef487) was timed with this script and dropped: 12-20 µs per call against 3-8 µs for the
per-row kernels (BENCHMARKS.md).

Usage (a CUDA GPU):
    python scripts/bench_fused_shrink.py --model qwen2.5-7b --rows 1 2 4 8 16 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_settings import arm_cells, module_settings
from bench_settings import parse_settings as parse_module_settings
from graph_timing import time_us
from model_shapes import NAMES, qwen25_config

from trl_qerl.rollout import _fused_shrink_kernel as kernel
from trl_qerl.rollout.fused_shrink import rms_norm_reference, shrink_reference


def parse_settings(variant: str) -> dict[str, int]:
    """``"NAME=VALUE,NAME=VALUE"`` -> integer settings of `_fused_shrink_kernel` (names it lacks are refused)."""
    return parse_module_settings(variant, kernel)


def cases(config, rows: int, rank: int, device) -> dict:
    """name -> (launch(t), reference(), t columns): the three shrinks of one layer with random inputs."""
    hidden, inter = config.hidden_size, config.intermediate_size
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device=device) + 0.5
    gate, up = torch.randn(rows, 2 * inter, device=device, dtype=torch.bfloat16).split(inter, dim=1)

    def adapters(count, width):
        return [torch.randn(rank, width, device=device) / width**0.5 for _ in range(count)]

    out = {}
    for name, lora_a in (("qkv", adapters(3, hidden)), ("gate_up", adapters(2, hidden))):
        s, h = torch.empty_like(x), torch.empty_like(x)

        def fused(t, lora_a=lora_a, s=s, h=h):
            kernel.norm_shrink(x, residual, weight, 1e-6, lora_a, s, h, t)

        def reference(lora_a=lora_a):
            summed = x + residual
            normed = rms_norm_reference(summed, weight, 1e-6)
            return summed, normed, shrink_reference(normed, lora_a)

        out[name] = (fused, reference, len(lora_a) * rank)
    down_a, y = adapters(1, inter), torch.empty_like(gate)

    def fused_down(t):
        kernel.silu_mul_shrink(gate, up, down_a, y, t)

    def reference_down():
        activated = torch.nn.functional.silu(gate) * up
        return activated, shrink_reference(activated, down_a)

    out["down"] = (fused_down, reference_down, rank)
    return out


def relative_error(t: torch.Tensor, exact: torch.Tensor) -> float:
    return ((t.double() - exact).norm() / exact.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b", choices=NAMES)
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--variants", nargs="*", default=[], metavar="SETTINGS",
                        help="module settings of _fused_shrink_kernel per extra column, e.g. MAX_BLOCK_K=2048")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 64
    config = qwen25_config(args.model)
    device = torch.device("cuda")
    arms = [("fused", {})] + [(variant, parse_settings(variant)) for variant in args.variants]
    results = []
    print(f"LoRA shrinks of one {args.model} layer, rank {args.rank}, µs per call; {torch.cuda.get_device_name()}")
    print("| shrink | rows | inductor | " + " | ".join(name for name, _ in arms) + " | fused / inductor |")
    print("|---|---|---|" + "---|" * len(arms) + "---|")
    for rows in args.rows:
        for name, (fused, reference, columns) in cases(config, rows, args.rank, device).items():
            exact = reference()[-1].double()
            compiled = torch.compile(reference, dynamic=False)
            row = {"shrink": name, "rows": rows, "inductor_us": time_us(compiled), "arms": {}}
            for arm, values in arms:
                with module_settings(kernel, values):
                    t = torch.full((rows, columns), float("nan"), device=device)
                    fused(t)
                    error = relative_error(t, exact)
                    row["arms"][arm] = {"us": time_us(lambda t=t: fused(t)), "rel_err": error}
            results.append(row)
            ratio = row["arms"]["fused"]["us"] / row["inductor_us"]
            cells = arm_cells(row["arms"], 1e-5)
            print(f"| {name} | {rows} | {row['inductor_us']:.1f} | {cells} | {ratio:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rank": args.rank, "device": torch.cuda.get_device_name(),
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
