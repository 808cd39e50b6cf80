"""The recipes in recipes/: every one parses through `trl-qerl train` with the installed TRL and transformers, carries
the values of NVlabs/QeRL's training scripts (training/*.sh, where the paper's numbers come from), and one of them
trains a step on the shipped tiny model."""

import json
from pathlib import Path

import pytest
import yaml
from datasets import Dataset

import trl_qerl.cli
import trl_qerl.data
import trl_qerl.trainer
from trl_qerl.cli import main
from trl_qerl.data import tiny_assets


RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))

# recipe: (the NVlabs/QeRL training/ script it follows, quantization, loss, learning rate). The scripts' `lr=`: 1e-5
# for NVFP4 and 5e-6 for 16-bit LoRA, the same at every size (3B, 7B, 14B, 32B). The scripts only run DAPO (TRL's
# "bnpo"); the GRPO recipes take their GRPO branch. No script trains NF4 or every weight: those baselines reuse the
# 7B scripts (see the comments in their YAML).
REFERENCE = {
    "qwen2.5-3b-gsm8k-dapo": ("dapo_qwen2.5-3b_nvfp4_single_gpu.sh", "nvfp4", "dapo", 1e-5),
    "qwen2.5-3b-gsm8k-grpo": ("dapo_qwen2.5-3b_nvfp4_single_gpu.sh", "nvfp4", "grpo", 1e-5),
    "qwen2.5-7b-gsm8k-dapo": ("dapo_qwen2.5-7b_nvfp4_single_gpu.sh", "nvfp4", "dapo", 1e-5),
    "qwen2.5-7b-gsm8k-grpo": ("dapo_qwen2.5-7b_nvfp4_single_gpu.sh", "nvfp4", "grpo", 1e-5),
    "qwen2.5-7b-bigmath-dapo": ("dapo_qwen2.5-7b_nvfp4_single_gpu.sh", "nvfp4", "dapo", 1e-5),
    "qwen2.5-14b-gsm8k-dapo": ("dapo_qwen2.5-14b_nvfp4_single_gpu.sh", "nvfp4", "dapo", 1e-5),
    "qwen2.5-14b-gsm8k-grpo": ("dapo_qwen2.5-14b_nvfp4_single_gpu.sh", "nvfp4", "grpo", 1e-5),
    "qwen2.5-14b-bigmath-dapo": ("dapo_qwen2.5-14b_nvfp4_single_gpu.sh", "nvfp4", "dapo", 1e-5),
    "qwen2.5-32b-gsm8k-dapo": ("dapo_qwen2.5-32b_nvfp4_single_gpu.sh", "nvfp4", "dapo", 1e-5),
    "qwen2.5-32b-gsm8k-grpo": ("dapo_qwen2.5-32b_nvfp4_single_gpu.sh", "nvfp4", "grpo", 1e-5),
    "qwen2.5-32b-bigmath-dapo": ("dapo_qwen2.5-32b_nvfp4_single_gpu.sh", "nvfp4", "dapo", 1e-5),
    "baseline-qwen2.5-7b-gsm8k-bf16-lora": ("dapo_qwen2.5-7b_bf16_single_gpu.sh", "bf16", "dapo", 5e-6),
    "baseline-qwen2.5-7b-gsm8k-qlora-nf4": ("dapo_qwen2.5-7b_nvfp4_single_gpu.sh", "nf4", "dapo", 1e-5),
    "baseline-qwen2.5-7b-gsm8k-full": ("dapo_qwen2.5-7b_bf16_single_gpu.sh", "none", "dapo", 1e-6),
}
# What every script passes (--adam-beta2 0.99 --weight-decay 0.1 --lr-scheduler-type cosine --max-grad-norm 0.2 ...)
COMMON = dict(
    adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.1, lr_scheduler_type="cosine", max_grad_norm=0.2,
    mask_truncated_completions=True, num_iterations=1, gradient_accumulation_steps=1, epsilon=0.2, temperature=1.0,
    num_train_epochs=1, save_steps=50, save_total_limit=5, logging_steps=1,
)  # fmt: skip
WARMUP_RATIO = 0.1  # --warmup-ratio 0.1
LOSS = {  # loss_type "bnpo" (= DAPO: beta 0, epsilon_high 0.28) or the GRPO branch (beta 0.04, epsilon_high 0.2)
    "dapo": dict(loss_type="dapo", beta=0.0, epsilon_high=0.28),
    "grpo": dict(loss_type="grpo", beta=0.04, epsilon_high=0.2),
}
BATCH = {"3b": 2, "7b": 2, "14b": 2, "32b": 8}  # perdevice_train_batch_size, also passed as --num-generations
DATA = {  # the scripts' DATA_NAME branches: dataset (utils/data.py) and max_completion_length
    "gsm8k": (("openai/gsm8k", "main", "gsm8k"), 2048),
    "bigmath": (("open-r1/Big-Math-RL-Verified-Processed", "level_3_4_5", "math"), 4096),
}
LORA = dict(lora_r=16, lora_alpha=16, lora_dropout=0.0, train_norms=True)  # lora_rank=16 lora_alpha=16, --ln True
AQN = dict(aqn_sigma_start=1e-2, aqn_sigma_end=1e-4, aqn_num_stages=10)  # sigma_start, sigma_end, num_stages


