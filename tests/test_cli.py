"""What a user meets first at the `trl-qerl` command: help and version without loading torch, errors for mistyped
commands and missing datasets, TRL-style options (with the earlier spellings still accepted), and model/LoRA
options that reach the trainer."""

import json
import subprocess
import sys
from importlib import metadata

import pytest

import trl_qerl.trainer
from trl_qerl.cli import main, make_parser, parse_quantize_arguments
from trl_qerl.data import tiny_assets


HEAVY = ("torch", "transformers", "peft", "datasets", "accelerate", "triton", "vllm")
# Runs commands that must not load anything heavy in a fresh interpreter; prints what each one imported beyond the
# package itself, and whether importing the package alone loaded torch.
PROBE = """
import contextlib, io, json, sys
import trl_qerl
report = {"package_imports_torch": "torch" in sys.modules, "commands": {}}
from trl_qerl.cli import main
for argv in (["--help"], ["--version"], ["trian"], ["eval", "--help"], ["quantize", "--help"]):
    before = set(sys.modules)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    report["commands"][" ".join(argv)] = sorted(set(sys.modules) - before)
report["torch_loaded"] = "torch" in sys.modules
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def probe():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("command", ["--help", "--version", "trian", "eval --help", "quantize --help"])
def test_help_version_and_errors_import_nothing_heavy(probe, command):
    heavy = [name for name in probe["commands"][command] if name.split(".")[0] in HEAVY]
    assert not heavy, f"`trl-qerl {command}` imported {heavy[:5]}"


def test_help_does_not_import_torch(probe):
    assert not probe["package_imports_torch"] and not probe["torch_loaded"]


def test_first_name_used_registers_the_quantizer():
    """`import trl_qerl` is lazy; whichever name is used first registers the quantizer with transformers."""
    code = (
        "import sys, trl_qerl; assert 'torch' not in sys.modules; trl_qerl.QeRLConfig; "
        "from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING; assert 'qerl_nvfp4' in AUTO_QUANTIZER_MAPPING"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_help_lists_the_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("train", "eval", "quantize", "demo", "vllm-serve", "--version"))


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version(capsys, flag):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"trl-qerl {metadata.version('trl-qerl')} (")
    assert f"trl {metadata.version('trl')}" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["trian"], "'trian' is not a command. Did you mean 'train'?"),
        (["vllm_serve"], "Did you mean 'vllm-serve'?"),
        (["frobnicate"], "'frobnicate' is not a command. Commands: train, eval"),
        (["--config", "recipe.yaml"], "Options go after the command"),
    ],
)
def test_a_mistyped_command_is_an_error(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and not captured.out


# -- train -------------------------------------------------------------------------------------------------------
@pytest.fixture
def recorded(monkeypatch):
    """`trl-qerl train` with the trainer replaced by a recorder: the real parser and argument handling, no model."""
    seen = {}

    class RecordingTrainer:
        def __init__(self, model, reward_funcs, args, train_dataset):
            seen.update(model=model, args=args, dataset=train_dataset)

        def train(self, resume_from_checkpoint=None):
            pass

        def save_model(self, output_dir=None):
            pass

    monkeypatch.setattr(trl_qerl.trainer, "QeRLGRPOTrainer", RecordingTrainer)
    return seen


def test_train_without_a_dataset_is_refused(capsys, tmp_path, recorded):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--model_name_or_path", "Qwen/Qwen2.5-7B-Instruct", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--dataset_name is required" in err
    assert "--dataset_name openai/gsm8k --dataset_config main" in err and "--dataset_name tiny" in err
    assert not recorded, "nothing was trained"


def test_train_on_the_shipped_tiny_model_defaults_to_the_toy_task(tmp_path, recorded):
    assert main(["train", "--model_name_or_path", str(tiny_assets()), "--output_dir", str(tmp_path),
                 "--max_train_samples", "4"]) == 0  # fmt: skip
    assert len(recorded["dataset"]) == 4 and "answer" in recorded["dataset"].column_names


def test_train_model_and_lora_options_reach_the_trainer(tmp_path, recorded):
    assert main([
        "train", "--model_name_or_path", str(tiny_assets()), "--dataset_name", "tiny", "--output_dir", str(tmp_path),
        "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1", "--lora_target_modules", "q_proj", "v_proj",
        "--train_norms", "false", "--dtype", "float32", "--vllm_engine_kwargs", '{"max_num_batched_tokens": 512}',
    ]) == 0  # fmt: skip
    args = recorded["args"]
    assert recorded["model"] == str(tiny_assets())
    assert (args.lora_r, args.lora_alpha, args.lora_dropout, args.train_norms) == (8, 16, 0.1, False)
    assert args.lora_target_modules == ["q_proj", "v_proj"]
    assert args.model_init_kwargs == {"dtype": "float32"}
    assert args.vllm_engine_kwargs == {"max_num_batched_tokens": 512}


def test_train_refuses_model_options_it_cannot_honour(capsys, tmp_path, recorded):
    with pytest.raises(SystemExit):
        main(["train", "--model_name_or_path", str(tiny_assets()), "--output_dir", str(tmp_path), "--use_dora"])
    assert "use_dora=True (DoRA is not implemented" in capsys.readouterr().err


# -- eval and quantize: TRL-style options, earlier spellings kept ------------------------------------------------
def test_eval_options_keep_their_earlier_spellings():
    parser = make_parser("eval")
    (new,) = parser.parse_args_and_config([
        "--model_name_or_path", "m", "--dataset_name", "d", "--dataset_config", "main", "--dataset_test_split", "s",
        "--dataset_kind", "gsm8k", "--max_eval_samples", "4", "--top_p", "0.9", "--max_new_tokens", "8",
        "--samples_per_problem", "2", "--batch_size", "2", "--output_json", "r.json",
    ])  # fmt: skip
    (old,) = parser.parse_args_and_config([
        "--model", "m", "--dataset", "d", "--dataset-config", "main", "--split", "s", "--kind", "gsm8k",
        "--limit", "4", "--top-p", "0.9", "--max-new-tokens", "8", "--samples", "2", "--batch-size", "2",
        "--json", "r.json",
    ])  # fmt: skip
    assert new == old


def test_eval_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--max_new_tokens" in out and "(default: 1024)" in out and "(default: 0.95)" in out


def test_eval_without_a_dataset_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--model", "Qwen/Qwen2.5-7B-Instruct"])
    assert "--dataset_name is required" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["in", "out", "--keep", "lm_head", "q_proj"],
        ["--model_name_or_path", "in", "--output_dir", "out", "--modules_to_not_convert", "lm_head", "q_proj"],
    ],
)
def test_quantize_takes_positionals_or_options(argv):
    args = parse_quantize_arguments(argv)
    assert (args.model_name_or_path, args.output_dir) == ("in", "out")
    assert args.modules_to_not_convert == ["lm_head", "q_proj"]


def test_quantize_refuses_a_positional_that_contradicts_an_option(capsys):
    with pytest.raises(SystemExit):
        parse_quantize_arguments(["in", "out", "--model_name_or_path", "other"])
    assert "disagree" in capsys.readouterr().err


def test_quantize_without_an_output_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["quantize", "in"])
    assert "trl-qerl quantize MODEL OUTPUT_DIR" in capsys.readouterr().err
