"""QeRLGRPOTrainer end to end on CPU with tiny models: every quantisation mode and loss, AQN during rollouts only,
checkpoint + resume, the Hub push (faked at the boundary), the CLI, and clear errors for bad input."""

import json
import logging

import pytest
import torch
from _tiny import tiny_chat_checkpoint, tiny_tokenizer
from datasets import Dataset
from peft import PeftModel

from trl_qerl.config import QeRLConfig
from trl_qerl.data import tiny_arithmetic_dataset
from trl_qerl.lora import LoraNVFP4Linear
from trl_qerl.nvfp4.linear import NVFP4A16Linear
from trl_qerl.rewards import accuracy_reward, completion_text, format_reward
from trl_qerl.trainer import QeRLGRPOTrainer


pytestmark = pytest.mark.usefixtures("quiet_warnings")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def dataset():
    return tiny_arithmetic_dataset("train", limit=16)


def varied_reward(completions, **kwargs):
    """Different for every completion, so advantages are non-zero and the policy moves."""
    return [float(len(set(completion_text(c)))) / 10 for c in completions]


def _args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, report_to="none", logging_steps=1, lora_r=4, learning_rate=0.05,
        save_strategy="no", use_cpu=True, seed=0, aqn_num_stages=2, gradient_checkpointing=False,
    )  # fmt: skip
    settings.update(overrides)
    return QeRLConfig(**settings)


@pytest.mark.parametrize("quantization", ["nvfp4", "bf16", "none"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_trains_in_every_mode_and_loss(checkpoint, dataset, tmp_path, quantization, loss_type):
    args = _args(tmp_path, quantization=quantization, loss_type=loss_type, gradient_checkpointing=True)
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=[varied_reward, accuracy_reward], args=args,
                              train_dataset=dataset)  # fmt: skip
    frozen = {n: p.clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainable = {n: p.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if n in trainable and not torch.equal(p, trainable[n])]
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if n in frozen)
    if quantization == "none":
        assert not isinstance(trainer.model, PeftModel) and len(changed) > 10
        assert not any(isinstance(m, NVFP4A16Linear) for m in trainer.model.modules())
    else:
        assert isinstance(trainer.model, PeftModel) and any("lora_B" in n for n in changed)
        lora_layers = [m for m in trainer.model.modules() if isinstance(m, LoraNVFP4Linear)]
        assert bool(lora_layers) == (quantization == "nvfp4")
    logged = trainer.state.log_history[0]
    for key in ("rollout/tokens_per_second", "time/rollout_s", "time/forward_backward_s", "aqn/sigma", "entropy"):
        assert key in logged, key


def test_aqn_noise_reaches_rollouts_but_not_the_loss_forward(checkpoint, dataset, tmp_path):
    args = _args(tmp_path, max_steps=4, aqn_schedule="constant", aqn_sigma_start=0.05, aqn_num_stages=2)
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied_reward, args=args, train_dataset=dataset)
    noise = trainer.aqn_callback.noise
    name = "base_model.model.model.layers.0.input_layernorm"
    norm = trainer.model.get_submodule(name).modules_to_save["default"]
    rollouts, training_forwards = [], []
    original = trainer.rollout_backend.generate

    def generate(*a, **k):
        rollouts.append((trainer.state.global_step, norm.weight.detach().clone(), noise.clean_weight(name).clone()))
        return original(*a, **k)

    def record(module, inputs):
        if torch.is_grad_enabled():
            training_forwards.append(noise.is_perturbed)

    trainer.rollout_backend.generate = generate
    handle = norm.register_forward_pre_hook(record)
    trainer.train()
    handle.remove()
    assert [step for step, *_ in rollouts] == [0, 1, 2, 3]
    for step, weight, clean in rollouts:
        assert torch.equal(weight, clean) == (step < 2), step  # stage 0 is noise-free, stage 1 noisy
    assert training_forwards and not any(training_forwards)  # the loss forward never sees noise
    assert not noise.is_perturbed


def test_bf16_model_instance_is_quantised_and_adapters_are_trainable(checkpoint, dataset, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    trainer = QeRLGRPOTrainer(model, reward_funcs=varied_reward, args=_args(tmp_path), train_dataset=dataset,
                              processing_class=tiny_tokenizer())  # fmt: skip
    assert any(isinstance(m, LoraNVFP4Linear) for m in trainer.model.modules())
    trainer.train()


def test_checkpoint_and_resume_continue_adapter_optimizer_and_noise_schedule(checkpoint, dataset, tmp_path):
    # bf16 on purpose: resuming reloads adapters through PEFT; every trainable weight must stay an fp32 master
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, aqn_num_stages=4, bf16=True)
    straight = QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied_reward, args=_args(tmp_path / "a", **settings),
                               train_dataset=dataset)  # fmt: skip
    straight.train()
    resumed = QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied_reward, args=_args(tmp_path / "a", **settings),
                              train_dataset=dataset)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))
    checkpoint_files = {p.name for p in (tmp_path / "a" / "out" / "checkpoint-2").iterdir()}
    assert {"adapter_model.safetensors", "optimizer.pt", "trainer_state.json"} <= checkpoint_files
    assert any(name.startswith("rng_state") for name in checkpoint_files)
    stages = [e["aqn/stage"] for e in resumed.state.log_history if "loss" in e and e["step"] > 2]
    assert stages == [2, 3]  # steps 3 and 4: the schedule continues, it does not restart at stage 0
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        if a.requires_grad:
            assert a.dtype == b.dtype == torch.float32, name
            assert torch.allclose(a, b, atol=1e-6), name