@pytest.fixture
def parse_recipe(monkeypatch):
    """Runs `trl-qerl train --config <recipe>` with the dataset builder and the trainer replaced by recorders: the
    real parser and argument handling, no Hub access, no model."""
    seen = {}

    def build_math_dataset(name_or_path, **kwargs):
        seen["dataset"] = dict(name=str(name_or_path), **kwargs)
        return Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1?"}]], "answer": ["2"]})

    class RecordingTrainer:
        def __init__(self, model, reward_funcs, args, train_dataset):
            seen.update(model=model, reward_funcs=reward_funcs, args=args)

        def train(self, resume_from_checkpoint=None):
            pass

        def save_model(self, output_dir=None):
            pass

    for module in (trl_qerl.data, trl_qerl.cli):
        monkeypatch.setattr(module, "build_math_dataset", build_math_dataset, raising=False)
    for module in (trl_qerl.trainer, trl_qerl.cli):
        monkeypatch.setattr(module, "QeRLGRPOTrainer", RecordingTrainer, raising=False)

    def parse(path):
        seen.clear()
        assert main(["train", "--config", str(path)]) == 0
        return dict(seen)

    return parse


def test_every_recipe_has_a_reference():
    assert {path.stem for path in RECIPES} == set(REFERENCE)


@pytest.mark.parametrize("path", RECIPES, ids=lambda path: path.stem)
def test_recipe_parses_and_matches_the_reference_scripts(path, parse_recipe):
    script, quantization, loss, learning_rate = REFERENCE[path.stem]
    text = path.read_text()
    assert f"NVlabs/QeRL training/{script}" in text, "the recipe names the reference script it follows"
    raw = yaml.safe_load(text)
    assert isinstance(raw["aqn_schedule"], str), "a bare `off` is a YAML boolean: quote it"

    seen = parse_recipe(path)
    args = seen["args"]
    size = path.stem.split("qwen2.5-")[1].split("-")[0]
    data = "bigmath" if "-bigmath-" in path.stem else "gsm8k"
    (dataset, subset, kind), completion_length = DATA[data]

    assert seen["model"] == f"Qwen/Qwen2.5-{size.upper()}-Instruct"
    assert (seen["dataset"]["name"], seen["dataset"]["subset"], seen["dataset"]["kind"]) == (dataset, subset, kind)
    assert [f.__name__ for f in seen["reward_funcs"]] == ["accuracy_reward", "format_reward"]
    assert args.quantization == quantization
    assert args.learning_rate == pytest.approx(learning_rate)
    for name, value in {**COMMON, **LOSS[loss]}.items():
        assert getattr(args, name) == value, name
    assert args.get_warmup_steps(1000) == 1000 * WARMUP_RATIO, "cosine schedule with 10% linear warmup"
    assert args.per_device_train_batch_size == args.num_generations == BATCH[size]
    assert args.max_completion_length == completion_length
    if quantization != "none":
        assert {name: getattr(args, name) for name in LORA} == LORA
    assert {name: getattr(args, name) for name in AQN} == AQN
    assert args.aqn_schedule == ("exponential" if quantization == "nvfp4" else "off")


@pytest.mark.slow
def test_a_recipe_trains_one_step_on_the_tiny_model(tmp_path, quiet_warnings):
    out = tmp_path / "out"
    overrides = [
        "--model_name_or_path", str(tiny_assets()), "--dataset_name", "tiny", "--max_train_samples", "8",
        "--output_dir", str(out), "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_completion_length", "16", "--bf16", "false", "--use_cpu", "true", "--report_to", "none",
        "--save_strategy", "no",
    ]  # fmt: skip
    assert main(["train", "--config", str(RECIPES_DIR / "qwen2.5-7b-gsm8k-dapo.yaml"), *overrides]) == 0

    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 16)
    assert set(config["modules_to_save"]) == {"input_layernorm", "post_attention_layernorm"}
    assert (out / "adapter_model.safetensors").stat().st_size > 0
