"""Nothing lost, nothing silent (issue 13), checkpoint side: `trl-qerl quantize` and `merge_and_export` check their
output before any work and write it atomically; list options never split a string into characters; a checkpoint
that cannot be quantised, or a bad file in one, is named in a sentence; settings are checked before loading."""

import json
import os
from pathlib import Path

import pytest
import torch
from _tiny import tiny_chat_checkpoint, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from trl_qerl.checkpoints import atomic_directory, check_output_dir
from trl_qerl.cli import main
from trl_qerl.config import QeRLConfig, QeRLModelConfig, apply_model_config
from trl_qerl.nvfp4.linear import NVFP4A16Linear
from trl_qerl.quantizer import NVFP4A16Config, quantize_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# -- trl-qerl quantize: the output is checked first and appears whole -----------------------------------------


def test_quantize_onto_its_own_input_is_refused_and_the_input_kept(checkpoint, tmp_path, capsys):
    before = _files(checkpoint)
    with pytest.raises(SystemExit, match="would overwrite the input"):
        main(["quantize", str(checkpoint), str(checkpoint)])
    with pytest.raises(SystemExit, match="would overwrite the input"):
        main(["quantize", str(checkpoint), str(checkpoint / "nvfp4")])  # inside the input
    assert _files(checkpoint) == before


def test_quantize_into_a_file_is_refused(checkpoint, tmp_path):
    target = tmp_path / "model.bin"
    target.write_text("keep me")
    with pytest.raises(SystemExit, match="is an existing file"):
        main(["quantize", str(checkpoint), str(target)])
    assert target.read_text() == "keep me"


def test_quantize_into_a_non_empty_directory_needs_overwrite_and_then_replaces_it_whole(checkpoint, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "model.safetensors.index.json").write_text(
        '{"weight_map": {"stale": "model-00002-of-00002.safetensors"}}'
    )
    (target / "notes.txt").write_text("unrelated")
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(["quantize", str(checkpoint), str(target)])
    assert sorted(os.listdir(target)) == ["model.safetensors.index.json", "notes.txt"]  # untouched

    assert main(["quantize", str(checkpoint), str(target), "--overwrite"]) == 0
    names = set(os.listdir(target))
    assert {"config.json", "model.safetensors"} <= names
    assert not names & {"model.safetensors.index.json", "notes.txt"}  # nothing stale beside the new weights
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging left behind
    tensors = load_file(target / "model.safetensors")
    assert any(key.endswith("weight_packed") for key in tensors)


def test_quantize_on_cuda_without_a_gpu_is_a_sentence(checkpoint, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit, match="no CUDA GPU is visible"):
        main(["quantize", str(checkpoint), str(tmp_path / "out"), "--device", "cuda"])
    assert not (tmp_path / "out").exists()


