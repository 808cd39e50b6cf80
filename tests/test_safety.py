"""Nothing lost, nothing silent (issue 13), trainer side: resumable checkpoints, writable outputs checked first,
noise never saved, rewards and datasets validated, adapters tied to their base."""

import json
import logging
import math

import pytest
import torch
from _tiny import tiny_chat_checkpoint

from trl_qerl.checkpoints import MARKER, last_complete_checkpoint, write_atomically
from trl_qerl.config import QeRLConfig
from trl_qerl.data import tiny_arithmetic_dataset
from trl_qerl.noise import AQNCallback, NoiseSchedule
from trl_qerl.rewards import completion_text
from trl_qerl.trainer import QeRLGRPOTrainer


pytestmark = pytest.mark.usefixtures("quiet_warnings")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


def _varied(completions, **kwargs):
    return [len(set(completion_text(c))) / 10 for c in completions]


def _trainer(checkpoint, tmp_path, reward=_varied, dataset=None, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                    max_completion_length=6, report_to="none", lora_r=4, save_strategy="no", use_cpu=True,
                    gradient_checkpointing=False, logging_steps=1, aqn_num_stages=2, seed=0)  # fmt: skip
    settings.update(overrides)
    dataset = tiny_arithmetic_dataset("train", limit=8) if dataset is None else dataset
    return QeRLGRPOTrainer(str(checkpoint), reward_funcs=reward, args=QeRLConfig(**settings), train_dataset=dataset)


# -- checkpoints ------------------------------------------------------------------------------------------------
def test_resume_skips_a_checkpoint_interrupted_while_saving(checkpoint, tmp_path, caplog):
    first = _trainer(checkpoint, tmp_path, save_strategy="steps", save_steps=1)
    first.train()
    out = tmp_path / "out"
    assert all((out / f"checkpoint-{step}" / MARKER).is_file() for step in (1, 2))
    broken = out / "checkpoint-3"  # a kill during saving: the adapter is there, the trainer state is not
    broken.mkdir()
    (broken / "adapter_model.safetensors").write_bytes(b"partial")
    assert last_complete_checkpoint(out).endswith("checkpoint-2")
    resumed = _trainer(checkpoint, tmp_path, save_strategy="steps", save_steps=1, max_steps=3)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.checkpoints"):
        resumed.train(resume_from_checkpoint=True)
    assert any("checkpoint-3" in r.message and "incomplete" in r.message for r in caplog.records)
    assert resumed.state.global_step == 3


def test_atomic_write_leaves_the_old_file_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "config.json"
    write_atomically(target, "old")
    monkeypatch.setattr("os.fsync", lambda fd: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, "new")
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_atomic_write_of_bytes_leaves_only_the_file(tmp_path):
    """The NVRTC cubin cache writes bytes through the same helper: no temporary file stays beside the result."""
    target = tmp_path / "kernel.cubin"
    write_atomically(target, b"\x7fELF\x00\x01")
    write_atomically(target, b"\x7fELF\x00\x02")
    assert target.read_bytes() == b"\x7fELF\x00\x02" and [p.name for p in tmp_path.iterdir()] == ["kernel.cubin"]


def test_an_unwritable_output_dir_is_refused_before_any_work(checkpoint, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(PermissionError, match="not writable"):
        _trainer(checkpoint, tmp_path, output_dir=str(blocker / "out"))


def test_resuming_onto_another_base_model_is_refused(checkpoint, tmp_path):
    _trainer(checkpoint, tmp_path, save_strategy="steps", save_steps=2).train()
    other = tiny_chat_checkpoint(tmp_path / "other", seed=1)
    trainer = _trainer(other, tmp_path, max_steps=3)
    with pytest.raises(ValueError, match="different base model"):
        trainer.train(resume_from_checkpoint=True)


# -- noise never reaches a checkpoint -----------------------------------------------------------------------------
def test_noise_is_removed_when_a_step_fails_and_never_saved(checkpoint, tmp_path):
    calls = []

    def flaky(completions, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("judge offline")
        return _varied(completions)

    trainer = _trainer(checkpoint, tmp_path, reward=flaky, aqn_apply_to_training=True, aqn_schedule="constant",
                       aqn_sigma_start=0.05, max_steps=3)  # fmt: skip
    noise = trainer.aqn_callback.noise
    with pytest.raises(RuntimeError, match="judge offline"):
        trainer.train()
    assert not noise.is_perturbed
    clean = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "layernorm" in n}
    trainer.save_model()
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "out" / "adapter_model.safetensors")
    norms = {k: v for k, v in saved.items() if "layernorm" in k}
    assert norms and all(any(torch.equal(v, c.to(v.dtype)) for c in clean.values()) for v in norms.values())


# -- rewards and datasets -----------------------------------------------------------------------------------------
def test_rewards_that_are_always_missing_stop_training(checkpoint, tmp_path):
    trainer = _trainer(checkpoint, tmp_path, reward=lambda completions, **k: [None] * len(completions), max_steps=4)
    with pytest.raises(ValueError, match="None or NaN for every completion in 3 generation batches"):
        trainer.train()


@pytest.mark.parametrize(
    "output, error, message",
    [
        (lambda n: [math.inf] * n, ValueError, "infinite"),
        (lambda n: ["1.0"] * n, TypeError, "rewards must be numbers"),
        (lambda n: 1.0, TypeError, "must return a list"),
        (lambda n: [1.0] * (n + 1), ValueError, "rewards for"),
    ],
)
def test_bad_reward_values_get_a_sentence_not_a_traceback(checkpoint, tmp_path, output, error, message):
    def reward(completions, **kwargs):
        return output(len(completions))

    with pytest.raises(error, match=message):
        _trainer(checkpoint, tmp_path, reward=reward, max_steps=1).train()


def test_an_empty_dataset_is_refused(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="train_dataset is empty"):
        _trainer(checkpoint, tmp_path, dataset=tiny_arithmetic_dataset("train", limit=8).select([]))


# -- AQN settings -------------------------------------------------------------------------------------------------
def test_aqn_settings_that_would_fail_later_or_silently_are_caught():
    with pytest.raises(ValueError, match="positive finite"):
        NoiseSchedule(sigma_start=math.inf)
    assert AQNCallback(targets="input_layernorm").targets == ("input_layernorm",)


def test_more_stages_than_steps_is_reported(checkpoint, tmp_path, caplog):
    trainer = _trainer(checkpoint, tmp_path, max_steps=3, aqn_num_stages=10)
    with caplog.at_level(logging.WARNING, logger="trl_qerl.noise"):
        trainer.train()
    assert any("only 3 steps" in r.message and "never reached" in r.message for r in caplog.records)


def test_checkpoint_marker_is_valid_json(checkpoint, tmp_path):
    _trainer(checkpoint, tmp_path, save_strategy="steps", save_steps=2).train()
    marker = json.loads((tmp_path / "out" / "checkpoint-2" / MARKER).read_text())
    assert marker == {"global_step": 2, "complete": True}


def test_a_16_bit_mode_on_an_nvfp4_checkpoint_gets_a_sentence(checkpoint, tmp_path):
    from trl_qerl.loading import from_pretrained

    nvfp4 = tmp_path / "nvfp4"
    from_pretrained(str(checkpoint)).save_pretrained(nvfp4)
    for mode in ("bf16", "none"):
        with pytest.raises(ValueError, match="quantised checkpoint .* needs the 16-bit weights"):
            _trainer(nvfp4, tmp_path, quantization=mode)
