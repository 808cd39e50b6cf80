"""Provenance of one number in BENCHMARKS.md (not project code): does a padded attention mask make a checkpointed
forward + backward slower? Four layers at Qwen2.5-7B widths, bf16, 8 x 1280 tokens, SDPA. Run on the H200
2026-12-02: none 140.9 ms, all-ones mask 150.7, one row right-padded 149.1, one row left-padded 158.6."""

import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config


config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096)  # fmt: skip
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
model.gradient_checkpointing_enable()
model.train()
model.config.use_cache = False
ids = torch.randint(3, 1000, (8, 1280), device="cuda")


def forward_backward(mask):
    out = model.model(input_ids=ids, attention_mask=mask)
    out.last_hidden_state.float().square().mean().backward()


right, left = torch.ones_like(ids), torch.ones_like(ids)
right[0, -80:] = 0
left[0, :20] = 0
for name, mask in {"none": None, "ones": torch.ones_like(ids), "right pad one row": right,
                   "left pad one row": left}.items():  # fmt: skip
    forward_backward(mask)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        forward_backward(mask)
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - start) / 3 * 1e3:.1f} ms fwd+bwd (4 layers)", flush=True)
