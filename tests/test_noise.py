"""Adaptive Quantization Noise: schedules, norm discovery, exact restore, seeding, and the Trainer callback."""

import math
import warnings

import pytest
import torch
from _tiny import random_tokens, tiny_model
from datasets import Dataset
from torch import nn
from transformers import GemmaConfig, GemmaForCausalLM, MistralConfig, MistralForCausalLM, Trainer, TrainingArguments

from trl_qerl.lora import get_peft_model, nvfp4_lora_config
from trl_qerl.noise import AQNCallback, NoiseSchedule, NormNoise, find_noise_norms
from trl_qerl.quantizer import quantize_model


# -- schedules ------------------------------------------------------------------------------------------------
def test_default_schedule_reproduces_the_reference_values():
    """σ_start 1e-2, σ_end 1e-4, K=10: stage 0 silent, then 1e-2 * (1e-2) ** ((k - 1) / 8)."""
    schedule = NoiseSchedule()
    expected = [0.0] + [1e-2 * (1e-4 / 1e-2) ** ((k - 1) / 8) for k in range(1, 10)]
    assert [schedule.sigma_at_stage(k) for k in range(10)] == pytest.approx(expected, rel=1e-12)
    assert schedule.sigma_at_stage(1) == pytest.approx(1e-2) and schedule.sigma_at_stage(9) == pytest.approx(1e-4)
    assert schedule.sigma_at_stage(5) == pytest.approx(1e-3)


def _reference_sigma(step, total_steps, start=1e-2, end=1e-4, num_stages=10):
    """NVlabs/QeRL `trl_trainer/noise_scheduler.py`, transcribed: float stage interval, exponent over K-2."""
    stage = int(step // (total_steps / num_stages))
    if stage == 0:
        return 0.0
    return start * (end / start) ** ((stage - 1) / (num_stages - 2))


def test_stages_evenly_divide_the_training_steps():
    schedule = NoiseSchedule()
    assert [schedule.stage(step, 100) for step in (0, 9, 10, 55, 99, 100, 250)] == [0, 0, 1, 5, 9, 9, 9]
    assert [schedule.stage(step, 7) for step in range(7)] == [0, 1, 2, 4, 5, 7, 8]  # fewer steps than stages
    assert schedule.sigma(0, 100) == 0.0 and schedule.sigma(10, 100) == pytest.approx(1e-2)


@pytest.mark.parametrize("total_steps", [5, 7, 19, 25, 37, 100, 101])
def test_schedule_matches_the_reference_arithmetic_at_every_step(total_steps):
    schedule = NoiseSchedule()
    ours = [schedule.sigma(step, total_steps) for step in range(total_steps)]
    assert ours == pytest.approx([_reference_sigma(step, total_steps) for step in range(total_steps)], rel=1e-12)
    stages = [schedule.stage(step, total_steps) for step in range(total_steps)]
    assert stages == sorted(stages) and stages[0] == 0
    if total_steps >= 10:  # every stage is visited and the last step reaches sigma_end
        assert set(stages) == set(range(10)) and ours[-1] == pytest.approx(1e-4)


def test_fewer_steps_than_stages_skip_stages_as_the_reference_does():
    schedule = NoiseSchedule()
    assert [schedule.stage(step, 5) for step in range(5)] == [0, 2, 4, 6, 8]  # sigma_end (stage 9) not reached
    assert schedule.sigma(4, 5) > schedule.sigma_end


def test_two_stages_are_half_noise_free_half_at_sigma_start():
    schedule = NoiseSchedule(num_stages=2)
    assert [schedule.sigma(step, 19) for step in range(19)] == [0.0] * 10 + [1e-2] * 9  # 19 // 9.5: stage 1 from 10
    assert [schedule.stage(step, 4) for step in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("kind", ["exponential", "linear", "cosine", "logarithmic"])
def test_decaying_schedules_run_from_start_to_end_monotonically(kind):
    schedule = NoiseSchedule(sigma_start=5e-2, sigma_end=5e-4, schedule=kind)
    sigmas = [schedule.sigma_at_stage(k) for k in range(1, 10)]
    assert sigmas[0] == pytest.approx(5e-2) and sigmas[-1] == pytest.approx(5e-4)
    assert all(a > b for a, b in zip(sigmas, sigmas[1:]))


def test_schedule_shapes_differ_as_documented():
    middle = {
        kind: NoiseSchedule(schedule=kind).sigma_at_stage(5)
        for kind in ("exponential", "linear", "cosine", "logarithmic")
    }
    assert middle["exponential"] == pytest.approx(1e-3)
    assert middle["linear"] == pytest.approx((1e-2 + 1e-4) / 2)
    assert middle["cosine"] == pytest.approx((1e-2 + 1e-4) / 2)  # cosine crosses the midpoint halfway
    assert middle["logarithmic"] < middle["linear"]
    assert NoiseSchedule(schedule="cosine").sigma_at_stage(2) > NoiseSchedule(schedule="linear").sigma_at_stage(2)


def test_constant_off_and_two_stage_schedules():
    assert [NoiseSchedule(schedule="constant").sigma_at_stage(k) for k in (0, 1, 9)] == [0.0, 1e-2, 1e-2]
    assert all(NoiseSchedule(schedule="off").sigma_at_stage(k) == 0 for k in range(10))
    assert NoiseSchedule(num_stages=2).sigma_at_stage(1) == 1e-2  # no division by K - 2 = 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"schedule": "square"}, "Unknown AQN schedule"),
        ({"num_stages": 1}, "num_stages >= 2"),
        ({"sigma_start": 0.0}, "must be positive finite"),
    ],
)
def test_bad_schedules_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NoiseSchedule(**kwargs)
    with pytest.raises(ValueError, match="total number of training steps"):
        NoiseSchedule().stage(3, 0)


