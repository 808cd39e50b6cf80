"""Does the NVFP4 decode kernel lose time to its last, partial wave of CTAs? One instance at one K, timed at row
counts that fill a given number of waves (launch CTAs / CTAs the GPU holds at once), all in one run (CUDA-graph
replays, median).

Why: a decode launch is latency-bound per warp (Nsight Compute, 7B gate/up at 8 rows: 49 % of DRAM bandwidth, 1.1
eligible warps per scheduler), so a last wave that fills a quarter of the slots runs at about a quarter of the
throughput. 7B gate/up (1,184 CTAs of 32 rows over 528 slots) is 2.24 waves. If that tail costs, bandwidth rises
toward each whole wave and drops just past it (a saw-tooth over the ``waves`` column); if the kernel is limited
elsewhere, it rises smoothly with size. A persistent or stream-K grid is worth building only in the first case.

Columns: waves, weight rows, MB of NVFP4 bytes (codes and block scales), µs per call, TB/s; with ``--stream-k``,
the instance's stream-K launch (`MMAConfig.stream_k`: the units spread evenly over the slots, one launch), µs and
TB/s; then, per ``--tail-splits`` S, a remedy that needs no new kernel: the whole waves as one launch, and the rows of the last
partial wave as a second launch with K split over S CTAs per tile (the ``SPLIT_K`` build), so that the tail fills
about S times as many slots. The slots come from the CUDA occupancy calculator for the instance's build
(`nvrtc.CudaKernel.resident_blocks`). The first size's output is checked against the float32 product of the
dequantised weight (standard build), and so is each tail-split form's. With ``--async-stages`` S, the same launch
built with the decode kernel's cp.async ring of S blocks (`cuda_mma.ASYNC_STAGES_FLAG`: more weight loads in flight
without registers), µs and TB/s, checked the same way; its own CTAs per multiprocessor are printed in the header.

Usage (a CUDA GPU):
    python scripts/bench_waves.py --k 3584 --instance 2,1,4 --lora-rank 32 --twiddled --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

import torch
from graph_timing import time_us

from trl_qerl.nvfp4 import cuda_mma, twiddle
from trl_qerl.nvfp4.format import dequantize, quantize


WAVES = (0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0, 3.5, 4.0, 4.5, 5.0)


def rows_for_waves(waves: float, slots: int, rows_per_cta: int) -> int:
    """Weight rows of a launch (one CTA column of tokens) that makes ``waves`` times ``slots`` CTAs, at least one."""
    if waves <= 0 or slots <= 0 or rows_per_cta <= 0:
        raise ValueError(f"waves, slots and rows per CTA must be positive (got {waves}, {slots}, {rows_per_cta})")
    return max(1, round(waves * slots)) * rows_per_cta


def parse_instance(text: str) -> cuda_mma.MMAConfig:
    """``"M_TILES,N_TILES,K_WARPS"`` -> the decode kernel's instance (its own checks refuse what it cannot build)."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise SystemExit(f"--instance: {text!r} is not M_TILES,N_TILES,K_WARPS (e.g. 2,1,4)")
    try:
        return cuda_mma.MMAConfig(*(int(p) for p in parts))
    except ValueError as error:
        raise SystemExit(f"--instance: {error}") from None


