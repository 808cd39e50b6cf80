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

``--window``: instead, what the fast engine's decode window costs per rollout (`twiddle.twiddled_codes`: every code
tensor of the model permuted in place and back), on random codes at the model's projection shapes, with a launch per
tensor and with each direction one CUDA-graph replay (`twiddle.CAPTURE_PASSES`, the default), and in the lane order
(replays), against a copy of the same bytes (``clone``) in the same run.

``--wgmma``: instead, the Hopper wgmma kernel (64+ rows) on codes in the lane order (`twiddle.to_lane_order`, built
with `twiddle.LANE_ORDER_BUILD`: a 4-byte read and the twiddled 9-instruction decode per row and two k16 steps,
against ~2 x 11 instructions and a 16-byte read) against the shipped build on standard codes, every wgmma candidate
of each projection group in both builds. Columns: ``bf16``, ``shipped`` (what the engine runs today: the chooser's
kernel through the custom op, named), the best natural-order wgmma instance and the lane-order build of that instance
and of its own best, with ratios, and whether the two builds' outputs are equal bit for bit (they multiply the same
values in the same order). Weights stay warm in L2 between replays for the small groups, in every column alike.

Usage (a CUDA GPU):
    python scripts/bench_twiddle.py --model qwen2.5-7b --rows 1 8 --rank 32 --json twiddle.json
    python scripts/bench_twiddle.py --model qwen2.5-7b --window
    python scripts/bench_twiddle.py --model qwen2.5-7b --wgmma --rows 64 128 256 --json lane.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

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
    parser.add_argument("--window", action="store_true", help="time the decode window's permutation passes instead")
    parser.add_argument("--wgmma", action="store_true", help="time the wgmma kernel on lane-ordered codes instead")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = qwen25_config(args.model)
    if args.window:
        time_window(config, args.model)
        return
    if args.wgmma:
        time_wgmma_lane_order(config, args)
        return
    results = []
    print(f"Twiddled codes, {args.model} shapes, LoRA r{args.rank}, {torch.cuda.get_device_name()}")
    print("| group | M | instance | bf16 µs | standard µs | twiddled µs | best twiddled | best twiddled µs | "
          "twiddled / standard | standard / bf16 | twiddled / bf16 | rel. err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rows, k, weights, twiddled, dense in random_groups(config, twiddle.twiddle):
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
    write_json(args, results)


def time_wgmma_lane_order(config, args) -> None:
    """The ``--wgmma`` table (see the module)."""
    from trl_qerl.nvfp4 import cuda_wgmma

    results = []
    print(f"The wgmma kernel on lane-ordered codes, {args.model} shapes, {torch.cuda.get_device_name()}")
    print("| group | M | bf16 µs | shipped µs (kernel) | best natural wgmma | µs | lane order, same instance µs | "
          "best lane order | µs | lane / natural (same instance) | best lane / shipped | best lane / bf16 | "
          "equal bits |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rows, k, weights, lane, dense in random_groups(config, twiddle.to_lane_order):
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            if not cuda_wgmma.supports_wgmma(x, weights):
                print(f"| {name} | {m} | (the wgmma kernel does not take this shape: skipped) |")
                continue

            def run(codes, instance, options=()):
                return lambda: cuda_wgmma.wgmma_matmul(x, codes, instance, options=options)

            def lane_run(instance):
                return run(lane, instance, twiddle.LANE_ORDER_BUILD)

            candidates = cuda_wgmma.wgmma_candidate_configs(m, sum(rows), k)
            row = {"group": name, "m": m, "bf16_us": time_us(lambda: torch.nn.functional.linear(x, dense)),
                   "shipped_us": time_us(shipped_call(x, weights)), "shipped_kernel": str(kernels.chosen(x, weights)),
                   "natural_us": {str(c): time_us(run(weights, c)) for c in candidates},
                   "lane_us": {str(c): time_us(lane_run(c)) for c in candidates}}  # fmt: skip
            natural = min(candidates, key=lambda c: row["natural_us"][str(c)])
            best = min(candidates, key=lambda c: row["lane_us"][str(c)])
            row["best_natural"], row["best_lane"] = str(natural), str(best)
            row["equal_bits"] = all(torch.equal(run(weights, c)(), lane_run(c)()) for c in candidates)
            results.append(row)
            natural_us, same_us = row["natural_us"][str(natural)], row["lane_us"][str(natural)]
            best_us, shipped_us, bf16_us = row["lane_us"][str(best)], row["shipped_us"], row["bf16_us"]
            print(f"| {name} | {m} | {bf16_us:.1f} | {shipped_us:.1f} ({row['shipped_kernel']}) | {natural} | "
                  f"{natural_us:.1f} | {same_us:.1f} | {best} | {best_us:.1f} | {same_us / natural_us:.2f} | "
                  f"{best_us / shipped_us:.2f} | {best_us / bf16_us:.2f} | {'yes' if row['equal_bits'] else 'NO'} |",
                  flush=True)  # fmt: skip
    write_json(args, results)


def random_groups(config, reorder: Callable[[torch.Tensor], torch.Tensor]):
    """Per projection group of a layer of ``config``: (name, rows of each weight, K, random NVFP4 weights on the GPU,
    the same weights with their codes passed through ``reorder``, a bf16 weight of the group's fused shape)."""
    for name, (rows, k) in layer_groups(config).items():
        weights = [tuple(t.cuda() for t in quantize(torch.randn(n, k) * 0.02)) for n in rows]
        reordered = [(reorder(packed), scale, gs) for packed, scale, gs in weights]
        dense = torch.randn(sum(rows), k, device="cuda", dtype=torch.bfloat16) * 0.02
        yield name, rows, k, weights, reordered, dense


def write_json(args, results: list[dict]) -> None:
    """The rows to ``args.json`` (if given), with the arguments and the device."""
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "device": torch.cuda.get_device_name(), "rows": results}, handle, indent=1)


