"""Static-cache rollouts: exact greedy agreement with model.generate, sampling distributions, EOS and length
handling, AQN visibility, compile-once, and the logged fallback."""

import logging
import math

import pytest
import torch
from _tiny import randomize_lora_b, tiny_chat_checkpoint, tiny_model, tiny_nvfp4_lora_model
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from trl_qerl.lora import get_peft_model, nvfp4_lora_config
from trl_qerl.noise import NormNoise
from trl_qerl.quantizer import quantize_model
from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator, filter_logits, sample_tokens


PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12]]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _reference(model, prompts, max_new_tokens, eos, pad=0):
    """model.generate on left-padded prompts, cut after the first EOS."""
    length = max(map(len, prompts))
    ids = torch.tensor([[pad] * (length - len(p)) + p for p in prompts], device=model.device)
    mask = (ids != pad).long()
    for row, prompt in enumerate(prompts):
        mask[row, length - len(prompt) :] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)[:, length:].tolist()  # fmt: skip
    trimmed = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t == eos), len(row))
        trimmed.append(row[:cut])
    return trimmed


def _models():
    base = tiny_model("qwen2", dtype=torch.float32).to(DEVICE)
    nvfp4 = quantize_model(tiny_model("qwen2", dtype=torch.float32)).to(DEVICE)
    with_lora = get_peft_model(quantize_model(tiny_model("llama", dtype=torch.float32)), nvfp4_lora_config(r=4))
    randomize_lora_b(with_lora)
    return {"fp32": base, "nvfp4": nvfp4, "nvfp4+lora": with_lora.to(DEVICE)}


@pytest.mark.parametrize("kind", ["fp32", "nvfp4", "nvfp4+lora"])
def test_greedy_equals_model_generate(kind):
    model = _models()[kind].eval()
    generator = StaticCacheGenerator(model, cuda_graph=False, check_every=4)
    reference = _reference(model, PROMPTS, 16, eos=1)
    eos = reference[0][3]  # a token the model really emits: makes row 0 (and maybe others) stop early
    first = reference[0].index(eos)
    reference = _reference(model, PROMPTS, 16, eos=eos)
    ours = generator.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0), [eos], pad_token_id=0)
    assert ours == reference
    assert len(ours[0]) == first + 1 and ours[0][-1] == eos
    assert all(len(row) <= 16 for row in ours)


def test_many_eos_ids_end_rows_as_one_does():
    """Sixty-one EOS ids (sixty the model cannot emit): `torch.isin` would sort with `unique` and break CUDA-graph
    capture; the rows must end exactly where the one real id ends them (captured on CUDA, eager on CPU)."""
    model = _models()["nvfp4"].eval()
    reference = _reference(model, PROMPTS, 16, eos=1)
    eos = reference[0][3]
    reference = _reference(model, PROMPTS, 16, eos=eos)
    generator = StaticCacheGenerator(model, check_every=4)
    never = list(range(200, 260))  # beyond the 128-token vocabulary
    ours = generator.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=0), [eos, *never], 0)
    assert ours == reference


def test_filters_match_transformers_warpers():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)
    expected = logits.clone()
    for warper in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        expected = warper(None, expected)
    ours = filter_logits(logits, params)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    assert torch.allclose(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


def test_sampling_follows_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 12) * 2
    params = SamplingParams(max_new_tokens=1, temperature=0.8, top_k=8, top_p=0.95, min_p=0.02)
    expected = filter_logits(logits, params).softmax(-1)[0]
    draws = sample_tokens(logits.expand(20000, -1), params)
    observed = torch.bincount(draws, minlength=12).float() / draws.numel()
    assert (observed - expected).abs().sum() / 2 < 0.02  # total variation distance
    assert observed[expected == 0].sum() == 0  # filtered tokens are never drawn


