"""The o projection's LoRA shrink made in the split-KV attention's merge launch (`split_kv_attention_shrink`,
`fused_decode.SHRINK_IN_MERGE`), on CPU in Triton's interpreter and on CUDA: the attention output is the plain op's
bit for bit, the shrink is ``out @ A.T`` of that output (float64 reference), the arrival counters are left at zero
for the next launch, and a decode step gives the same samples with and without it."""

from __future__ import annotations

import pytest
import torch

from trl_qerl.nvfp4.cuda_mma import arrival_counters
from trl_qerl.rollout import fused_decode
from trl_qerl.rollout.decode_attention import shrink_in_merge_applies, split_kv_attention, split_kv_attention_shrink


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _inputs(batch, heads, kv_heads, cache_len, head_dim, rank, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, head_dim, generator=generator).to(DEVICE, dtype)
    keys, values = (
        torch.randn(batch, kv_heads, cache_len, head_dim, generator=generator).to(DEVICE, dtype) for _ in range(2)
    )
    mask = torch.zeros(batch, 1, 1, cache_len, dtype=dtype, device=DEVICE)
    mask[-1, ..., :3] = torch.finfo(dtype).min  # left padding of the last row
    position = torch.tensor([cache_len - 17], device=DEVICE)
    lora_a = (torch.randn(rank, heads * head_dim, generator=generator) / (heads * head_dim) ** 0.5).to(DEVICE)
    return q, keys, values, mask, position, lora_a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "shape", [(1, 14, 2, 200, 64, 32), (3, 6, 2, 100, 16, 4), (2, 4, 4, 90, 32, 8), (2, 16, 2, 70, 128, 16)],
    ids=["group7-r32", "group3-r4", "group1-r8", "group8-d128"],
)  # fmt: skip
def test_the_merge_makes_the_shrink_of_the_output_it_rounds(dtype, shape):
    batch, heads, kv_heads, cache_len, head_dim, rank = shape
    q, keys, values, mask, position, lora_a = _inputs(batch, heads, kv_heads, cache_len, head_dim, rank, dtype)
    out, hidden = split_kv_attention_shrink(q, keys, values, mask, 0.3, position, lora_a)
    assert torch.equal(out, split_kv_attention(q, keys, values, mask, 0.3, position))
    assert hidden.shape == (batch, rank) and hidden.dtype == torch.float32
    reference = out.transpose(1, 2).reshape(batch, -1).double() @ lora_a.double().T
    assert ((hidden.double() - reference).norm() / reference.norm()).item() < 1e-5
    assert not arrival_counters(q.device, batch)[:batch].any()  # each row's last program reset its counter
    again = split_kv_attention_shrink(q, keys, values, mask, 0.3, position, lora_a)[1]
    assert torch.equal(again, hidden)  # the slices are added in program order: the same bits on every launch


def test_the_op_passes_opcheck():
    q, keys, values, mask, position, lora_a = _inputs(2, 4, 2, 64, 16, 8, torch.bfloat16)
    torch.library.opcheck(split_kv_attention_shrink, (q, keys, values, mask, 0.25, position, lora_a))


def test_applies_only_to_what_the_kernel_reads():
    q, _, _, _, _, lora_a = _inputs(1, 4, 2, 64, 16, 8, torch.bfloat16)
    assert shrink_in_merge_applies(q, lora_a)
    assert not shrink_in_merge_applies(q.float(), lora_a)  # the o projection's 16-bit input
    assert not shrink_in_merge_applies(q, lora_a.bfloat16())  # fp32 masters only
    assert not shrink_in_merge_applies(q, lora_a[:6])  # a rank that is not a power of two
    assert not shrink_in_merge_applies(q, lora_a[:, :32])  # width mismatch
    assert not shrink_in_merge_applies(q, torch.randn(64, 8, device=DEVICE).T)  # not contiguous


def test_the_decode_step_samples_the_same_with_the_shrink_in_the_merge(monkeypatch):
    """Greedy samples of a tiny NVFP4 + LoRA model with split-KV attention (eager on CPU, compiled and captured on
    CUDA): the same tokens with `SHRINK_IN_MERGE` on as off, and the op runs only while it is on (with the rotary
    embedding apart from the attention: `test_rotary_in_attention.py` has it inside)."""
    from _tiny import fused_samples_with_and_without

    monkeypatch.setattr(fused_decode, "ROTARY_IN_ATTENTION", False)
    samples, _ = fused_samples_with_and_without(
        monkeypatch, "SHRINK_IN_MERGE", ("split_kv_attention_shrink",), DEVICE, CUDA, rank=4,
        prompts=[[5, 6, 7], [8, 9], [3, 4, 5, 6]], decode_attention="split_kv",
    )  # fmt: skip
    ours, theirs = samples[True], samples[False]
    for our_ids, their_ids, our_logprobs, their_logprobs in zip(
        ours.completion_ids, theirs.completion_ids, ours.logprobs, theirs.logprobs
    ):
        assert our_ids[:3] == their_ids[:3]  # greedy: a near-tie may flip later tokens (summation order)
        assert torch.allclose(torch.tensor(our_logprobs[:3]), torch.tensor(their_logprobs[:3]), atol=0.05)


def test_steps_above_the_shrink_rows_or_without_split_kv_keep_the_shrink_apart(monkeypatch):
    """`fused_decode.attend` (and so the attention after the rotary embedding, and the rotary op alike: both ask
    `_merge_shrinks`) takes the shrink up to `FUSED_SHRINK_ROWS` rows, with split-KV attention, while it is on."""
    from _tiny import randomize_lora_b, tiny_model

    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout.decoder_spec import read_decoder

    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16))
    spec = read_decoder(randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=4))))
    limit = fused_decode.FUSED_SHRINK_ROWS
    for rows, split_kv, takes in ((1, True, True), (limit, True, True), (limit + 1, True, False), (1, False, False)):
        q = torch.randn(rows, spec.num_heads, 1, spec.head_dim, dtype=torch.bfloat16)
        keys = torch.randn(rows, spec.num_kv_heads, 64, spec.head_dim, dtype=torch.bfloat16)
        mask = torch.zeros(rows, 1, 1, 64, dtype=torch.bfloat16)
        attended, hidden = fused_decode.attend(q, keys, keys, mask, 0.25, torch.tensor([20]), split_kv,
                                               spec.layers[0].o)  # fmt: skip
        assert (hidden is not None) == takes
        assert attended.shape == (rows, spec.num_heads * spec.head_dim)
    monkeypatch.setattr(fused_decode, "SHRINK_IN_MERGE", False)
    assert fused_decode.attend(q, keys, keys, mask, 0.25, torch.tensor([20]), True, spec.layers[0].o)[1] is None