def test_push_to_hub_uploads_adapter_and_qerl_model_card(checkpoint, dataset, tmp_path, monkeypatch):
    import transformers.trainer

    calls = {}

    class FakeHub:
        def create_repo(self, repo_id, **kwargs):
            calls["create_repo"] = repo_id

            class Url:
                pass

            url = Url()
            url.repo_id = f"user/{repo_id.split('/')[-1]}"
            return url

        def upload_folder(self, repo_id, folder_path, **kwargs):
            from pathlib import Path

            calls["upload"] = (repo_id, sorted(p.name for p in Path(folder_path).iterdir()))
            calls["card"] = (Path(folder_path) / "README.md").read_text()

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeHub())
    args = _args(tmp_path, push_to_hub=True, hub_model_id="qerl-tiny", hub_strategy="end")
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=[accuracy_reward, format_reward], args=args,
                              train_dataset=dataset)  # fmt: skip
    trainer.train()
    trainer.push_to_hub()
    repo, files = calls["upload"]
    assert repo == "user/qerl-tiny"
    assert {"adapter_model.safetensors", "adapter_config.json", "README.md", "tokenizer.json"} <= set(files)
    card = calls["card"]
    for expected in ("qerl", "nvfp4", "grpo", "## QeRL training setup", "NVFP4 base weights",
                     "sigma 0.01 in every noisy stage, no decay", "accuracy_reward, format_reward", "r=4"):  # fmt: skip
        assert expected in card, expected


def test_every_save_writes_the_qerl_card_without_local_paths(checkpoint, dataset, tmp_path):
    from huggingface_hub import ModelCard

    args = _args(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied_reward, args=args, train_dataset=dataset)
    trainer.train()
    trainer.save_model()
    out = tmp_path / "out"
    for directory in (out, out / "checkpoint-1", out / "checkpoint-2"):
        text = (directory / "README.md").read_text()
        assert "More Information Needed" not in text and str(tmp_path) not in text, directory
        card = ModelCard.load(directory / "README.md")
        assert card.data.qerl["quantization"] == "nvfp4" and card.data.qerl["lora"]["r"] == 4
        assert card.data.qerl["aqn"]["num_stages"] == 2 and not card.data.qerl["aqn"]["importance_sampling"]
        assert {"qerl", "grpo", "nvfp4"} <= set(card.data.tags)
        assert "shao2024deepseekmath" in text and "huang2025qerl" in text  # GRPO's citation, and QeRL's added
        assert "## QeRL training setup" in text and "a local checkpoint (`tiny`)" in text


def test_cli_trains_from_a_recipe_with_overrides(checkpoint, tmp_path):
    from trl_qerl.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {checkpoint}\ndataset_name: tiny\nmax_train_samples: 8\nreward_funcs: [accuracy, format]\n"
        f"output_dir: {tmp_path / 'cli-out'}\nmax_steps: 1\nper_device_train_batch_size: 4\nnum_generations: 4\n"
        "max_completion_length: 8\nreport_to: none\nuse_cpu: true\nlora_r: 4\nsave_strategy: 'no'\n"
    )
    assert main(["train", "--config", str(recipe), "--lora_r", "2", "--aqn_schedule", "linear"]) == 0
    config = json.loads((tmp_path / "cli-out" / "adapter_config.json").read_text())
    assert config["r"] == 2


def test_cli_eval_reports_accuracy(checkpoint, tmp_path):
    from trl_qerl.cli import main

    assert main(["eval", "--model", str(checkpoint), "--dataset", "tiny", "--limit", "4", "--max-new-tokens", "4",
                 "--json", str(tmp_path / "eval.json")]) == 0  # fmt: skip
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["num_problems"] == 4 and 0.0 <= result["accuracy"] <= 1.0


# -- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"quantization": "int8"}, "quantization must be one of"),
        ({"lora_r": 0}, "lora_r must be a positive integer"),
        ({"max_steps": 0}, "max_steps=0"),
        ({"aqn_schedule": "square"}, "Unknown AQN schedule"),
        ({"rollout_backend": "sglang"}, "rollout_backend must be one of"),
    ],
)
def test_bad_config_values(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _args(tmp_path, **overrides)


def test_dataset_without_prompt_column(checkpoint, tmp_path):
    bad = Dataset.from_dict({"question": ["1+1?"], "answer": ["2"]})
    with pytest.raises(ValueError, match="no 'prompt' column"):
        QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied_reward, args=_args(tmp_path), train_dataset=bad)


def test_reward_function_raising_is_named(checkpoint, dataset, tmp_path):
    def broken_reward(completions, **kwargs):
        raise KeyError("solution")

    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=broken_reward, args=_args(tmp_path), train_dataset=dataset)
    with pytest.raises(RuntimeError, match="Reward function 'broken_reward' raised KeyError"):
        trainer.train()


def test_nf4_needs_cuda_and_configs_must_be_qerl(checkpoint, dataset, tmp_path):
    from trl import GRPOConfig

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied_reward, args=_args(tmp_path, quantization="nf4"),
                            train_dataset=dataset)  # fmt: skip
    with pytest.raises(TypeError, match="needs a QeRLConfig"):
        QeRLGRPOTrainer(str(checkpoint), args=GRPOConfig(str(tmp_path), use_cpu=True), train_dataset=dataset)


def test_model_init_kwargs_load_the_policy_without_a_spurious_warning(checkpoint, dataset, tmp_path, caplog):
    args = _args(tmp_path, model_init_kwargs={"dtype": torch.bfloat16})
    with caplog.at_level(logging.WARNING):
        trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=accuracy_reward, args=args, train_dataset=dataset)
    assert "model_init_kwargs" not in caplog.text  # they were used (by our loader), not ignored
    assert trainer.model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    assert trainer.args.model_init_kwargs == {"dtype": torch.bfloat16}