def test_sampled_rollouts_have_the_model_distribution():
    """First token of sampled rollouts vs the model's own next-token distribution."""
    model = _models()["fp32"].eval()
    prompt = [5, 6, 7]
    with torch.no_grad():
        probs = model(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float().softmax(-1).cpu()
    generator = StaticCacheGenerator(model, cuda_graph=False)
    torch.manual_seed(1)
    rows = generator.generate([prompt] * 4000, SamplingParams(max_new_tokens=1, temperature=1.0), [1], 0)
    observed = torch.bincount(torch.tensor([r[0] for r in rows]), minlength=probs.numel()).float() / len(rows)
    assert (observed - probs).abs().sum() / 2 < 0.08


def test_generation_sees_aqn_noise_and_its_removal():
    model = _models()["nvfp4"].eval()
    generator = StaticCacheGenerator(model)  # CUDA-graphed on CUDA
    noise = NormNoise(model, seed=0)
    params = SamplingParams(max_new_tokens=12, temperature=0)
    clean = generator.generate(PROMPTS, params, [1], 0)
    outputs = []
    for draw in range(2):
        noise.set_step(draw, 0.3)
        with noise.rollout():
            outputs.append(generator.generate(PROMPTS, params, [1], 0))
    assert outputs[0] != clean and outputs[0] != outputs[1]  # every replay sees the current noise
    assert generator.generate(PROMPTS, params, [1], 0) == clean
    assert generator.captures == (1 if torch.cuda.is_available() else 0)  # captured once, replayed since


def test_moved_parameters_are_captured_again(caplog):
    model = _models()["nvfp4+lora"].eval()
    generator = StaticCacheGenerator(model)  # CUDA-graphed on CUDA
    params = SamplingParams(max_new_tokens=8, temperature=0)
    before = generator.generate(PROMPTS, params, [1], 0)
    state = next(iter(generator._states.values()))
    assert generator.generate(PROMPTS, params, [1], 0) == before
    assert next(iter(generator._states.values())) is state  # unchanged storage: the same captured step
    lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
    with torch.no_grad():
        lora_b.data = lora_b.data * 0  # new storage, and a different adapter
    with caplog.at_level(logging.INFO, logger="trl_qerl.rollout.fast"):
        after = generator.generate(PROMPTS, params, [1], 0)
    assert "capturing again" in caplog.text
    assert next(iter(generator._states.values())) is not state
    generator_fresh = StaticCacheGenerator(model, cuda_graph=False)
    assert after == generator_fresh.generate(PROMPTS, params, [1], 0)  # the replay reads the new adapter
    assert generator.captures == (2 if torch.cuda.is_available() else 0)


def test_bad_sampling_parameters():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=4, top_p=0.0)
    with pytest.raises(ValueError, match="no empty prompt"):
        StaticCacheGenerator(tiny_model()).generate([[]], SamplingParams(max_new_tokens=2), [1], 0)


# -- in the trainer ------------------------------------------------------------------------------------------
def _trainer(tmp_path, backend, **overrides):
    from trl_qerl.config import QeRLConfig
    from trl_qerl.data import tiny_arithmetic_dataset
    from trl_qerl.rewards import completion_text
    from trl_qerl.trainer import QeRLGRPOTrainer

    def varied(completions, **kwargs):
        return [len(set(completion_text(c))) / 10 for c in completions]

    checkpoint = tiny_chat_checkpoint(tmp_path / "tiny")
    args = QeRLConfig(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, report_to="none", lora_r=4, save_strategy="no", use_cpu=True,
                      rollout_backend=backend, top_k=10, top_p=0.9, gradient_checkpointing=False,
                      **overrides)  # fmt: skip
    return QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied, args=args,
                           train_dataset=tiny_arithmetic_dataset("train", limit=8))  # fmt: skip


def test_trainer_trains_with_the_fast_backend(tmp_path):
    trainer = _trainer(tmp_path, "fast")
    assert trainer.rollout_backend.name == "fast"
    trainer.train()
    assert trainer.rollout_backend.disabled_reason is None
    assert trainer.state.log_history[0]["completions/max_length"] <= 8


def test_padding_to_a_multiple_trains_as_without_it(tmp_path):
    """`pad_to_multiple_of="auto"` is 64 on CUDA: completions (and the rollout's own log-probs, which importance
    sampling reads) are padded past the longest completion. Same seed, same rollouts: the losses must not change."""
    runs = {}
    for pad in (None, 16):
        trainer = _trainer(tmp_path / str(pad), "fast", pad_to_multiple_of=pad, rollout_importance_sampling=True,
                           logging_steps=1)  # fmt: skip
        trainer.train()
        assert trainer.rollout_backend.disabled_reason is None
        keys = ("loss", "entropy", "sampling/sampling_logp_difference/mean")  # the last reads the rollout's log-probs
        runs[pad] = [[row[key] for key in keys] for row in trainer.state.log_history if "loss" in row]
    assert len(runs[16]) == 2 and all(math.isfinite(value) for row in runs[16] for value in row)
    for (loss, *padded), (plain_loss, *plain) in zip(runs[16], runs[None]):
        assert padded == pytest.approx(plain, rel=1e-4, abs=0)
        # GRPO's loss is zero up to rounding here (one pass per rollout: ratio 1, and a group's advantages sum to
        # zero): ~1e-13 whose last digits depend on the padded shapes' summation order (seen on a 16-core host)
        assert loss == pytest.approx(plain_loss, abs=1e-11)


def test_fast_backend_falls_back_to_generate_with_a_log(tmp_path, monkeypatch, caplog):
    trainer = _trainer(tmp_path, "fast")

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    monkeypatch.setattr(StaticCacheGenerator, "sample", broken)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout"):
        trainer.train()
    assert "inductor exploded" in trainer.rollout_backend.disabled_reason
    assert any("falling back to transformers generate" in r.message for r in caplog.records)


