"""Finished rows leave the decode step (`StaticCacheGenerator(compact_finished=True)`): same outputs, smaller steps."""

from __future__ import annotations

import logging

import pytest
import torch
from _tiny import tiny_model, tiny_nvfp4_lora_model

from trl_qerl.rollout.decoder_spec import read_decoder
from trl_qerl.rollout.fast import COMPACT_MIN_ROWS, SamplingParams, StaticCacheGenerator
from trl_qerl.rollout.fused_decode import FusedDecoder


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GREEDY = SamplingParams(max_new_tokens=40, temperature=0)
PROMPTS = torch.randint(3, 128, (8, 6), generator=torch.Generator().manual_seed(0)).tolist()
pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _model(dtype=torch.float32):
    return tiny_nvfp4_lora_model(dtype, DEVICE)


def _generator(model, compact: bool, **kwargs):
    defaults = dict(engine="fused", cuda_graph=False, compile=False, check_every=2)
    return StaticCacheGenerator(model, compact_finished=compact, **{**defaults, **kwargs})


def _staggered_eos(model, prompts=PROMPTS, params=GREEDY) -> list[int]:
    """EOS ids that end most rows at different, early steps: each row's token at step 2 + 2·row (greedy rows
    are deterministic, so the same ids end the same rows in every run), minus ids the last row ever draws (it
    runs to the end)."""
    free = _generator(model, False).sample(prompts, params, [1], 0).completion_ids
    last = set(free[-1])
    return sorted({row[2 + 2 * i] for i, row in enumerate(free[:-1]) if row[2 + 2 * i] not in last})


def _assert_same(ours, theirs, atol=1e-5):
    assert ours.completion_ids == theirs.completion_ids
    for field in ("logprobs", "entropies"):
        for a, b in zip(getattr(ours, field), getattr(theirs, field)):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=atol), field


def test_greedy_rollouts_are_the_same_with_finished_rows_compacted():
    model = _model()
    eos = _staggered_eos(model)
    compacting = _generator(model, True)
    ours, theirs = compacting.sample(PROMPTS, GREEDY, eos, 0), _generator(model, False).sample(PROMPTS, GREEDY, eos, 0)
    lengths = sorted(len(row) for row in theirs.completion_ids)
    assert lengths[0] < 12 and lengths[-1] == GREEDY.max_new_tokens  # the test needs a spread of lengths
    assert compacting.compactions >= 2  # 8 -> 4 -> 2 (or 1) rows
    _assert_same(ours, theirs)
    assert next(iter(compacting._states.values())).smaller  # the smaller states are kept for the next rollout


def test_rows_filling_the_batch_bucket_are_dropped_when_compacting():
    """5 prompts in a bucket of 8: three filler rows never count as decoding, and compaction leaves them out."""
    model = _model()
    prompts = PROMPTS[:5]
    eos = _staggered_eos(model, prompts)
    compacting = _generator(model, True, batch_bucket=8)
    ours = compacting.sample(prompts, GREEDY, eos, 0)
    theirs = _generator(model, False, batch_bucket=8).sample(prompts, GREEDY, eos, 0)
    assert len(ours.completion_ids) == 5 and compacting.compactions >= 1
    _assert_same(ours, theirs)


def test_a_second_rollout_reuses_the_smaller_states():
    model = _model()
    eos = _staggered_eos(model)
    compacting = _generator(model, True)
    first = compacting.sample(PROMPTS, GREEDY, eos, 0)
    state = next(iter(compacting._states.values()))
    sizes = dict(state.smaller)
    second = compacting.sample(PROMPTS, GREEDY, eos, 0)
    assert second.completion_ids == first.completion_ids
    assert all(state.smaller[size] is sizes[size] for size in sizes)


