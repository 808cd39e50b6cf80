"""Defects found in review of the trainer (issue 11), each pinned by a test that failed before the fix."""

import asyncio
import inspect
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from _tiny import free_port, random_tokens, tiny_chat_checkpoint, tiny_model
from datasets import Dataset
from peft import LoraConfig
from peft import get_peft_model as peft_get_peft_model
from transformers import Trainer, TrainingArguments

from trl_qerl.config import QeRLConfig
from trl_qerl.data import tiny_arithmetic_dataset
from trl_qerl.loading import load_policy
from trl_qerl.noise import AQNCallback, NoiseSchedule, NormNoise
from trl_qerl.nvfp4.linear import NVFP4A16Linear
from trl_qerl.rewards import completion_text
from trl_qerl.rollout.fast import FastRollout, _unsupported
from trl_qerl.trainer import QeRLGRPOTrainer, _guard_reward, _refuse_sharded_parameters


pytestmark = pytest.mark.usefixtures("quiet_warnings")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


def _varied(completions, **kwargs):
    return [len(set(completion_text(c))) / 10 for c in completions]


def _args(tmp_path, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=8, report_to="none", lora_r=4, save_strategy="no", use_cpu=True,
                    gradient_checkpointing=False, logging_steps=1, aqn_num_stages=2)  # fmt: skip
    settings.update(overrides)
    return QeRLConfig(**settings)


# -- reward functions -----------------------------------------------------------------------------------------
def test_reward_guard_keeps_async_functions_async_and_reward_models_as_models():
    async def async_reward(completions, **kwargs):
        return [1.0] * len(completions)

    class Scorer:
        async def __call__(self, completions, **kwargs):
            raise KeyError("boom")

    guarded = _guard_reward(async_reward)
    assert inspect.iscoroutinefunction(guarded) and guarded.__name__ == "async_reward"
    assert asyncio.run(guarded(["a", "b"])) == [1.0, 1.0]
    with pytest.raises(RuntimeError, match="'Scorer' raised KeyError"):
        asyncio.run(_guard_reward(Scorer())(["a"]))
    reward_model = torch.nn.Linear(2, 1)
    assert _guard_reward(reward_model) is reward_model and _guard_reward("some/reward-model") == "some/reward-model"


def test_async_reward_functions_train(checkpoint, tmp_path):
    async def async_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return _varied(completions)

    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=[async_reward], args=_args(tmp_path),
                              train_dataset=tiny_arithmetic_dataset("train", limit=8))  # fmt: skip
    trainer.train()
    assert all("rewards/async_reward/mean" in e for e in trainer.state.log_history if "loss" in e)


# -- a 16-bit PeftModel passed for NVFP4 ----------------------------------------------------------------------
def test_peft_model_keeps_its_adapters_when_the_base_is_quantised(tmp_path):
    model = peft_get_peft_model(tiny_model("qwen2"), LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                               modules_to_save=["lm_head"]))  # fmt: skip
    trainable = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    model = load_policy(model, _args(tmp_path, quantization="nvfp4"))
    assert {n: p.shape for n, p in model.named_parameters() if p.requires_grad} == trainable
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj.base_layer, NVFP4A16Linear)  # the base layer is quantised
    assert type(layer.self_attn.q_proj.lora_A["default"]) is torch.nn.Linear  # its adapter is not
    assert type(model.base_model.model.lm_head.modules_to_save["default"]) is torch.nn.Linear
    assert model.get_base_model().is_quantized


# -- the fast backend ---------------------------------------------------------------------------------------
def _fake_trainer(attention: str):
    args = SimpleNamespace(generation_kwargs=None, repetition_penalty=1.0)
    return SimpleNamespace(args=args, tools=None, use_vllm=False,
                           model=SimpleNamespace(config=SimpleNamespace(_attn_implementation=attention)))  # fmt: skip


def test_fast_backend_falls_back_once_logged_for_attention_it_does_not_support(caplog):
    assert _unsupported(_fake_trainer("sdpa"), None) is None
    assert "flash_attention_2" in _unsupported(_fake_trainer("flash_attention_2"), None)
    backend = FastRollout()
    calls = []
    backend.fallback = SimpleNamespace(generate=lambda *a: calls.append(a) or ([[1, 2]], None), sampling_entropy=0.5)
    trainer = _fake_trainer("flash_attention_2")
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout"):
        for _ in range(3):
            assert backend.generate(trainer, [[5]], None, {}, 1) == ([[1, 2]], None)
    assert len(calls) == 3 and backend.sampling_entropy == 0.5
    assert sum("fast rollouts unavailable" in r.message for r in caplog.records) == 1


# -- timings per optimizer step -------------------------------------------------------------------------------
def test_time_metrics_are_per_optimizer_step_under_gradient_accumulation(checkpoint, tmp_path):
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=_varied,
                              args=_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4),
                              train_dataset=tiny_arithmetic_dataset("train", limit=8))  # fmt: skip
    measured = []
    original = trainer.rollout_backend.generate

    def timed(*args, **kwargs):
        start = time.perf_counter()
        result = original(*args, **kwargs)
        time.sleep(0.2)  # a rollout long enough to be measured against the rest of the step
        measured.append(time.perf_counter() - start)
        return result

    trainer.rollout_backend.generate = timed
    trainer.train()
    logs = [e for e in trainer.state.log_history if "time/rollout_s" in e]
    assert len(logs) == 2 and len(measured) == 2  # one rollout per optimizer step (4 micro-batches each)
    for entry, rollout in zip(logs, measured):
        assert entry["time/rollout_s"] == pytest.approx(rollout, rel=0.1)  # not rollout / 4
        assert entry["time/step_s"] >= entry["time/rollout_s"]


