"""What the rollout reports about the policy that sampled: per-token log-probabilities and entropy (with AQN noise),
and the importance-sampling switch that uses them, with one meaning on every backend."""

import logging

import pytest
import torch
from _tiny import tiny_chat_checkpoint, tiny_model

from trl_qerl.config import QeRLConfig
from trl_qerl.data import tiny_arithmetic_dataset
from trl_qerl.rewards import completion_text
from trl_qerl.rollout import fast
from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator, filter_logits, record_step, sample_with_stats
from trl_qerl.rollout.sampling import draw_with_stats, uniform_draws
from trl_qerl.trainer import QeRLGRPOTrainer


pytestmark = pytest.mark.usefixtures("quiet_warnings")


def test_sample_with_stats_reports_the_filtered_distribution():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=20, top_p=0.9)
    torch.manual_seed(0)
    tokens, logprob, entropy = sample_with_stats(logits, params)
    log_probs = filter_logits(logits, params).log_softmax(-1)
    assert torch.allclose(logprob, log_probs.gather(-1, tokens[:, None])[:, 0])
    probs = log_probs.exp()
    expected = -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)
    assert torch.allclose(entropy, expected, atol=1e-5) and bool((entropy >= 0).all()) and bool((entropy > 0).any())
    assert bool(torch.isfinite(logprob).all())  # sampled tokens are never filtered out
    greedy = sample_with_stats(logits, SamplingParams(max_new_tokens=1, temperature=0))
    assert torch.equal(greedy[0], logits.argmax(-1)) and not greedy[1].any() and not greedy[2].any()