def test_sampled_rollouts_with_compaction_end_at_eos_and_keep_their_shape():
    model = _model()
    eos = _staggered_eos(model)
    params = SamplingParams(max_new_tokens=40, temperature=1.0)
    torch.manual_seed(0)
    compacting = _generator(model, True)
    samples = compacting.sample(PROMPTS, params, eos, 0)
    for ids, logprobs, entropies in zip(samples.completion_ids, samples.logprobs, samples.entropies):
        assert len(ids) == len(logprobs) == len(entropies) >= 1
        assert all(token not in eos for token in ids[:-1])  # cut at the first EOS
        assert ids[-1] in eos or len(ids) == params.max_new_tokens
        assert all(value <= 0 for value in logprobs) and all(value >= 0 for value in entropies)


def test_the_model_engine_logs_that_it_cannot_compact(caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.fast"):
        generator = StaticCacheGenerator(model, engine="model", cuda_graph=False, compact_finished=True)
    assert not generator.compact_finished
    assert any("compact_finished needs the fused decode step" in r.message for r in caplog.records)
    assert generator.sample(PROMPTS[:2], SamplingParams(max_new_tokens=4, temperature=0), [1], 0).completion_ids


def test_first_rows_share_the_cache_and_gather_moves_rows():
    decoder = FusedDecoder(read_decoder(tiny_model("qwen2", dtype=torch.float32)), 4, 8, "cpu")
    for layer, tensor in enumerate(decoder.keys):
        tensor.copy_(torch.arange(4.0).view(4, 1, 1, 1).expand_as(tensor) + 10 * layer)
    smaller = decoder.first_rows(2)
    assert smaller.keys[0].data_ptr() == decoder.keys[0].data_ptr() and smaller.keys[0].shape[0] == 2
    decoder.gather_rows(torch.tensor([3, 3]))
    assert (smaller.keys[1][:, 0, 0, 0] == torch.tensor([13.0, 13.0])).all()
    with pytest.raises(ValueError, match="first_rows"):
        decoder.first_rows(5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_compiled_captured_steps_compact_on_cuda():
    model = _model(torch.bfloat16)
    eos = _staggered_eos(model)
    compacting = _generator(model, True, cuda_graph=True, compile=True)
    plain = _generator(model, False, cuda_graph=True, compile=True)
    ours, theirs = compacting.sample(PROMPTS, GREEDY, eos, 0), plain.sample(PROMPTS, GREEDY, eos, 0)
    agree = [a == b for x, y in zip(ours.completion_ids, theirs.completion_ids) for a, b in zip(x, y)]
    assert sum(agree) / len(agree) >= 0.9  # bf16: a smaller batch may sum in another order, and a tie may flip
    assert compacting.compactions >= 2 and compacting.captures == 1 + compacting.compactions
    captures = compacting.captures
    compacting.sample(PROMPTS, GREEDY, eos, 0)
    assert compacting.captures == captures  # the smaller steps were kept


def test_by_default_only_steps_of_many_rows_compact():
    model = _model()
    eos = _staggered_eos(model)
    default = StaticCacheGenerator(model, engine="fused", cuda_graph=False, compile=False, check_every=2)
    default.sample(PROMPTS, GREEDY, eos, 0)
    assert default.compactions == 0  # 8 rows: measured not to pay
    assert [default._compacts(rows) for rows in (8, 16, COMPACT_MIN_ROWS, 64)] == [False, False, True, True]
    assert not _generator(model, False)._compacts(64) and _generator(model, True)._compacts(2)


def test_prefill_reads_only_the_prompts_positions():
    """Cache positions past the prompt are never read by the prefill's attention: NaN there would reach the logits
    through SDPA (a zero weight times NaN) if they were."""
    model = tiny_model("qwen2", dtype=torch.float32)
    decoder = FusedDecoder(read_decoder(model), 1, 16, "cpu")
    for tensor in (*decoder.keys, *decoder.values):
        tensor.fill_(float("nan"))
    tokens = 5
    mask = torch.full((1, 1, tokens, 16), torch.finfo(torch.float32).min).triu_(1)  # causal, the rest hidden
    positions = torch.arange(tokens)[None]
    logits = decoder.prefill(torch.arange(3, 3 + tokens)[None], mask, positions, torch.arange(tokens))
    with torch.no_grad():
        expected = model(torch.arange(3, 3 + tokens)[None]).logits[:, -1]
    assert torch.allclose(logits, expected, atol=1e-5)