def test_an_interrupted_write_leaves_the_old_directory_and_the_next_one_cleans_up(tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(RuntimeError), atomic_directory(target) as staging:
        (staging / "config.json").write_text("")  # killed after config.json, before the weights
        raise RuntimeError("killed")
    assert (target / "config.json").read_text() == "old"
    orphan = tmp_path / ".ckpt.partial-crashed"  # what a SIGKILL would leave
    orphan.mkdir()
    with atomic_directory(target) as staging:
        (staging / "config.json").write_text("new")
        assert not orphan.exists()
    assert (target / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_check_output_dir_accepts_a_new_or_empty_directory_and_a_hub_id_input(tmp_path):
    assert check_output_dir(tmp_path / "new" / "deeper", inputs=["Qwen/Qwen2.5-7B"]) == tmp_path / "new" / "deeper"
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", inputs=[tmp_path / "model"])


def test_merge_and_export_refuses_to_overwrite_its_base(checkpoint, tmp_path):
    from trl_qerl.loading import from_pretrained
    from trl_qerl.lora import get_peft_model, merge_and_export, nvfp4_lora_config

    model = get_peft_model(from_pretrained(str(checkpoint)), nvfp4_lora_config(r=4))
    before = _files(checkpoint)
    with pytest.raises(ValueError, match="would overwrite the input"):
        merge_and_export(model, checkpoint, base_model=str(checkpoint))
    assert _files(checkpoint) == before


# -- list options: a bare string is one item ------------------------------------------------------------------


def test_a_bare_string_in_modules_to_not_convert_is_one_module():
    model = quantize_model(tiny_model(dtype=torch.float32), NVFP4A16Config(modules_to_not_convert="o_proj"))
    kinds = {type(layer) for name, layer in model.named_modules() if name.endswith("o_proj")}
    assert kinds == {torch.nn.Linear}
    assert isinstance(model.model.layers[0].self_attn.q_proj, NVFP4A16Linear)


def test_a_flat_shared_scale_group_is_refused_with_the_right_shape():
    with pytest.raises(ValueError, match=r"list of groups, e.g. \[\['q_proj', 'k_proj', 'v_proj'\]"):
        NVFP4A16Config(shared_scale_groups=["q_proj", "k_proj", "v_proj"])


def test_from_dict_overrides_are_normalised_too():
    config = NVFP4A16Config.from_dict(NVFP4A16Config().to_loading_dict(), modules_to_not_convert="o_proj")
    assert config.modules_to_not_convert == ["o_proj"]


def test_yaml_scalars_for_list_options_are_one_item(checkpoint, tmp_path, monkeypatch):
    config = QeRLConfig(output_dir=str(tmp_path), use_cpu=True, aqn_targets="input_layernorm")
    assert config.aqn_targets == ["input_layernorm"]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: {checkpoint}\ndataset_name: tiny\nreward_funcs: accuracy\noutput_dir: {tmp_path / 'o'}\n"
        "max_steps: 1\nper_device_train_batch_size: 2\nnum_generations: 2\nmax_completion_length: 4\nuse_cpu: true\n"
        "report_to: none\nlora_r: 4\nsave_strategy: 'no'\nmax_train_samples: 4\ngradient_checkpointing: false\n"
    )
    seen = {}

    class Recording:
        def __init__(self, model, reward_funcs, args, train_dataset):
            seen["rewards"] = [f.__name__ for f in reward_funcs]

        def train(self, resume_from_checkpoint=None):
            pass

        def save_model(self, output_dir):
            pass

    monkeypatch.setattr("trl_qerl.trainer.QeRLGRPOTrainer", Recording)
    assert main(["train", "--config", str(recipe)]) == 0
    assert seen["rewards"] == ["accuracy_reward"]


def test_keep_patterns_that_match_nothing_are_reported(checkpoint, tmp_path):
    with pytest.warns(UserWarning, match=r"\['o_prj'\] match no Linear layer"):
        assert main(["quantize", str(checkpoint), str(tmp_path / "out"), "--keep", "o_prj"]) == 0


# -- checkpoints that cannot be quantised are named -----------------------------------------------------------


def test_a_model_with_no_quantisable_layer_is_refused_not_called_nvfp4():
    with pytest.raises(ValueError, match="No Linear layer .* can be quantised"):
        quantize_model(tiny_model(dtype=torch.float32), NVFP4A16Config(modules_to_not_convert=["re:.*"]))


def test_a_truncated_safetensors_file_is_named(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in Path(checkpoint).iterdir():
        (broken / path.name).write_bytes(path.read_bytes())
    weights = broken / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size - 1000)
    with pytest.raises(ValueError, match=r"broken/model.safetensors is not a complete safetensors file"):
        AutoModelForCausalLM.from_pretrained(broken, quantization_config=NVFP4A16Config())


def test_nan_in_q_proj_is_blamed_on_q_proj_not_on_its_siblings(checkpoint, tmp_path):
    bad = tmp_path / "nan"
    bad.mkdir()
    for path in Path(checkpoint).iterdir():
        (bad / path.name).write_bytes(path.read_bytes())
    tensors = load_file(bad / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key][0, 0] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(bad, quantization_config=NVFP4A16Config())
    message = str(error.value)
    assert "q_proj: weight holds 1 NaN/Inf value(s)" in message
    assert "k_proj: not quantised because model.layers.0.self_attn.q_proj, which shares its global scale" in message
    assert "k_proj: no weight in the checkpoint" not in message


def test_quantize_model_leaves_the_model_unchanged_when_a_layer_cannot_be_quantised():
    model = tiny_model(dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("inf")
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"the model is unchanged:\n  model.layers.1.mlp.down_proj: weight holds 1"):
        quantize_model(model)
    assert not any(isinstance(module, NVFP4A16Linear) for module in model.modules())
    assert not getattr(model, "is_quantized", False)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(after[name].equal(tensor) for name, tensor in state.items())


# -- settings checked before any model loads ------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(lora_dropout=1.5), "lora_dropout is a probability in"),
        (dict(lora_dropout=-0.1), "lora_dropout is a probability in"),
        (dict(lora_alpha=0), "lora_alpha must be a positive number"),
    ],
)
def test_bad_lora_settings_are_refused_when_the_config_is_made(tmp_path, settings, message):
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match=message):
        QeRLConfig(output_dir=str(tmp_path), use_cpu=True, **settings)
    args = QeRLConfig(output_dir=str(tmp_path), use_cpu=True)
    with pytest.raises(ValueError, match=message):
        apply_model_config(args, QeRLModelConfig(model_name_or_path="m", **settings))


def test_eval_uses_the_base_tokenizer_for_an_adapter_without_one_and_warns_about_another_base(
    checkpoint, tmp_path, caplog
):
    from trl_qerl.checkpoints import write_base_fingerprint
    from trl_qerl.loading import from_pretrained
    from trl_qerl.lora import get_peft_model, nvfp4_lora_config

    model = get_peft_model(from_pretrained(str(checkpoint)), nvfp4_lora_config(r=4))
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)  # PEFT's own save: no tokenizer files
    assert not (adapter / "tokenizer_config.json").exists()
    write_base_fingerprint(adapter, tiny_model(seed=5))  # recorded as trained on another base
    result = tmp_path / "result.json"
    argv = ["eval", "--model_name_or_path", str(checkpoint), "--adapter", str(adapter), "--dataset_name", "tiny",
            "--max_eval_samples", "2", "--max_new_tokens", "4", "--output_json", str(result)]  # fmt: skip
    with caplog.at_level("WARNING", logger="trl_qerl.checkpoints"):
        assert main(argv) == 0
    assert "trained on a different base model" in caplog.text
    assert json.loads(result.read_text())["num_problems"] == 2