def test_a_draw_from_given_uniforms_is_the_seeded_sample():
    """`draw_with_stats` of `uniform_draws` takes the same random numbers as the Gumbel draw always took
    (``rand_like`` of the filtered fp32 logits), so compiling the draw leaves seeded samples unchanged."""
    logits = torch.randn(5, 70, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    params = SamplingParams(max_new_tokens=1, temperature=0.8, top_p=0.95)
    torch.manual_seed(7)
    expected_uniform = torch.rand_like(filter_logits(logits, params))
    torch.manual_seed(7)
    uniform = uniform_draws(logits, params)
    assert uniform.dtype == torch.float32 and torch.equal(uniform, expected_uniform)
    torch.manual_seed(7)
    sampled = sample_with_stats(logits, params)
    for ours, theirs in zip(draw_with_stats(logits, uniform, params), sampled):
        assert torch.equal(ours, theirs)
    assert uniform_draws(logits, SamplingParams(max_new_tokens=1, temperature=0)) is None
    with pytest.raises(ValueError, match="uniform_draws"):
        draw_with_stats(logits, None, params)


@pytest.mark.parametrize("width", [100, 65536, 152064, 70001])
def test_argmax_in_groups_is_torch_argmax(width):
    """`argmax_rows` (groups of columns, then the groups' maxima) picks what `torch.argmax` picks, the first maximal
    index included: ties inside a group and across groups, -inf entries, widths that do not fill the last group."""
    from trl_qerl.rollout.sampling import argmax_rows

    generator = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=generator)
    x[1] = 0.5  # all equal: index 0
    x[2, -1] = x[2, width // 2] = 9.0  # the same maximum in two groups
    x[3, : width // 2] = float("-inf")
    x[4, 5] = x[4, 6] = 9.0  # a tie inside one group
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(argmax_rows(x.to(dtype)), x.to(dtype).argmax(-1))


def _step_buffers(batch=3, steps=4):
    return [torch.zeros(batch, dtype=torch.long), torch.full((batch,), 5), torch.tensor([7]), torch.tensor([1]),
            torch.tensor([False, True, False]), torch.zeros(batch, steps, dtype=torch.long),
            torch.zeros(batch, steps), torch.zeros(batch, steps)]  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_step_record_traces_whole_and_updates_the_buffers_in_place(temperature):
    """`record_step` as ``torch.compile(fullgraph=True)`` traces it (AOT functionalisation of the in-place updates,
    checked with the ``aot_eager`` backend; inductor runs it in the CUDA tests): the same buffers as eagerly."""
    params = SamplingParams(max_new_tokens=4, temperature=temperature, top_k=20)
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[0, 1] = 50.0  # row 0 draws EOS; row 1 was finished already and gets padding
    uniform, eos = uniform_draws(logits, params), torch.tensor([1, 2])
    eager, traced = _step_buffers(), _step_buffers()
    record_step(logits, uniform, params, 0, eos, *eager)
    torch.compile(record_step, fullgraph=True, backend="aot_eager")(logits, uniform, params, 0, eos, *traced)
    for ours, theirs in zip(traced, eager):
        assert torch.equal(ours, theirs)
    tokens, positions, cache_position, step_index, finished, out = eager[:6]
    assert tokens.tolist()[:2] == [1, 0] and finished.tolist() == [True, True, False]
    assert out[:, 1].tolist() == tokens.tolist() and not out[:, [0, 2, 3]].any()
    assert positions.tolist() == [6, 6, 6] and cache_position.item() == 8 and step_index.item() == 2


def test_a_failing_compiled_record_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    """The decode step's compiled sampling (used where the fused decoder runs compiled) must never stop a rollout."""

    def broken(*args):
        raise RuntimeError("inductor exploded")

    record = fast._CompiledRecord()
    record._compiled = broken
    monkeypatch.setattr(fast, "_RECORD", record)
    model = tiny_model("qwen2", dtype=torch.float32)
    generator = StaticCacheGenerator(model, cuda_graph=False, engine="fused", compile=False)
    params = SamplingParams(max_new_tokens=5, temperature=0)
    expected = generator.sample([[5, 6, 7]], params, [1], 0)
    monkeypatch.setattr(fast.FusedDecoder, "compiled", property(lambda self: True))  # layers stay eager (fast)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.fast"):
        ours = generator.sample([[5, 6, 7]], params, [1], 0)
        again = generator.sample([[5, 6, 7]], params, [1], 0)
    assert ours.completion_ids == again.completion_ids == expected.completion_ids
    warnings = [r for r in caplog.records if "sampling failed" in r.message]
    assert len(warnings) == 1 and "inductor exploded" in warnings[0].message and record.compiled is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_sampling_draws_what_the_eager_step_draws_on_cuda():
    """Captured steps with the compiled ends and sampling (inductor) against eager ones, seeded alike at temperature 1:
    the same uniform numbers, so the same first tokens but where bf16 sums in another order flip a near-tie."""
    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model

    model = quantize_model(tiny_model("qwen2", dtype=torch.bfloat16).cuda())
    model = get_peft_model(model, nvfp4_lora_config(model, r=4)).eval()
    prompts = torch.randint(3, 100, (8, 12), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    samples = []
    for compile in (True, False):
        generator = StaticCacheGenerator(model, engine="fused", compile=compile, capture_prefill=False)
        generator.sample(prompts, params, [1], 0)  # capture first, so both draw from the same generator state
        torch.manual_seed(11)
        samples.append(generator.sample(prompts, params, [1], 0))
    (ours, theirs) = samples
    first = [a[0] == b[0] for a, b in zip(ours.completion_ids, theirs.completion_ids)]
    assert sum(first) >= 7
    agreeing = [row for row, same in enumerate(first) if same]
    gaps = [abs(ours.logprobs[row][0] - theirs.logprobs[row][0]) for row in agreeing]
    assert max(gaps) < 0.05 and all(len(row) == 6 for row in ours.completion_ids)


def test_generator_logprobs_are_the_models_own_scores_of_its_samples():
    """Teacher-forced recomputation of each sampled token's log-probability gives the logged value."""
    model = tiny_model("qwen2", dtype=torch.float32)
    generator = StaticCacheGenerator(model, cuda_graph=False)
    prompts = [[5, 6, 7, 8], [9, 10]]
    torch.manual_seed(3)
    samples = generator.sample(prompts, SamplingParams(max_new_tokens=6, temperature=1.0), [1], 0)
    for prompt, ids, logprobs, entropies in zip(prompts, *samples):
        assert len(ids) == len(logprobs) == len(entropies) > 0
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        log_probs = logits.log_softmax(-1)
        assert torch.allclose(
            torch.tensor(logprobs), log_probs.gather(-1, torch.tensor(ids)[:, None])[:, 0], atol=1e-4
        )
        assert torch.allclose(torch.tensor(entropies), -(log_probs.exp() * log_probs).sum(-1), atol=1e-4)


def _varied(completions, **kwargs):
    return [len(set(completion_text(c))) / 10 for c in completions]


def _trainer(tmp_path, backend, **overrides):
    checkpoint = tiny_chat_checkpoint(tmp_path / "tiny")
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, report_to="none", lora_r=4, save_strategy="no", use_cpu=True,
                    rollout_backend=backend, gradient_checkpointing=False, logging_steps=1, aqn_num_stages=2,
                    aqn_schedule="constant", aqn_sigma_start=0.05)  # fmt: skip
    settings.update(overrides)
    return QeRLGRPOTrainer(str(checkpoint), reward_funcs=_varied, args=QeRLConfig(**settings),
                           train_dataset=tiny_arithmetic_dataset("train", limit=8))  # fmt: skip


@pytest.mark.parametrize("backend", ["fast", "transformers"])
def test_rollout_side_entropy_is_logged_beside_trls_clean_entropy(tmp_path, backend):
    trainer = _trainer(tmp_path, backend)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["rollout/sampling_entropy"] > 0 and "entropy" in entry for entry in logs)
    assert all("sampling/importance_sampling_ratio/mean" not in entry for entry in logs)  # off by default


def test_importance_sampling_is_off_by_default_on_every_backend_including_vllm():
    assert QeRLConfig(output_dir="x", use_cpu=True).vllm_importance_sampling_correction is False
    assert QeRLConfig(
        output_dir="x", use_cpu=True, rollout_importance_sampling=True
    ).vllm_importance_sampling_correction


def test_importance_sampling_on_the_fast_backend_uses_its_logprobs(tmp_path):
    trainer = _trainer(
        tmp_path, "fast", rollout_importance_sampling=True, vllm_importance_sampling_mode="token_truncate"
    )
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    for entry in logs:
        assert 0.0 <= entry["sampling/is_corrected_share"] <= 1.0
        assert entry["sampling/importance_sampling_ratio/mean"] > 0
        # the rollout sampled with noise (sigma 0.05) and the loss scores the clean policy: they differ
        assert entry["sampling/sampling_logp_difference/mean"] > 0


def test_importance_sampling_without_sampling_logprobs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs the sampling log-probs"):
        _trainer(tmp_path, "transformers", rollout_importance_sampling=True)


def test_fast_fallback_with_importance_sampling_marks_logprobs_unscored(tmp_path, caplog):
    trainer = _trainer(tmp_path, "fast", rollout_importance_sampling=True, repetition_penalty=1.1)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout"):
        trainer.train()  # TRL's generate path cannot score its samples: ratio 1 (NaN log-probs), one warning
    assert sum("fast rollouts unavailable" in r.message for r in caplog.records) == 1
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert all(entry["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0) for entry in logs)