# -- finding the norms ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_finds_the_norms_feeding_attention_and_mlp(arch):
    names = sorted(find_noise_norms(tiny_model(arch)))
    assert names == [f"model.layers.{i}.{n}" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")]


def test_finds_norms_by_structure_in_other_architectures():
    mistral = MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, num_key_value_heads=2))  # fmt: skip
    assert len(find_noise_norms(mistral)) == 4
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))  # fmt: skip
    norms = find_noise_norms(gemma)
    assert len(norms) == 4
    # Gemma's RMSNorm computes x * (1 + w): noise on w is the same multiplicative noise
    layer_norm = norms["model.layers.0.input_layernorm"]
    noise = NormNoise(gemma, seed=0)
    x = torch.randn(1, 3, 32)
    clean = layer_norm(x)
    noise.perturb(0.1)
    assert not torch.allclose(layer_norm(x), clean)
    noise.restore()
    assert torch.equal(layer_norm(x), clean)


def test_unknown_architecture_gets_an_error_listing_what_was_found():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_attn = nn.RMSNorm(16)
            self.proj = nn.Linear(16, 16)

    model = nn.Sequential(Block(), Block())
    with pytest.raises(ValueError, match=r"RMSNorm-like modules present: \['0.ln_attn', '1.ln_attn'\]"):
        find_noise_norms(model)
    assert len(find_noise_norms(model, targets=["ln_attn"])) == 2


# -- perturb / restore ----------------------------------------------------------------------------------------
def test_restore_is_bit_exact_after_1000_cycles():
    model = tiny_model("qwen2")
    noise = NormNoise(model, seed=3)
    clean = [w.clone() for w in noise._current_weights()]
    for cycle in range(1000):
        noise.set_step(cycle, 0.05)
        noise.perturb()
        noise.restore()
    assert all(torch.equal(a, b) for a, b in zip(clean, noise._current_weights()))


def test_noise_is_resampled_not_accumulated_and_has_the_right_scale():
    model = tiny_model("llama", dtype=torch.float32)
    noise = NormNoise(model, seed=0)
    clean = torch.cat([w.clone() for w in noise._current_weights()])
    noise.perturb(0.05)
    first = torch.cat([w.clone() for w in noise._current_weights()]) - clean
    noise.perturb(0.05)  # a second draw replaces the first
    second = torch.cat([w.clone() for w in noise._current_weights()]) - clean
    assert not torch.equal(first, second)
    assert second.std().item() == pytest.approx(0.05, rel=0.15)
    assert (second - first).abs().max() < 1.0  # not first + second
    noise.restore()


def test_noise_is_seeded_and_reproducible():
    draws = []
    for _ in range(2):
        noise = NormNoise(tiny_model("qwen2"), seed=7)
        noise.set_step(4, 0.02)
        noise.perturb()
        draws.append(torch.cat([w.clone() for w in noise._current_weights()]))
        noise.restore()
    assert torch.equal(*draws)
    other = NormNoise(tiny_model("qwen2"), seed=8)
    other.set_step(4, 0.02)
    other.perturb()
    assert not torch.equal(draws[0], torch.cat(list(other._current_weights())))


def test_rollout_context_changes_the_output_and_restores_it():
    model = tiny_model("qwen2")
    tokens = random_tokens()
    noise = NormNoise(model)
    with torch.no_grad():
        clean = model(tokens).logits
        with noise.rollout(0.05):
            noisy = model(tokens).logits
        assert not torch.equal(clean, noisy)
        assert torch.equal(model(tokens).logits, clean)
        with noise.rollout(0.0):
            assert torch.equal(model(tokens).logits, clean)