def test_input_preparation_is_timed_apart_from_the_loss_forward_and_backward(checkpoint, tmp_path):
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=_varied, args=_args(tmp_path),
                              train_dataset=tiny_arithmetic_dataset("train", limit=8))  # fmt: skip
    original = trainer._generate_and_score_completions

    def slow_preparation(inputs):
        output = original(inputs)
        time.sleep(0.3)  # after the rollout and rewards: neither their time nor the loss's
        return output

    trainer._generate_and_score_completions = slow_preparation
    trainer.train()
    logs = [e for e in trainer.state.log_history if "time/inputs_s" in e]
    assert logs
    for entry in logs:
        assert 0.3 <= entry["time/inputs_s"] < entry["time/step_s"]
        assert entry["time/forward_backward_s"] >= 0
        parts = ("rollout", "reward", "logprob", "inputs", "forward_backward")
        assert sum(entry[f"time/{part}_s"] for part in parts) == pytest.approx(entry["time/step_s"], rel=1e-6)


# -- sharded parameters ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "state, refused",
    [
        (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3), fsdp_plugin=None), "ZeRO-3"),
        (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2), fsdp_plugin=None), None),
        (SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=object()), "FSDP"),
        (SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None), None),
    ],
)
def test_parameter_sharding_is_refused_while_aqn_is_on(state, refused):
    trainer = SimpleNamespace(accelerator=SimpleNamespace(state=state))
    if refused:
        with pytest.raises(ValueError, match=refused):
            _refuse_sharded_parameters(trainer, NoiseSchedule())
    else:
        _refuse_sharded_parameters(trainer, NoiseSchedule())
    _refuse_sharded_parameters(trainer, NoiseSchedule(schedule="off"))  # without AQN nothing to refuse


# -- AQN on stock trainers and on several ranks ---------------------------------------------------------------
def _stock_trainer(tmp_path, callback):
    tokens = random_tokens(batch=4, length=8)
    dataset = Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.tolist()})
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2,
                             report_to="none", use_cpu=True, save_strategy="no")  # fmt: skip
    return Trainer(model=tiny_model("qwen2", dtype=torch.float32), args=args, train_dataset=dataset,
                   callbacks=[callback])  # fmt: skip


@pytest.mark.parametrize("apply_to_training", [False, True])
def test_aqn_callback_on_a_stock_trainer_warns_that_rollouts_get_no_noise(tmp_path, caplog, apply_to_training):
    with caplog.at_level(logging.WARNING, logger="trl_qerl.noise"):
        _stock_trainer(tmp_path, AQNCallback(apply_to_training=apply_to_training)).train()
    warned = [r for r in caplog.records if "trains without AQN" in r.message]
    assert len(warned) == (0 if apply_to_training else 1)


def test_qerl_trainer_drives_the_noise_and_does_not_warn(checkpoint, tmp_path, caplog):
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=_varied, args=_args(tmp_path, max_steps=1),
                              train_dataset=tiny_arithmetic_dataset("train", limit=4))  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="trl_qerl.noise"):
        trainer.train()
    assert not [r for r in caplog.records if "trains without AQN" in r.message]


def _noise_on_rank(rank: int, port: int, results):
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _tiny import tiny_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")  # fmt: skip
    args = TrainingArguments(output_dir=f"/tmp/aqn-rank-{port}", use_cpu=True, report_to="none", seed=0)
    model = tiny_model("qwen2", dtype=torch.float32)
    callback = AQNCallback(NoiseSchedule(num_stages=2, schedule="constant"))
    callback.on_train_begin(args, SimpleNamespace(global_step=3, max_steps=4), None, model=model)
    with callback.noise.rollout():
        results[rank] = (args.process_index, model.model.layers[0].input_layernorm.weight.detach().clone())
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.slow
def test_each_data_parallel_rank_draws_its_own_noise():
    results = mp.Manager().dict()
    mp.spawn(_noise_on_rank, args=(free_port(), results), nprocs=2)
    (rank0, noisy0), (rank1, noisy1) = results[0], results[1]
    assert (rank0, rank1) == (0, 1)
    assert not torch.equal(noisy0, noisy1)
    # and each rank's draw is reproducible: the same (seed, rank, step, draw) gives the same noise
    model = tiny_model("qwen2", dtype=torch.float32)
    noise = NormNoise(model, seed=0, rank=1)
    noise.set_step(3, 1e-2)
    with noise.rollout():
        assert torch.equal(model.model.layers[0].input_layernorm.weight, noisy1)


def test_yaml_off_read_as_false_means_no_aqn():
    """YAML 1.1 reads a bare `off` as the boolean False."""
    assert QeRLConfig(output_dir="x", use_cpu=True, aqn_schedule=False).aqn_noise_schedule().schedule == "off"