def tail_start(rows: int, slots: int, rows_per_cta: int) -> int:
    """First weight row of the last partial wave of a launch over ``rows`` (``rows`` when the waves are whole, 0 when
    there is less than one)."""
    tiles = -(-rows // rows_per_cta)
    return min(rows, tiles // slots * slots * rows_per_cta)


def nvfp4_megabytes(rows: int, k: int) -> float:
    """Codes (half a byte per weight) and FP8 block scales (one byte per 16 weights)."""
    return rows * (k // 2 + k // 16) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, default=3584, help="columns of the weight (the layer's input width)")
    parser.add_argument("--instance", type=parse_instance, default=parse_instance("2,1,4"),
                        help="M_TILES,N_TILES,K_WARPS of the decode kernel (mma 32r x 8t kw4 is 2,1,4)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=8, help="activation rows (the decode batch)")
    parser.add_argument("--lora-rank", type=int, default=0, help="add LoRA terms of this rank in the epilogue")
    parser.add_argument("--twiddled", action="store_true", help="time the twiddled build (what the engine runs)")
    parser.add_argument("--waves", type=float, nargs="+", default=list(WAVES))
    parser.add_argument("--tail-splits", type=int, nargs="*", default=[2, 4], choices=cuda_mma.K_SPLITS[1:],
                        help="also time the last partial wave as its own launch with K split over this many CTAs")  # fmt: skip
    parser.add_argument("--stream-k", action="store_true",
                        help="also time the instance's stream-K launch (MMAConfig.stream_k: one launch, no last wave)")  # fmt: skip
    parser.add_argument("--async-stages", type=int, nargs="*", default=[],
                        help="also time the build with the cp.async ring of this many blocks (2 or more)")  # fmt: skip
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if any(stages < 2 for stages in args.async_stages):
        raise SystemExit("--async-stages: the ring needs at least 2 blocks")
    config, device, dtype = args.instance, torch.device("cuda"), torch.bfloat16
    if args.lora_rank and not cuda_mma.lora_fits(config):
        raise SystemExit(f"--lora-rank: {config} has no room for the LoRA epilogue")
    torch.manual_seed(0)
    options = twiddle.TWIDDLED_BUILD if args.twiddled else ()
    name = config.name_expression(dtype, lora_rank=args.lora_rank)
    build = cuda_mma.kernel(name, dtype, device, options)
    slots = cuda_mma.resident_ctas(build, config, device)
    per_sm = slots // torch.cuda.get_device_properties(device).multi_processor_count
    x = torch.randn(args.tokens, args.k, device=device, dtype=dtype)
    print(f"{config}{' + LoRA r' + str(args.lora_rank) if args.lora_rank else ''}, "
          f"{'twiddled' if args.twiddled else 'standard'} build, K = {args.k}, {args.tokens} tokens; "
          f"{per_sm} CTAs per multiprocessor, {slots} slots; {torch.cuda.get_device_name()}")  # fmt: skip
    for stages in args.async_stages:
        ring_build = cuda_mma.kernel(name, dtype, device, options + (f"{cuda_mma.ASYNC_STAGES_FLAG}{stages}",))
        ring_bytes = cuda_mma.decode_ring_bytes(config, stages)
        ring_slots = cuda_mma.resident_ctas(ring_build, config, device, ring_bytes)
        print(f"ring of {stages} blocks: {ring_bytes} bytes of shared memory per CTA, {ring_slots} slots")
    tails = "".join(f" tail split {splits} µs |" for splits in args.tail_splits)
    stream = " stream-K µs | stream-K TB/s |" if args.stream_k else ""
    rings = "".join(f" ring {stages} µs | ring {stages} TB/s |" for stages in args.async_stages)
    print(f"| waves | rows | MB | µs | TB/s |{tails}{stream}{rings}")
    print("|---|---|---|---|---|" + "---|" * (len(args.tail_splits) + 2 * args.stream_k + 2 * len(args.async_stages)))
    results = []
    for i, waves in enumerate(args.waves):
        rows = rows_for_waves(waves, slots, config.rows)
        weight = tuple(quantize(torch.randn(rows, args.k, device=device) * 0.02))
        lora = None
        if args.lora_rank:
            hidden = torch.randn(args.tokens, args.lora_rank, device=device)
            lora = cuda_mma.LoraInputs(hidden, [torch.randn(rows, args.lora_rank, device=device) * 0.01], [2.0])
        whole = functools.partial(cuda_mma.matmul, x, [weight], config, lora=lora)
        if i == 0:
            _check(x, weight, lora, whole)
        us = time_us(functools.partial(whole, options=options))
        megabytes = nvfp4_megabytes(rows, args.k)
        row = {
            "waves": waves,
            "rows": rows,
            "mb": megabytes,
            "us": us,
            "tb_per_s": megabytes / us,
            "tail_split_us": {},
        }
        start = tail_start(rows, slots, config.rows)
        for splits in args.tail_splits if start < rows else ():
            split_form = functools.partial(_head_and_split_tail, x, weight, lora, config, splits, start)
            _check(x, weight, lora, split_form)
            row["tail_split_us"][splits] = time_us(functools.partial(split_form, options=options))
        stream_cells = ""
        if args.stream_k:
            streamed = functools.partial(cuda_mma.matmul, x, [weight], dataclasses.replace(config, stream_k=True),
                                         lora=lora)  # fmt: skip
            _check(x, weight, lora, streamed)
            row["stream_k_us"] = time_us(functools.partial(streamed, options=options))
            stream_cells = f" {row['stream_k_us']:.1f} | {megabytes / row['stream_k_us']:.2f} |"
        ring_cells = ""
        row["ring_us"] = {}
        for stages in args.async_stages:
            flag = f"{cuda_mma.ASYNC_STAGES_FLAG}{stages}"
            _check(x, weight, lora, functools.partial(whole, options=(flag,)))
            row["ring_us"][stages] = time_us(functools.partial(whole, options=options + (flag,)))
            ring_cells += f" {row['ring_us'][stages]:.1f} | {megabytes / row['ring_us'][stages]:.2f} |"
        results.append(row)
        tail_cells = "".join(f" {row['tail_split_us'][s]:.1f} |" if s in row["tail_split_us"] else " — |"
                             for s in args.tail_splits)  # fmt: skip
        print(f"| {waves:g} | {rows} | {megabytes:.1f} | {us:.1f} | {megabytes / us:.2f} |{tail_cells}{stream_cells}"
              f"{ring_cells}", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": {**vars(args), "instance": str(config)}, "slots": slots, "per_sm": per_sm,
                       "device": torch.cuda.get_device_name(), "results": results}, handle, indent=1)  # fmt: skip


def _head_and_split_tail(x, weight, lora, config, splits, start, options=()) -> torch.Tensor:
    """The launch's rows before ``start`` with ``config``, the rest with K split over ``splits`` CTAs per tile, into
    one output (row slices of the weight, its scales and B are views: rows are contiguous)."""
    packed, scale, global_scale = weight
    out = torch.empty(x.shape[0], packed.shape[0], device=x.device, dtype=x.dtype)
    tail_config = dataclasses.replace(config, k_splits=splits)
    for rows, part_config in ((slice(0, start), config), (slice(start, None), tail_config)):
        if rows.start == rows.stop:
            continue
        part_lora = None if lora is None else dataclasses.replace(lora, lora_b=[lora.lora_b[0][rows]])
        cuda_mma.matmul(x, [(packed[rows], scale[rows], global_scale)], part_config, out=out[:, rows],
                        options=options, lora=part_lora)  # fmt: skip
    return out


def _check(x, weight, lora, launch) -> None:
    """``launch()`` (the standard build) against the float32 product of the dequantised weight (and the LoRA
    terms, if any)."""
    reference = x.float() @ dequantize(*weight, dtype=torch.float32).T
    if lora is not None:
        reference = reference.to(x.dtype).float() + lora.scaling[0] * lora.hidden @ lora.lora_b[0].T
    out = launch().float()
    error = ((out - reference).norm() / reference.norm()).item()
    if error > 1e-2:
        raise SystemExit(f"relative error {error:.1e} against float32: the timings would mean nothing")


if __name__ == "__main__":
    main()
