"""The fused decode step's attention (`decode_attention.split_kv_attention`: partials, then merge) at Qwen2.5 shapes,
per call at several cache positions, with settings of `decode_attention` as extra columns, all in one run (CUDA-graph
replays, median).

Why: the launch is captured once per rollout for the whole static cache (``prompt + max_new_tokens``, rounded up to
256), so its chunks are sized for the full cache (`decode_attention.chunk_size`: the programs fill the GPU twice at
the last position). At 14B, batch 8, 1,280 positions that is 4 chunks of 320 positions: until position 320 only 64
programs hold positions, and each runs 10 steps of `BLOCK` positions one after another. The 14B step profile
(thirteenth session, 128 new tokens) had the partials kernel at 7.9 µs per layer, where its keys and values need ~2
µs at 4.8 TB/s. Shorter chunks (`MAX_CHUNK`), longer steps (`BLOCK`) or more warps (`PARTIALS_WARPS`) are the knobs.

Columns: the position (the token being decoded attends to positions 0..position), the MB of keys and values read,
then per arm µs per call (and, in the last column, the floor at ``--bandwidth`` TB/s). Each arm's output is checked
against float64 SDPA over the same positions before it is timed (a relative error above 1e-2 is printed). ``sdpa`` is
the engine's other choice (`F.scaled_dot_product_attention` over the whole cache, query heads grouped by repeating
the cache as the engine does); ``default`` is the shipped settings.

Usage (a CUDA GPU):
    python scripts/bench_decode_attention.py --model qwen2.5-14b --batches 1 8 --cache-len 1280 \
        --variants MAX_CHUNK=64 MAX_CHUNK=128,BLOCK=64 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from bench_settings import arm_cells, module_settings
from bench_settings import parse_settings as parse_module_settings
from graph_timing import time_us
from model_shapes import NAMES, qwen25_config

from trl_qerl.rollout import decode_attention


SETTINGS = ("MAX_CHUNK", "BLOCK", "PARTIALS_WARPS", "MERGE_SPLITS", "MERGE_DIM_BLOCK")


def parse_settings(variant: str) -> dict[str, int]:
    """``"NAME=VALUE,NAME=VALUE"`` -> positive integer settings of `decode_attention` (only `SETTINGS`)."""
    return parse_module_settings(variant, decode_attention, allowed=SETTINGS, positive=True)


def inputs(config, batch: int, cache_len: int, position: int, device) -> tuple:
    """Random q, keys, values (bf16) and the engine's additive mask for one layer's decode attention at
    ``position``."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=torch.bfloat16)
    keys, values = (torch.randn(batch, kv_heads, cache_len, head_dim, device=device, dtype=torch.bfloat16)
                    for _ in range(2))  # fmt: skip
    mask = torch.zeros(batch, 1, 1, cache_len, device=device, dtype=torch.bfloat16)
    mask[..., position + 1 :] = torch.finfo(torch.bfloat16).min
    return q, keys, values, mask, torch.tensor([position], device=device), head_dim**-0.5


def sdpa(q, keys, values, mask, scaling):
    """SDPA over the whole cache, query heads grouped over the key/value heads without copying the cache."""
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)


def relative_error(ours: torch.Tensor, exact: torch.Tensor) -> float:
    return ((ours.double() - exact).norm() / exact.norm()).item()


def kv_megabytes(config, batch: int, position: int) -> float:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * batch * config.num_key_value_heads * (position + 1) * head_dim * 2 / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-14b", choices=NAMES)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--cache-len", type=int, default=1280, help="static cache length (prompt + new, rounded)")
    parser.add_argument("--positions", nargs="+", type=int, default=None,
                        help="positions to time (default: 5 spread over the cache)")  # fmt: skip
    parser.add_argument("--variants", nargs="*", default=[], metavar="SETTINGS",
                        help=f"settings of decode_attention per extra column, names from {SETTINGS}")  # fmt: skip
    parser.add_argument("--bandwidth", type=float, default=4.8, help="TB/s for the floor column")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    positions = args.positions or [args.cache_len * i // 5 - 1 for i in range(1, 6)]
    if any(not 0 <= p < args.cache_len for p in positions):
        raise SystemExit(f"--positions must lie in [0, {args.cache_len}) (got {positions})")
    torch.manual_seed(0)
    config = qwen25_config(args.model)
    device = torch.device("cuda")
    arms = [("default", {})] + [(variant, parse_settings(variant)) for variant in args.variants]
    results = []
    print(f"Decode attention of one {args.model} layer, cache {args.cache_len}, µs per call; "
          f"{torch.cuda.get_device_name()}")  # fmt: skip
    print("| batch | position | KV MB | sdpa | " + " | ".join(name for name, _ in arms) + " | floor |")
    print("|---|---|---|---|" + "---|" * len(arms) + "---|")
    for batch in args.batches:
        for position in positions:
            q, keys, values, mask, cache_position, scaling = inputs(config, batch, args.cache_len, position, device)
            seen = slice(0, position + 1)
            exact = sdpa(*(t.double() for t in (q, keys[:, :, seen], values[:, :, seen], mask[..., seen])), scaling)
            megabytes = kv_megabytes(config, batch, position)
            row = {"batch": batch, "position": position, "kv_mb": megabytes, "arms": {}}
            row["sdpa_us"] = time_us(lambda: sdpa(q, keys, values, mask, scaling))  # noqa: B023
            for arm, chosen in arms:
                with module_settings(decode_attention, chosen):
                    out = decode_attention.split_kv_attention(q, keys, values, mask, scaling, cache_position)
                    error = relative_error(out, exact)
                    call = lambda: decode_attention.split_kv_attention(q, keys, values, mask, scaling, cache_position)  # noqa: B023, E731
                    row["arms"][arm] = {"us": time_us(call), "rel_err": error}
            row["floor_us"] = megabytes / args.bandwidth
            results.append(row)
            cells = arm_cells(row["arms"], 1e-2)
            print(f"| {batch} | {position} | {megabytes:.1f} | {row['sdpa_us']:.1f} | {cells} | "
                  f"{row['floor_us']:.1f} |", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "cache_len": args.cache_len, "device": torch.cuda.get_device_name(),
                       "results": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
