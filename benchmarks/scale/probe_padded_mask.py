"""Provenance of one number in BENCHMARKS.md (not project code): does a padded attention mask make a checkpointed
forward + backward slower? Four layers at Qwen2.5-7B widths, bf16, 8 x 1280 tokens, SDPA. Run on the H200
2026-12-02 (steady state, after one warm-up call per case): none 140.9 ms, all-ones mask 150.7, one row
right-padded 149.1, one row left-padded 158.6. First calls (H200, same day): none 2256.7 ms (the process's first),
ones 141.3, right-padded 2110.1, left-padded 150.5; a right-padded mask at 1100 / 1210 / 1333 tokens: 2126.2 / 2164.8 / 2741.8 ms
first, then 131.1 / 142.8 / 161.2 ms. So the early-ended GRPO step's extra ~2 s is a one-off per new masked sequence
length. Second run (same day, `probe_padded_mask_2026-12-02b.txt`): an unmasked new length pays it too (1150 tokens:
1781.5 ms first), and under the profiler 2.22 s of a 2.35 s first call is host time in cuDNN attention's forward and
backward (plan building). ``--backend efficient`` times new masked lengths with SDPA's memory-efficient kernel
forced (`probe_padded_mask_efficient_2026-12-02.txt`): no one-off (first 167-186 ms, steady 143-178 ms) but 12 %
slower than cuDNN at 1280 tokens (167.9 against 150.4 ms)."""

import argparse
import contextlib
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config


parser = argparse.ArgumentParser()
parser.add_argument("--backend", choices=["default", "efficient"], default="default")
args = parser.parse_args()
config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096)  # fmt: skip
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
model.gradient_checkpointing_enable()
model.train()
model.config.use_cache = False


def forward_backward(ids, mask):
    out = model.model(input_ids=ids, attention_mask=mask)
    out.last_hidden_state.float().square().mean().backward()


def timed(ids, mask, repeats=1):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        forward_backward(ids, mask)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def efficient_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend, name in ((None, "default"), (SDPBackend.EFFICIENT_ATTENTION, "efficient")):
        for length in (1100, 1210, 1280, 1333) if name == "efficient" else (1150, 1280):
            ids = torch.randint(3, 1000, (8, length), device="cuda")
            mask = torch.ones_like(ids)
            mask[0, -50:] = 0
            context = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
            with context:
                first = timed(ids, mask)
                print(f"{name}, right pad, {length} tokens: first {first:.1f} ms, then {timed(ids, mask, 3):.1f} ms",
                      flush=True)  # fmt: skip


if args.backend == "efficient":
    efficient_only()
    raise SystemExit

ids = torch.randint(3, 1000, (8, 1280), device="cuda")
right, left = torch.ones_like(ids), torch.ones_like(ids)
right[0, -80:] = 0
left[0, :20] = 0
for name, mask in {"none": None, "ones": torch.ones_like(ids), "right pad one row": right,
                   "left pad one row": left}.items():  # fmt: skip
    first = timed(ids, mask)
    print(f"{name}: {timed(ids, mask, 3):.1f} ms fwd+bwd (4 layers); first {first:.1f} ms", flush=True)
for length in (1100, 1210, 1333):  # new padded shapes, as real batches bring
    ids = torch.randint(3, 1000, (8, length), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, -50:] = 0
    first = timed(ids, mask)
    print(f"right pad, {length} tokens: first {first:.1f} ms, then {timed(ids, mask, 3):.1f} ms", flush=True)
for length in (1150, 1270):  # a new length without a mask: is the one-off the mask's or the shape's?
    ids = torch.randint(3, 1000, (8, length), device="cuda")
    first = timed(ids, None)
    print(f"no mask, {length} tokens: first {first:.1f} ms, then {timed(ids, None, 3):.1f} ms", flush=True)
ids = torch.randint(3, 1000, (8, 1400), device="cuda")
mask = torch.ones_like(ids)
mask[0, -50:] = 0
with torch.profiler.profile(
    activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
) as prof:
    first = timed(ids, mask)
print(f"right pad, 1400 tokens, profiled: first {first:.1f} ms", flush=True)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=60))
