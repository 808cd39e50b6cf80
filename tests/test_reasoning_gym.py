"""reasoning-gym tasks as a dataset source with their own scorer as the reward (offline: problems are procedural)."""

import json

import pytest

from trl_qerl.data import build_math_dataset
from trl_qerl.reasoning_gym import (
    build_reasoning_gym_dataset,
    extract_tagged_answer,
    reasoning_gym_reward,
    task_name,
)


pytest.importorskip("reasoning_gym")
SMALL = dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2)


def _answered(text):
    return [{"role": "assistant", "content": f"<think>adding up</think> <answer>{text}</answer>"}]


def test_a_task_becomes_a_grpo_dataset_with_its_spec():
    dataset = build_reasoning_gym_dataset("reasoning-gym:chain_sum", size=6, **SMALL)
    assert dataset.column_names == ["prompt", "answer", "reasoning_gym"]
    assert len(dataset) == 6
    system, user = dataset[0]["prompt"]
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user["role"] == "user" and "arithmetic problem" in user["content"]
    spec = json.loads(json.loads(dataset[0]["reasoning_gym"])["spec"])
    assert spec["task"] == "chain_sum" and spec["config"] == SMALL
    # reproducible, and the test split draws other problems
    assert build_reasoning_gym_dataset("chain_sum", size=6, **SMALL)["answer"] == dataset["answer"]
    test = build_reasoning_gym_dataset("chain_sum", split="test", size=6, **SMALL)
    assert [p[1]["content"] for p in test["prompt"]] != [p[1]["content"] for p in dataset["prompt"]]


def test_the_reward_is_the_tasks_own_score_of_the_tagged_answer():
    dataset = build_reasoning_gym_dataset("chain_sum", size=4, **SMALL)
    right = [_answered(answer) for answer in dataset["answer"]]
    assert reasoning_gym_reward(right, reasoning_gym=dataset["reasoning_gym"]) == [1.0] * 4
    wrong = [_answered(str(int(a) + 1)) for a in dataset["answer"]]
    assert reasoning_gym_reward(wrong, reasoning_gym=dataset["reasoning_gym"]) == [0.0] * 4
    untagged = [dataset["answer"][0], "", "<answer>", None]  # plain strings too; no tag scores 0
    assert reasoning_gym_reward(untagged, reasoning_gym=dataset["reasoning_gym"]) == [0.0] * 4
    with pytest.raises(ValueError, match="needs the 'reasoning_gym' column"):
        reasoning_gym_reward(right)


def test_answer_extraction_takes_the_last_block():
    assert extract_tagged_answer("<answer>1</answer> then <answer> 2 </answer>") == "2"
    assert extract_tagged_answer("<answer>1") is None


def test_a_mistyped_task_gets_suggestions():
    with pytest.raises(ValueError, match="no task 'chain_summ'. Did you mean chain_sum"):
        task_name("reasoning-gym:chain_summ")
    with pytest.raises(ValueError, match="split must be one of"):
        build_reasoning_gym_dataset("chain_sum", split="dev")


def test_build_math_dataset_routes_the_prefix_with_json_options():
    dataset = build_math_dataset("reasoning-gym:chain_sum", split="train", subset=json.dumps(SMALL), limit=5)
    assert len(dataset) == 5 and "reasoning_gym" in dataset.column_names
    with pytest.raises(ValueError, match="options as a JSON object"):
        build_math_dataset("reasoning-gym:chain_sum", subset="[1, 2]", limit=5)


def test_the_cli_trains_on_a_task_with_its_scorer(tmp_path, monkeypatch, capsys):
    from trl_qerl.cli import main
    from trl_qerl.data import tiny_assets

    seen = {}

    class Recording:
        def __init__(self, model, reward_funcs, args, train_dataset):
            seen["rewards"] = [f.__name__ for f in reward_funcs]
            seen["rows"] = len(train_dataset)

        def train(self, resume_from_checkpoint=None):
            pass

        def save_model(self, output_dir):
            pass

    monkeypatch.setattr("trl_qerl.trainer.QeRLGRPOTrainer", Recording)
    argv = ["train", "--model_name_or_path", str(tiny_assets()), "--dataset_name", "reasoning-gym:chain_sum",
            "--dataset_config", json.dumps(SMALL), "--max_train_samples", "12", "--output_dir", str(tmp_path),
            "--use_cpu", "true", "--report_to", "none"]  # fmt: skip
    assert main(argv) == 0
    assert seen == {"rewards": ["reasoning_gym_reward"], "rows": 12}
    assert "task's own scorer" in capsys.readouterr().out


@pytest.mark.usefixtures("quiet_warnings")
def test_a_grpo_step_on_a_task(tmp_path):
    from trl_qerl.config import QeRLConfig
    from trl_qerl.data import tiny_assets
    from trl_qerl.lora import nvfp4_lora_config
    from trl_qerl.trainer import QeRLGRPOTrainer

    args = QeRLConfig(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, use_cpu=True, report_to="none", save_strategy="no",
                      gradient_checkpointing=False, logging_steps=1)  # fmt: skip
    trainer = QeRLGRPOTrainer(str(tiny_assets()), reward_funcs=reasoning_gym_reward, args=args,
                              train_dataset=build_reasoning_gym_dataset("chain_sum", size=8, **SMALL),
                              peft_config=nvfp4_lora_config(r=4))  # fmt: skip
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "rewards/reasoning_gym_reward/mean" in entry]
    assert len(logged) == 1 and 0.0 <= logged[0]["rewards/reasoning_gym_reward/mean"] <= 1.0