def shipped_call(x: torch.Tensor, weights: list) -> Callable[[], torch.Tensor]:
    """The product as the engine calls it today: the custom op, whose kernel the chooser picks."""
    if len(weights) == 1:
        return lambda: torch.ops.trl_qerl.nvfp4_linear(x, *weights[0])
    packed, scales, global_scales = (list(t) for t in zip(*weights))
    return lambda: torch.ops.trl_qerl.nvfp4_linear_grouped(x, packed, scales, global_scales, [None] * len(weights))


def median_ms(run, repeats: int = 5) -> float:
    """Median milliseconds of ``run()`` between CUDA events on the current stream (host launch gaps included)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def window_ms(codes: list[torch.Tensor], repeats: int = 5, lanes: bool = False) -> float:
    """Median milliseconds of opening and closing the decode window once over ``codes`` (every tensor permuted in
    place and back: what the twiddled order, or with ``lanes`` the lane order, costs each rollout)."""

    def window() -> None:
        with twiddle.twiddled_codes(codes, lanes=lanes):
            pass

    return median_ms(window, repeats)


def time_window(config, model: str, repeats: int = 5) -> None:
    """`window_ms` over random codes of every projection of ``config``, with a launch per tensor and with
    `twiddle.CAPTURE_PASSES`, and the median ms of cloning them (one read and one write of the same bytes)."""
    codes = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
             for _ in range(config.num_hidden_layers) for rows, k in layer_groups(config).values() for n in rows]  # fmt: skip
    size_gb = sum(packed.numel() for packed in codes) / 1e9
    before = [packed[:4].clone() for packed in codes[:3]]
    shipped = twiddle.CAPTURE_PASSES
    try:
        twiddle.CAPTURE_PASSES = False
        window_ms(codes, repeats=1)  # (compiles the pass)
        launches_ms = window_ms(codes, repeats)
        twiddle.CAPTURE_PASSES = True
        window_ms(codes, repeats=1)  # (captures both directions)
        captured_ms = window_ms(codes, repeats)
        window_ms(codes, repeats=1, lanes=True)  # (compiles and captures the lane order's passes)
        lanes_ms = window_ms(codes, repeats, lanes=True)
    finally:
        twiddle.CAPTURE_PASSES = shipped
    clone_ms = median_ms(lambda: [packed.clone() for packed in codes], repeats)
    assert all(torch.equal(packed[:4], b) for packed, b in zip(codes, before)), "the window did not restore the codes"
    print(
        f"Decode window, {model} shapes: {len(codes)} code tensors, {size_gb:.2f} GB, {torch.cuda.get_device_name()}"
    )
    print("| what | ms | ratio |\n|---|---|---|")
    print(f"| window (permute in and out), a launch per tensor | {launches_ms:.2f} | {launches_ms / clone_ms:.2f} |")
    print(
        f"| window, each direction one graph replay (CAPTURE_PASSES) | {captured_ms:.2f} | {captured_ms / clone_ms:.2f} |"
    )
    print(f"| window in the lane order, one graph replay each way | {lanes_ms:.2f} | {lanes_ms / clone_ms:.2f} |")
    print(f"| clone every tensor once (baseline) | {clone_ms:.2f} | 1.00 |")


if __name__ == "__main__":
    main()