def test_noise_goes_on_top_of_trained_norms(tmp_path):
    model = get_peft_model(quantize_model(tiny_model("qwen2")), nvfp4_lora_config(r=4))
    noise = NormNoise(model)
    trained = model.base_model.model.model.layers[0].input_layernorm.modules_to_save["default"]
    original = model.base_model.model.model.layers[0].input_layernorm.original_module
    with torch.no_grad():
        trained.weight.add_(0.5)
    before_trained, before_original = trained.weight.clone(), original.weight.clone()
    noise.perturb(0.01)
    assert not torch.equal(trained.weight, before_trained) and torch.equal(original.weight, before_original)
    assert (trained.weight - before_trained).abs().max() < 0.1
    noise.restore()
    assert torch.equal(trained.weight, before_trained)


# -- the callback with a plain transformers Trainer -----------------------------------------------------------
class _RecordNormInputs(nn.Module):
    """Wraps a model and records the first norm weight it sees in each training forward."""

    def __init__(self, model, norm):
        super().__init__()
        self.model, self.seen = model, []
        self._norm = [norm]  # a list, so the norm is not registered twice

    def forward(self, input_ids=None, labels=None, **kwargs):
        self.seen.append(self._norm[0].weight.detach().clone())
        return self.model(input_ids=input_ids, labels=labels)


def _trainer(tmp_path, model, callback, max_steps=6, learning_rate=1e-3):
    tokens = random_tokens(batch=8, length=10)
    dataset = Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=2,
        learning_rate=learning_rate, report_to="none", use_cpu=True, logging_steps=1, save_strategy="steps",
        save_steps=3, seed=0,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=dataset, callbacks=[callback])


def test_callback_logs_sigma_and_stage_with_any_trainer(tmp_path):
    callback = AQNCallback(NoiseSchedule(num_stages=3, sigma_start=1e-2, sigma_end=1e-3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _trainer(tmp_path, tiny_model("qwen2", dtype=torch.float32), callback)
        trainer.train()
    logged = [
        (entry["step"], entry["aqn/stage"], entry["aqn/sigma"])
        for entry in trainer.state.log_history
        if "aqn/sigma" in entry and "loss" in entry
    ]
    # steps 1..6 are logged after their optimizer step; the stage is that of the step that just ran
    assert [stage for _, stage, _ in logged] == [0, 0, 1, 1, 2, 2]
    assert [sigma for *_, sigma in logged] == pytest.approx([0, 0, 1e-2, 1e-2, 1e-3, 1e-3])


def test_default_callback_keeps_noise_out_of_the_loss_forward(tmp_path):
    model = tiny_model("qwen2", dtype=torch.float32)
    norm = model.model.layers[0].input_layernorm
    wrapped = _RecordNormInputs(model, norm)
    callback = AQNCallback(NoiseSchedule(num_stages=2, schedule="constant", sigma_start=0.05))
    callback.attach(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, wrapped, callback, max_steps=4, learning_rate=0.0).train()
    assert all(torch.equal(seen, wrapped.seen[0]) for seen in wrapped.seen)


def test_apply_to_training_perturbs_the_loss_forward_and_restores_before_the_update(tmp_path):
    model = tiny_model("qwen2", dtype=torch.float32)
    norm = model.model.layers[0].input_layernorm
    clean = norm.weight.detach().clone()
    wrapped = _RecordNormInputs(model, norm)
    callback = AQNCallback(NoiseSchedule(num_stages=2, schedule="constant", sigma_start=0.05), apply_to_training=True)
    callback.attach(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _trainer(tmp_path, wrapped, callback, max_steps=4, learning_rate=0.0).train()
    stage_one = wrapped.seen[2:]  # steps 2 and 3 of 4 are in stage 1
    assert all(not torch.equal(seen, clean) for seen in stage_one)
    assert torch.equal(norm.weight, clean)  # lr 0: the clean weight survives every perturb/restore


def test_resume_continues_the_schedule(tmp_path):
    schedule = NoiseSchedule(num_stages=3, sigma_start=1e-2, sigma_end=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _trainer(tmp_path, tiny_model("qwen2", dtype=torch.float32), AQNCallback(schedule))
        first.train()
        resumed_callback = AQNCallback(schedule)
        resumed = _trainer(tmp_path, tiny_model("qwen2", dtype=torch.float32), resumed_callback)
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    entries = [e for e in resumed.state.log_history if "aqn/sigma" in e and "loss" in e and e["step"] > 3]
    assert [e["aqn/stage"] for e in entries] == [1, 2, 2]  # not back to stage 0
    assert resumed_callback.noise.step == 5 and math.isclose(resumed_callback.sigma, 1e-3)
