"""The split-KV decode attention kernel against SDPA (float64), on CPU in Triton's interpreter and on CUDA."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _tiny import tiny_model, tiny_nvfp4_lora_model

from trl_qerl.rollout.decode_attention import (
    MIN_STAT,
    combine_partials,
    launch_merge,
    launch_partials,
    partials_reference,
    split_kv_attention,
    split_kv_partials,
)
from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # fp32 dots are fp32 on CUDA too; METHOD.md bands
pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _inputs(batch, heads, kv_heads, cache_len, head_dim, position, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, kv_heads, cache_len, head_dim)
    q = torch.randn(batch, heads, 1, head_dim, generator=generator).to(DEVICE, dtype)
    keys, values = (torch.randn(shape, generator=generator).to(DEVICE, dtype) for _ in range(2))
    hidden = torch.finfo(dtype).min
    mask = torch.zeros(batch, 1, 1, cache_len, dtype=dtype, device=DEVICE)
    mask[..., position + 1 :] = hidden  # not written yet, as the decode state masks it
    mask[-1, ..., :3] = hidden  # left padding of the last row
    return q, keys, values, mask, torch.tensor([position], device=DEVICE)


def _sdpa64(q, keys, values, mask, scaling):
    group = q.shape[1] // keys.shape[1]
    keys, values = (t.double().repeat_interleave(group, dim=1) for t in (keys, values))
    return F.scaled_dot_product_attention(q.double(), keys, values, attn_mask=mask.double(), scale=scaling)


def _relative_error(ours, reference):
    return ((ours.double() - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 6, 2, 100, 16), (2, 7, 1, 70, 32)], ids=["group3", "group7"])
def test_split_kv_attention_matches_sdpa(dtype, shape):
    batch, heads, kv_heads, cache_len, head_dim = shape
    q, keys, values, mask, position = _inputs(*shape, position=cache_len - 29, dtype=dtype)
    ours = split_kv_attention(q, keys, values, mask, 0.3, position)
    assert ours.shape == q.shape and ours.dtype == dtype
    assert _relative_error(ours, _sdpa64(q, keys, values, mask, 0.3)) < TOLERANCE[dtype]


def test_chunks_past_the_position_are_never_read_and_weigh_nothing():
    """Five chunks, the position in the third: the last two read nothing (NaN there changes nothing), every output
    element is written, and the partials equal the torch reference chunk by chunk."""
    q, keys, values, mask, position = _inputs(1, 4, 1, 300, 16, position=150, dtype=torch.float32, seed=2)
    clean = _sdpa64(q, keys, values, mask, 0.25)
    expected = partials_reference(q.cpu(), keys.cpu(), values.cpu(), mask.cpu(), 0.25, position.cpu(), chunk=64)
    keys[:, :, 151:], values[:, :, 151:] = float("nan"), float("nan")  # what an unwritten cache may hold
    acc = torch.full((1, 5, 4, 16), float("nan"), device=DEVICE)
    maxima, sums = (
        torch.full((1, 5, 4), float("nan"), device=DEVICE),
        torch.full((1, 5, 4), float("nan"), device=DEVICE),
    )
    launch_partials(q, keys, values, mask, 0.25, position, acc, maxima, sums)
    assert not any(t.isnan().any() for t in (acc, maxima, sums))
    assert (sums[:, 3:] == 0).all() and (acc[:, 3:] == 0).all() and (maxima[:, 3:] == MIN_STAT).all()
    for ours, theirs in zip((acc, maxima, sums), expected):
        assert torch.allclose(ours.cpu(), theirs, rtol=1e-3, atol=1e-4)
    assert _relative_error(combine_partials(acc, maxima, sums).reshape(q.shape), clean) < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_merge_kernel_equals_the_torch_merge(dtype):
    """Random partials of 2 rows x 3 KV heads, 5 chunks, GQA group 7 (padded to 16 in the kernel), the last two
    chunks of the second row empty (max `MIN_STAT`, sum 0): the kernel's output equals `combine_partials`."""
    generator = torch.Generator().manual_seed(5)
    batch, kv_heads, splits, group, head_dim = 2, 3, 5, 7, 32
    acc = torch.randn(batch * kv_heads, splits, group, head_dim, generator=generator)
    maxima = torch.randn(batch * kv_heads, splits, group, generator=generator) * 4
    sums = torch.rand(batch * kv_heads, splits, group, generator=generator) + 0.5
    empty = slice(kv_heads, None), slice(3, None)
    acc[empty], maxima[empty], sums[empty] = 0.0, MIN_STAT, 0.0
    expected = combine_partials(acc, maxima, sums).reshape(batch, kv_heads * group, 1, head_dim)
    out = torch.full((batch, kv_heads * group, 1, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    launch_merge(acc.to(DEVICE), maxima.to(DEVICE), sums.to(DEVICE), out)
    assert torch.allclose(out.cpu().float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split_block, dim_block", [(1, 0), (2, 8), (4, 16)], ids=["1-chunk", "2-chunks-8-dims", "4"])
def test_the_merge_reads_only_the_chunks_up_to_the_position(monkeypatch, dtype, split_block, dim_block):
    """Five chunks of 64 positions, the position (150) in the third: given the position, the merge never reads the
    last two chunks (NaN there changes nothing) and gives `combine_partials` of the first three, whether it reads one
    chunk per step or several (the last step part-masked), all head dims per program or a slice."""
    from trl_qerl.rollout import decode_attention

    monkeypatch.setattr(decode_attention, "MERGE_SPLITS", split_block)
    monkeypatch.setattr(decode_attention, "MERGE_DIM_BLOCK", dim_block)
    generator = torch.Generator().manual_seed(6)
    row_heads, splits, group, head_dim = 4, 5, 3, 16
    acc = torch.randn(row_heads, splits, group, head_dim, generator=generator)
    maxima = torch.randn(row_heads, splits, group, generator=generator) * 4
    sums = torch.rand(row_heads, splits, group, generator=generator) + 0.5
    expected = combine_partials(acc[:, :3], maxima[:, :3], sums[:, :3]).reshape(2, 2 * group, 1, head_dim)
    acc[:, 3:], sums[:, 3:], maxima[:, 3:] = float("nan"), float("nan"), MIN_STAT
    out = torch.full((2, 2 * group, 1, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    position = torch.tensor([150], device=DEVICE)
    launch_merge(acc.to(DEVICE), maxima.to(DEVICE), sums.to(DEVICE), out, position, cache_len=5 * 64 - 10)
    assert torch.allclose(out.cpu().float(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


def test_the_merge_refuses_a_dim_block_that_does_not_divide_the_head_dim(monkeypatch):
    from trl_qerl.rollout import decode_attention

    monkeypatch.setattr(decode_attention, "MERGE_DIM_BLOCK", 24)
    q, keys, values, mask, position = _inputs(1, 2, 1, 64, 32, position=40, dtype=torch.float32)
    with pytest.raises(ValueError, match="dim_block 24 must be a power of two dividing head_dim 32"):
        split_kv_attention(q, keys, values, mask, 0.25, position)


@pytest.mark.parametrize(
    "settings",
    [
        {"MAX_CHUNK": 32},
        {"MAX_CHUNK": 100, "BLOCK": 64},
        {"BLOCK": 16, "PARTIALS_WARPS": 8},
        {"MAX_CHUNK": 32, "MERGE_SPLITS": 4, "MERGE_DIM_BLOCK": 8},
    ],
    ids=["short-chunks", "rounded-up-cap", "small-steps-8-warps", "merge-4-chunks-8-dims"],
)
def test_chunk_step_and_warp_settings_change_the_launch_not_the_result(monkeypatch, settings):
    """`MAX_CHUNK` caps the positions per program (rounded up to `BLOCK`), so more chunks split the cache; the output
    still matches SDPA for every setting, at a position inside a chunk past the first."""
    from trl_qerl.rollout import decode_attention

    q, keys, values, mask, position = _inputs(2, 6, 2, 300, 16, position=213, dtype=torch.bfloat16, seed=7)
    for name, value in settings.items():
        monkeypatch.setattr(decode_attention, name, value)
    block = decode_attention.BLOCK
    chunk = decode_attention.chunk_size(300, 4, q.device)
    assert chunk % block == 0
    assert split_kv_partials(q, keys, values, mask, 0.3, position)[0].shape[1] == -(-300 // chunk)
    if "MAX_CHUNK" in settings:  # a cache long enough that the cap binds on any device's multiprocessor count
        assert decode_attention.chunk_size(1 << 20, 4, q.device) == max(
            block, -(-settings["MAX_CHUNK"] // block) * block
        )
    ours = split_kv_attention(q, keys, values, mask, 0.3, position)
    assert _relative_error(ours, _sdpa64(q, keys, values, mask, 0.3)) < TOLERANCE[torch.bfloat16]


def test_bench_decode_attention_settings_are_checked():
    """`scripts/bench_decode_attention.py` takes only the settings it names, as positive integers."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
    from bench_decode_attention import kv_megabytes, parse_settings
    from model_shapes import qwen25_config

    assert parse_settings("MAX_CHUNK=64,BLOCK=64") == {"MAX_CHUNK": 64, "BLOCK": 64}
    for bad in ("MIN_STAT=1", "MAX_CHUNK=0", "BLOCK=x", "MAX_CHUNK"):
        with pytest.raises(SystemExit, match="--variants"):
            parse_settings(bad)
    # 14B: 8 key/value heads of 128, keys and values in bf16, positions 0..1279 of 8 rows
    assert kv_megabytes(qwen25_config("qwen2.5-14b"), 8, 1279) == pytest.approx(2 * 8 * 8 * 1280 * 128 * 2 / 1e6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_merges_as_the_second_kernel_does(monkeypatch, dtype):
    """The last chunk of each (row, key/value head) to arrive merges in the partials launch, in the merge kernel's
    tiles: the same numbers as the two-launch form, bit for bit, and its arrival counters are back at zero for the next launch (or graph replay)."""
    from trl_qerl.nvfp4.cuda_mma import arrival_counters
    from trl_qerl.rollout import decode_attention

    inputs = _inputs(3, 6, 2, 100, 64, position=71, dtype=dtype, seed=5)  # head dims merged in slices of 32
    monkeypatch.setattr(decode_attention, "MERGE_DIM_BLOCK", 32)
    monkeypatch.setattr(decode_attention, "MERGE_SPLITS", 4)
    monkeypatch.setattr(decode_attention, "MERGE_IN_PARTIALS", True)
    one = [split_kv_attention(*inputs[:4], 0.3, inputs[4]) for _ in range(2)]
    assert (arrival_counters(one[0].device, 6)[:6] == 0).all()
    monkeypatch.setattr(decode_attention, "MERGE_IN_PARTIALS", False)
    two = split_kv_attention(*inputs[:4], 0.3, inputs[4])
    assert torch.equal(one[0], two) and torch.equal(one[1], two)


def test_a_row_with_every_position_masked_stays_finite():
    """Cannot happen in decode (the current position is always visible), but must not produce NaN: such a row
    averages the values up to the position, as SDPA would over that part of the cache."""
    q, keys, values, mask, position = _inputs(2, 4, 2, 64, 16, position=40, dtype=torch.bfloat16, seed=4)
    mask[0] = torch.finfo(torch.bfloat16).min
    ours = split_kv_attention(q, keys, values, mask, 0.25, position)
    assert torch.isfinite(ours).all()
    seen = slice(0, 41)
    expected = _sdpa64(q, keys[:, :, seen], values[:, :, seen], mask[..., seen], 0.25)
    assert _relative_error(ours, expected) < TOLERANCE[torch.bfloat16]


def test_the_op_compiles_into_a_graph():
    """`split_kv_partials` and `split_kv_attention` are opaque ops with fake implementations: a compiled function
    calls them as they are."""
    q, keys, values, mask, position = _inputs(2, 4, 2, 64, 16, position=40, dtype=torch.float32, seed=3)
    shapes = [t.shape for t in split_kv_partials(q, keys, values, mask, 0.25, position)]
    compiled = torch.compile(split_kv_attention, fullgraph=True)
    assert (
        _relative_error(compiled(q, keys, values, mask, 0.25, position), _sdpa64(q, keys, values, mask, 0.25)) < 1e-3
    )
    assert shapes[0][:3] == shapes[1] == shapes[2] and shapes[0][0] == 4


@pytest.mark.skipif(CUDA, reason="the eager CPU step; CUDA runs the compiled, captured step below")
def test_fused_decoder_with_split_kv_decodes_as_with_sdpa(monkeypatch):
    from trl_qerl.rollout import fused_decode

    calls = []
    for name in ("split_kv_attention", "split_kv_attention_rotary"):  # (the second with `ROTARY_IN_ATTENTION`)
        original = getattr(fused_decode, name)
        monkeypatch.setattr(fused_decode, name, lambda *args, _o=original: calls.append(1) or _o(*args))
    model = tiny_nvfp4_lora_model(torch.float32, DEVICE)
    prompts, params = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11]], SamplingParams(12, temperature=0)
    runs = {
        attention: StaticCacheGenerator(model, engine="fused", cuda_graph=False, decode_attention=attention).sample(
            prompts, params, [1], 0
        )
        for attention in ("sdpa", "split_kv")
    }  # fmt: skip
    assert len(calls) == 11 * 2  # 11 decode steps after the prefill's token, 2 layers
    assert runs["split_kv"].completion_ids == runs["sdpa"].completion_ids
    for ours, theirs in zip(runs["split_kv"].logprobs, runs["sdpa"].logprobs):
        assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=1e-4)


def test_split_kv_where_it_cannot_run_logs_once_and_uses_sdpa(monkeypatch, caplog):
    from trl_qerl.rollout.decoder_spec import read_decoder
    from trl_qerl.rollout.fused_decode import FusedDecoder

    model = tiny_model("llama", dtype=torch.float32, head_dim=8)  # below a tl.dot operand's 16
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.fused_decode"):
        decoder = FusedDecoder(read_decoder(model), 2, 32, "cpu", decode_attention="split_kv")
    assert not decoder.split_kv
    assert [r.message for r in caplog.records if "split_kv" in r.message] == [
        "decode_attention='split_kv' cannot run here (head_dim 8 / dtype torch.float32 is outside what it handles); "
        "decode attention uses SDPA."
    ]
    with pytest.raises(ValueError, match="decode_attention='flash'"):
        StaticCacheGenerator(model, decode_attention="flash")


def test_auto_takes_split_kv_on_hopper_and_sdpa_elsewhere_without_a_warning(caplog, monkeypatch):
    from trl_qerl.rollout import fused_decode
    from trl_qerl.rollout.decoder_spec import read_decoder

    model = tiny_model("llama", dtype=torch.bfloat16).to(DEVICE)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.fused_decode"):
        decoder = fused_decode.FusedDecoder(read_decoder(model), 2, 32, DEVICE)  # decode_attention="auto"
    hopper = CUDA and torch.cuda.get_device_capability()[0] == 9
    assert decoder.split_kv == hopper
    assert not [r for r in caplog.records if "split_kv" in r.message]
    assert not fused_decode._auto_takes_split_kv(torch.device("cpu"))
    for capability, expected in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert fused_decode._auto_takes_split_kv(torch.device("cuda")) is expected


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_compiled_captured_step_with_split_kv_on_cuda():
    model = tiny_nvfp4_lora_model(torch.bfloat16, DEVICE)
    prompts = torch.randint(3, 128, (4, 40), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=24, temperature=0)
    split = StaticCacheGenerator(model, engine="fused", compile=True, decode_attention="split_kv")
    sdpa = StaticCacheGenerator(model, engine="fused", compile=True)
    ours, theirs = split.sample(prompts, params, [1], 0), sdpa.sample(prompts, params, [1], 0)
    agree = [a == b for x, y in zip(ours.completion_ids, theirs.completion_ids) for a, b in zip(x, y)]
    assert sum(agree) / len(agree) >= 0.9  # bf16 ties may flip a token, then the rows diverge
    first = torch.tensor([row[0] for row in ours.logprobs]), torch.tensor([row[0] for row in theirs.logprobs])
    assert torch.allclose(*first, atol=0.05)
    assert split.captures == 1


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_compiled_captured_steps_merge_in_the_partials_launch_as_in_a_second_kernel(monkeypatch):
    """`MERGE_IN_PARTIALS` in a compiled, captured decode step: the same tokens and log-probs, bit for bit, as the
    two-launch merge, over many replays of one graph (the arrival counters reset themselves)."""
    from trl_qerl.rollout import decode_attention

    model = tiny_nvfp4_lora_model(torch.bfloat16, DEVICE)
    prompts = torch.randint(3, 128, (4, 40), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=24, temperature=0)
    runs = {}
    for one_launch in (False, True):
        monkeypatch.setattr(decode_attention, "MERGE_IN_PARTIALS", one_launch)
        generator = StaticCacheGenerator(model, engine="fused", compile=True, decode_attention="split_kv")
        runs[one_launch] = [generator.sample(prompts, params, [1], 0) for _ in range(2)]
        assert generator.captures == 1
    for ours in runs[True]:
        assert ours.completion_ids == runs[False][0].completion_ids
        assert ours.logprobs == runs[False][0].logprobs


def test_the_rollout_package_imports_without_triton():
    """Triton is optional (CPU-only environments such as vLLM's CPU build lack it): importing the decoders must not
    need it, and asking for split-KV attention there logs and uses SDPA."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from trl_qerl.rollout.fast import StaticCacheGenerator\n"
        "from trl_qerl.rollout.decoder_spec import read_decoder\n"
        "from trl_qerl.rollout.fused_decode import FusedDecoder\n"
        "from _tiny import tiny_model\n"
        "decoder = FusedDecoder(read_decoder(tiny_model('qwen2')), 1, 16, 'cpu', decode_attention='split_kv')\n"
        "assert not decoder.split_kv\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=Path(__file__).parent)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Triton is not installed" in result.stderr
