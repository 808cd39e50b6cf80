"""NVFP4 kernel benchmark: fused W4A16 (and dequantise+cuBLAS) against bf16 `F.linear`, same run, same GPU.

For each Qwen2.5 shape (fused q/k/v, o, fused gate/up, down) and row count M, times the NVFP4 forward
(``torch.ops.trl_qerl.nvfp4_linear``: the kernel the chooser picks) and bf16 ``F.linear``; for M >= 1024 also the
backward ``grad_out @ W`` (``nvfp4_grad_input`` vs bf16 matmul). Timing: CUDA events around a CUDA graph of
many calls (so launch gaps are those of graph replay), weights rotated over enough copies to exceed twice the
L2 cache, median of repeated replays. Bandwidth counts the bytes that must move (weights once, activations
in and out) and is compared with a measured device-to-device copy.

Usage:
    python scripts/bench_kernels.py --models qwen2.5-7b qwen2.5-32b --json out.json --choices choices.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from model_shapes import linear_shapes

from trl_qerl.nvfp4 import kernels
from trl_qerl.nvfp4.format import quantize


SHAPES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ROWS = (1, 4, 16, 64, 256, 1024, 4096, 8192)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() / statistics.median(times[2:])


def graph_time(calls, copies: int, repeats: int = 15) -> float:
    """Median seconds per call of ``calls[i % copies]()`` captured back to back in one CUDA graph."""
    per_graph = max(copies, 8)
    for i in range(copies):
        calls[i]()  # warm-up outside capture: compiles and tunes
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_graph):
            calls[i % copies]()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / per_graph)
    del graph
    return statistics.median(times[1:])


def bench_shape(n: int, k: int, rows: int, l2_bytes: int):
    bf16_weight_bytes = n * k * 2
    copies = max(1, -(-3 * l2_bytes // bf16_weight_bytes))
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    packed = [quantize(w) for w in dense]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    nvfp4_weight_bytes = sum(t.numel() * t.element_size() for t in packed[0])
    io_bytes = (rows * k + rows * n) * 2

    result = {"N": n, "K": k, "M": rows}
    ours = [lambda q=q: torch.ops.trl_qerl.nvfp4_linear(x, *q) for q in packed]
    theirs = [lambda w=w: torch.nn.functional.linear(x, w) for w in dense]
    result["nvfp4_s"] = graph_time(ours, copies)
    result["bf16_s"] = graph_time(theirs, copies)
    result["kernel"] = str(kernels.CHOOSER.choices.get(kernels.KernelChooser.key(x, n, k), "heuristic"))
    result["nvfp4_bandwidth"] = (nvfp4_weight_bytes + io_bytes) / result["nvfp4_s"]
    result["bf16_bandwidth"] = (bf16_weight_bytes + io_bytes) / result["bf16_s"]
    if rows >= 1024:
        ours_bw = [lambda q=q: torch.ops.trl_qerl.nvfp4_grad_input(grad, *q) for q in packed]
        theirs_bw = [lambda w=w: grad @ w for w in dense]
        result["nvfp4_backward_s"] = graph_time(ours_bw, copies)
        result["bf16_backward_s"] = graph_time(theirs_bw, copies)
    del dense, packed
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen2.5-7b", "qwen2.5-32b"])
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--json", default=None, help="write all results here")
    parser.add_argument("--choices", default=None, help="save the tuned kernel choices here")
    args = parser.parse_args()

    props = torch.cuda.get_device_properties(0)
    bandwidth = copy_bandwidth()
    print(f"device: {props.name}, {props.multi_processor_count} SMs, L2 {props.L2_cache_size / 2**20:.0f} MiB, "
          f"measured copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")  # fmt: skip
    results = []
    for model in args.models:
        shapes = linear_shapes(model)
        print(f"\n### {model}\n")
        print(
            "| shape (N x K) | M | kernel | NVFP4 µs | bf16 µs | NVFP4/bf16 | NVFP4 TB/s (% copy) | bwd NVFP4/bf16 |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for name in SHAPES:
            n, k = shapes[name]
            for rows in args.rows:
                r = bench_shape(n, k, rows, props.L2_cache_size) | {"model": model, "shape": name}
                results.append(r)
                backward = f"{r['nvfp4_backward_s'] / r['bf16_backward_s']:.2f}" if "nvfp4_backward_s" in r else "-"
                print(
                    f"| {name} ({n}x{k}) | {rows} | {r['kernel']} | {r['nvfp4_s'] * 1e6:.1f} | {r['bf16_s'] * 1e6:.1f} "
                    f"| {r['nvfp4_s'] / r['bf16_s']:.2f} | {r['nvfp4_bandwidth'] / 1e12:.2f} "
                    f"({100 * r['nvfp4_bandwidth'] / bandwidth:.0f}%) | {backward} |",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": props.name, "copy_bandwidth": bandwidth, "results": results}, handle, indent=1)
    if args.choices:
        kernels.CHOOSER.save(args.choices)


if __name__ == "__main__":
    main()
