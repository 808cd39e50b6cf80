"""The rotary embedding and the cache writes made in the split-KV attention's partials launch
(`split_kv_attention_rotary`, `fused_decode.ROTARY_IN_ATTENTION`), on CPU in Triton's interpreter and on CUDA: the
same bits as transformers' rotary, ``index_copy_`` into the cache and `split_kv_attention` after it; the cache changed
at the step's position only; no copy of the cache in a compiled graph; the same samples from a decode step."""

from __future__ import annotations

import pytest
import torch

from trl_qerl.rollout import fused_decode
from trl_qerl.rollout.decode_attention import (
    rotary_in_attention_applies,
    split_kv_attention,
    split_kv_attention_rotary,
)


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _inputs(batch, heads, kv_heads, cache_len, head_dim, dtype, seed=0):
    """q/k/v as views of one fused projection output (strided rows), cos/sin of random positions, a random cache."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=generator).to(DEVICE, dtype)
    q, k, v = fused.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    angles = torch.rand(batch, 1, head_dim // 2, generator=generator) * 50
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(DEVICE, dtype)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(DEVICE, dtype)
    keys, values = (
        torch.randn(batch, kv_heads, cache_len, head_dim, generator=generator).to(DEVICE, dtype) for _ in range(2)
    )
    mask = torch.zeros(batch, 1, 1, cache_len, dtype=dtype, device=DEVICE)
    mask[-1, ..., :3] = torch.finfo(dtype).min
    return q, k, v, cos, sin, keys, values, mask, torch.tensor([cache_len - 23], device=DEVICE)


def _reference(q, k, v, cos, sin, keys, values, mask, position, scaling):
    """What the layer computes without the op: transformers' rotary, ``index_copy_``, `split_kv_attention`."""
    batch, head_dim = q.shape[0], keys.shape[3]
    q4, k4 = fused_decode.apply_rotary(q.view(batch, 1, -1, head_dim).transpose(1, 2),
                                       k.view(batch, 1, -1, head_dim).transpose(1, 2), cos, sin)  # fmt: skip
    keys.index_copy_(2, position, k4)
    values.index_copy_(2, position, v.view(batch, 1, -1, head_dim).transpose(1, 2))
    return split_kv_attention(q4, keys, values, mask, scaling, position)


@pytest.mark.parametrize(
    "shape", [(1, 14, 2, 300, 64), (3, 6, 2, 100, 16), (2, 4, 4, 90, 32), (2, 16, 2, 200, 128)],
    ids=["group7", "group3", "group1", "group8-d128"],
)  # fmt: skip
def test_the_partials_launch_rotates_and_writes_the_cache_as_the_eager_ops_do(shape):
    inputs = _inputs(*shape, dtype=torch.bfloat16)
    q, k, v, cos, sin, keys, values, mask, position = inputs
    keys[:, :, int(position[0])] = values[:, :, int(position[0])] = float("nan")  # what the cache held there is lost
    assert rotary_in_attention_applies(q, k, v, cos, sin, keys)
    before = keys.clone(), values.clone()
    their_keys, their_values = keys.clone(), values.clone()
    expected = _reference(q, k, v, cos, sin, their_keys, their_values, mask, position, 0.3)
    out = split_kv_attention_rotary(q, k, v, cos, sin, keys, values, mask, 0.3, position)
    assert torch.equal(out, expected)
    assert torch.equal(keys, their_keys) and torch.equal(values, their_values)
    written = int(position[0])
    for ours, old in zip((keys, values), before):  # nothing but the step's position changed
        assert torch.equal(torch.cat([ours[:, :, :written], ours[:, :, written + 1 :]], 2),
                           torch.cat([old[:, :, :written], old[:, :, written + 1 :]], 2))  # fmt: skip
        assert not ours[:, :, written].isnan().any()


def test_the_op_passes_opcheck():
    q, k, v, cos, sin, keys, values, mask, position = _inputs(2, 4, 2, 64, 16, torch.bfloat16)
    torch.library.opcheck(split_kv_attention_rotary, (q, k, v, cos, sin, keys, values, mask, 0.25, position))


