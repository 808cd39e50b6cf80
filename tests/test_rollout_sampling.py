"""What the rollout reports about the policy that sampled: per-token log-probabilities and entropy (with AQN noise),
and the importance-sampling switch that uses them, with one meaning on every backend."""

import logging

import pytest
import torch
from _tiny import tiny_chat_checkpoint, tiny_model

from trl_qerl.config import QeRLConfig
from trl_qerl.data import tiny_arithmetic_dataset
from trl_qerl.rewards import completion_text
from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator, filter_logits, sample_with_stats
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