def test_auto_backend_is_transformers_when_training_on_cpu(tmp_path):
    assert _trainer(tmp_path, "auto").rollout_backend.name == "transformers"  # the trainer uses use_cpu=True


def test_buffers_are_built_once_per_shape_and_reused():
    model = _models()["fp32"].eval()
    generator = StaticCacheGenerator(model, cuda_graph=False)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    generator.generate(PROMPTS, params, [1], 0)
    state = next(iter(generator._states.values()))
    for _ in range(3):
        generator.generate(PROMPTS, params, [1], 0)
    assert list(generator._states.values()) == [state]  # same buffers (and on CUDA the same captured graph)
    generator.generate([[5] * 300], params, [1], 0)  # a longer prompt needs a bigger cache: one new shape
    assert next(iter(generator._states.values())) is not state


def test_repeated_prompts_are_prefilled_once_and_decode_as_alone():
    """GRPO's completions of one prompt: each distinct prompt is prefilled once (bucket-filling rows too: batch 8
    for 6 rows) and every row decodes exactly as without sharing."""
    model = _models()["nvfp4+lora"].eval()
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 2 + [PROMPTS[2]]
    params = SamplingParams(max_new_tokens=10, temperature=0)
    shared = StaticCacheGenerator(model, batch_bucket=8, check_every=4)
    alone = StaticCacheGenerator(model, batch_bucket=8, check_every=4, share_prefill=False)
    ours = shared.generate(prompts, params, [1], 0)
    assert shared.prefilled_rows == 3 and alone.generate(prompts, params, [1], 0) == ours
    assert alone.prefilled_rows == 8
    assert ours == _reference(model, prompts, 10, eos=1)


def test_rows_of_a_shared_prefill_draw_their_own_tokens():
    model = _models()["fp32"].eval()
    generator = StaticCacheGenerator(model, check_every=4)
    torch.manual_seed(0)
    rows = generator.generate([PROMPTS[0]] * 8, SamplingParams(max_new_tokens=8, temperature=1.0), [1], 0)
    assert generator.prefilled_rows == 1
    assert len({tuple(row) for row in rows}) > 1  # one prefill, eight independent draws


def test_the_model_engine_prefills_every_row():
    model = _models()["fp32"].eval()
    generator = StaticCacheGenerator(model, engine="model", cuda_graph=False)
    generator.generate([PROMPTS[0]] * 4, SamplingParams(max_new_tokens=2, temperature=0), [1], 0)
    assert not generator.share_prefill and generator.prefilled_rows == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_prefills_replay_what_eager_prefills_compute():
    """A prefill shape runs eagerly once, then replays its CUDA graph: the replay computes what a fresh generator's
    eager prefill computes (same shapes, same kernels: bit for bit), sees the current AQN draw, and serves every
    prompt length of its bucket."""
    from trl_qerl.rollout import fast

    model = tiny_nvfp4_lora_model(torch.bfloat16, "cuda")
    noise = NormNoise(model, seed=0)
    params = SamplingParams(max_new_tokens=8, temperature=0)

    def generator():
        return StaticCacheGenerator(model, compile=False, check_every=4)

    captured = generator()
    prompts = [PROMPTS[0]] * 4 + [PROMPTS[2]] * 4
    captured.sample(prompts, params, [1], 0)
    assert captured.prefill_captures == 1 and captured.prefilled_rows == 2
    for draw, batch in enumerate((prompts, [[5, 6, 7]] * 4 + [[9, 10, 11, 12]] * 4)):
        noise.set_step(draw, 0.3)
        with noise.rollout():
            replayed, eager = captured.sample(batch, params, [1], 0), generator().sample(batch, params, [1], 0)
        assert replayed.completion_ids == eager.completion_ids
        assert replayed.logprobs == eager.logprobs
    assert captured.prefill_captures == 1  # prompts of 3-9 tokens share the 64-token bucket
    assert fast.PREFILL_LENGTH_BUCKET == 64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefills_past_the_token_limit_stay_eager(monkeypatch):
    from trl_qerl.rollout import fast

    monkeypatch.setattr(fast, "PREFILL_GRAPH_TOKENS", 64)
    model = tiny_nvfp4_lora_model(torch.bfloat16, "cuda")
    generator = StaticCacheGenerator(model, compile=False)
    generator.sample([PROMPTS[0], PROMPTS[1]], SamplingParams(max_new_tokens=4, temperature=0), [1], 0)
    assert generator.prefill_captures == 0  # 2 rows x 64 tokens
    generator.sample([PROMPTS[0]] * 2, SamplingParams(max_new_tokens=4, temperature=0), [1], 0)
    assert generator.prefill_captures == 1  # one distinct prompt: 64 tokens