def test_applies_only_to_what_the_kernel_reads():
    q, k, v, cos, sin, keys, *_ = _inputs(2, 4, 2, 64, 16, torch.bfloat16)
    assert rotary_in_attention_applies(q, k, v, cos, sin, keys)
    assert not rotary_in_attention_applies(q, k, v, cos.float(), sin, keys)  # cos in another dtype
    half = [t.half() for t in (q, k, v, cos, sin, keys)]
    assert not rotary_in_attention_applies(*half)  # fp16 (and fp32): FMA contraction would change the bits
    assert not rotary_in_attention_applies(*[t.float() for t in half])
    assert not rotary_in_attention_applies(q, k, v[:, :16], cos, sin, keys)  # not the cache's key/value heads
    assert not rotary_in_attention_applies(q, k, v, cos.expand(2, 3, 16), sin, keys)  # more than one token
    assert not rotary_in_attention_applies(q.T.contiguous().T, k, v, cos, sin, keys)  # strided last dim
    assert not rotary_in_attention_applies(q, k, v, cos, torch.cat([sin, sin], -1)[..., ::2], keys)  # strided sin


def test_a_compiled_graph_writes_the_cache_in_place_without_copying_it():
    """The op mutates the cache it is given: inductor calls it on the graph's inputs (no clone of the cache, no copy
    back), and the compiled function's cache and output equal the eager ones."""
    from torch._inductor.utils import run_and_get_code

    q, k, v, cos, sin, keys, values, mask, position = _inputs(2, 4, 2, 64, 16, torch.bfloat16)

    def step(q, k, v, cos, sin, keys, values, mask, position):
        return split_kv_attention_rotary(q, k, v, cos, sin, keys, values, mask, 0.25, position) * 2

    eager_keys, eager_values = keys.clone(), values.clone()
    expected = step(q, k, v, cos, sin, eager_keys, eager_values, mask, position)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    out, (code,) = run_and_get_code(compiled, q, k, v, cos, sin, keys, values, mask, position)
    assert torch.equal(out, expected) and torch.equal(keys, eager_keys) and torch.equal(values, eager_values)
    assert "split_kv_attention_rotary" in code
    assert "clone" not in code and ".copy_(" not in code


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_decode_step_samples_the_same_with_the_rotary_in_the_attention(monkeypatch, arch):
    """Greedy samples of a tiny NVFP4 + LoRA model with split-KV attention (eager on CPU: the same bits; compiled and
    captured on CUDA), with `ROTARY_IN_ATTENTION` on and off; the op runs only while it is on."""
    from _tiny import assert_first_draws_agree, fused_samples_with_and_without

    samples, _ = fused_samples_with_and_without(
        monkeypatch, "ROTARY_IN_ATTENTION", ("split_kv_attention_rotary",), DEVICE, CUDA, arch, rank=4,
        prompts=[[5, 6, 7], [8, 9], [3, 4, 5, 6]], decode_attention="split_kv",
    )  # fmt: skip
    ours, theirs = samples[True], samples[False]
    if not CUDA:
        assert ours.completion_ids == theirs.completion_ids and ours.logprobs == theirs.logprobs
    assert_first_draws_agree(ours, theirs)


def test_layers_with_q_and_k_norms_keep_the_rotary_apart(monkeypatch):
    """Qwen3's q/k norms come between the projection and the rotary embedding: its layers take the path before."""
    from _tiny import tiny_model

    monkeypatch.setattr(fused_decode, "ROTARY_IN_ATTENTION", True)

    from trl_qerl.rollout.decoder_spec import read_decoder

    qwen3, qwen2 = (read_decoder(tiny_model(arch, dtype=torch.bfloat16)).layers[0] for arch in ("qwen3", "qwen2"))
    q, k, v, cos, sin, keys, *_ = _inputs(1, 4, 2, 64, 16, torch.bfloat16)
    assert not fused_decode._rotary_in_attention(qwen3, q, k, v, cos, sin, keys)
    assert fused_decode._rotary_in_attention(qwen2, q, k, v, cos, sin, keys)
    monkeypatch.setattr(fused_decode, "ROTARY_IN_ATTENTION", False)
    assert not fused_decode._rotary_in_attention(qwen2, q, k, v, cos, sin, keys)
