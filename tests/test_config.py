"""`QeRLConfig` and `QeRLModelConfig` follow TRL's conventions: a TRL script's parser over (ScriptArguments,
QeRLConfig, ModelConfig) works, LoRA settings come from `ModelConfig`, every field is documented in the class
docstring as `GRPOConfig` documents its own, and dict-valued fields parse from JSON as TRL's do."""

import ast
import dataclasses
import re
import warnings

import pytest
import torch
from trl import GRPOConfig, ModelConfig, ScriptArguments, TrlParser

from trl_qerl.cli import EvalArguments, QeRLScriptArguments, QuantizeArguments
from trl_qerl.config import QeRLConfig, QeRLModelConfig, apply_model_config


# -- TrlParser with TRL's ModelConfig ----------------------------------------------------------------------------
def test_trl_parser_over_script_arguments_qerl_config_and_model_config(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model_name_or_path: Qwen/Qwen2.5-7B-Instruct\ndataset_name: openai/gsm8k\noutput_dir: {tmp_path / 'out'}\n"
        "lora_r: 8\nlora_alpha: 16\nlora_dropout: 0.0\nlora_target_modules: [q_proj, v_proj]\ntrain_norms: false\n"
        "aqn_schedule: linear\n"
    )
    parser = TrlParser((ScriptArguments, QeRLConfig, ModelConfig))
    script_args, args, model_args = parser.parse_args_and_config(["--config", str(recipe), "--lora_r", "4"])

    assert apply_model_config(args, model_args) is args
    assert (args.lora_r, args.lora_alpha, args.lora_dropout) == (4, 16, 0.0)
    assert args.lora_target_modules == ["q_proj", "v_proj"]
    assert (args.train_norms, args.aqn_schedule, script_args.dataset_name) == (False, "linear", "openai/gsm8k")
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-7B-Instruct"


def test_qerl_model_config_carries_qerls_lora_defaults(tmp_path):
    args, model_args = TrlParser((QeRLConfig, QeRLModelConfig)).parse_args_and_config(["--output_dir", str(tmp_path)])
    apply_model_config(args, model_args)
    assert (args.lora_r, args.lora_alpha, args.lora_dropout, args.lora_target_modules) == (32, None, 0.0, None)
    assert args.model_init_kwargs is None, "dtype follows bf16/fp16 unless --dtype is given"


def test_model_config_loading_options_go_to_model_init_kwargs(tmp_path):
    args = QeRLConfig(output_dir=str(tmp_path), model_init_kwargs={"attn_implementation": "eager"})
    apply_model_config(args, QeRLModelConfig(model_revision="v1", attn_implementation="sdpa", dtype="bfloat16"))
    assert args.model_init_kwargs == {"revision": "v1", "attn_implementation": "eager", "dtype": "bfloat16"}


@pytest.mark.parametrize(
    "option, message",
    [
        ({"use_dora": True}, "use_dora=True"),
        ({"load_in_4bit": True}, "quantization='nf4'"),
        ({"lora_modules_to_save": ["lm_head"]}, "train_norms"),
        ({"lora_r": 0}, "lora_r must be a positive integer"),
    ],
)
def test_model_config_options_the_trainer_cannot_honour_are_refused(tmp_path, option, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_model_config(QeRLConfig(output_dir=str(tmp_path)), ModelConfig(**option))


def test_lora_fields_are_not_qerl_config_fields():
    names = {f.name for f in dataclasses.fields(QeRLConfig)}
    assert not names & {"lora_r", "lora_alpha", "lora_dropout", "lora_target_modules"}
    assert "train_norms" in names


def test_lora_keywords_of_qerl_config_still_work_with_a_deprecation_warning(tmp_path):
    with pytest.warns(FutureWarning, match=r"QeRLConfig\(lora_r=8, lora_alpha=8\).*peft_config=nvfp4_lora_config"):
        args = QeRLConfig(output_dir=str(tmp_path), lora_r=8, lora_alpha=8)
    assert (args.lora_r, args.lora_alpha, args.lora_dropout) == (8, 8, 0.0)
    assert "lora_r" not in args.to_dict()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert QeRLConfig(output_dir=str(tmp_path)).lora_r == 32
    assert not [w for w in caught if "LoRA settings" in str(w.message)]


# -- dict-valued fields ------------------------------------------------------------------------------------------
def test_dict_fields_parse_from_json_as_trl_does(tmp_path):
    (args,) = TrlParser((QeRLConfig,)).parse_args_and_config([
        "--output_dir", str(tmp_path),
        "--vllm_engine_kwargs", '{"max_num_batched_tokens": 8192, "enforce_eager": "true"}',
        "--model_init_kwargs", '{"attn_implementation": "sdpa"}',
    ])  # fmt: skip
    assert args.vllm_engine_kwargs == {"max_num_batched_tokens": 8192, "enforce_eager": True}
    assert args.model_init_kwargs == {"attn_implementation": "sdpa"}
    assert "vllm_engine_kwargs" in QeRLConfig._VALID_DICT_FIELDS


def test_dict_fields_from_yaml_and_python(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"output_dir: {tmp_path}\nvllm_engine_kwargs: {{max_num_batched_tokens: 4096}}\n")
    (args,) = TrlParser((QeRLConfig,)).parse_args_and_config(["--config", str(recipe)])
    assert args.vllm_engine_kwargs == {"max_num_batched_tokens": 4096}
    assert QeRLConfig(output_dir=str(tmp_path), vllm_engine_kwargs={"seed": 1}).vllm_engine_kwargs == {"seed": 1}


def test_a_dict_field_that_is_not_json_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vllm_engine_kwargs must be a JSON object"):
        QeRLConfig(output_dir=str(tmp_path), vllm_engine_kwargs="max_num_batched_tokens=8192")


# -- docstrings, the way GRPOConfig writes them ------------------------------------------------------------------
ENTRY = re.compile(r"^ {8}(\w+) \((.+)\):$", re.MULTILINE)  # name (`type`, *optional*, defaults to `x`):
DEPRECATED = re.compile(r"^ {8}(\w+):\n\n {12}<Deprecated", re.MULTILINE)


def _own_fields(cls) -> dict[str, dataclasses.Field]:
    """Fields the class itself declares (overrides included), InitVars too."""
    return {name: cls.__dataclass_fields__[name] for name in vars(cls).get("__annotations__", {})}


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


@pytest.mark.parametrize("cls", [QeRLConfig, QeRLModelConfig, QeRLScriptArguments], ids=lambda cls: cls.__name__)
def test_docstring_documents_every_field_with_its_default(cls):
    doc = cls.__doc__
    entries = dict(ENTRY.findall(doc))
    deprecated = set(DEPRECATED.findall(doc))
    own = _own_fields(cls)
    assert set(own) == set(entries) | deprecated, "every field documented once, nothing else"
    for name, f in own.items():
        if name in deprecated:
            assert f._field_type is dataclasses._FIELD_INITVAR, f"{name} is documented as deprecated"
            continue
        assert f.metadata.get("help"), f"{name} has metadata={{'help': ...}} for --help"
        header = entries[name]
        assert re.match(r"`[^`]+`( or `[^`]+`)*, \*optional\*", header), f"{name}: (`type`, *optional*...)"
        stated = re.search(r"defaults to `(.+)`$", header)
        if stated is None:
            assert _default(f) is None, f"{name}: a default other than None is stated"
        else:
            assert ast.literal_eval(stated.group(1)) == _default(f), f"{name}: docstring default"


def test_docstring_names_the_defaults_that_differ_from_grpo_config():
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for name in ("learning_rate", "epsilon_high"):
        assert QeRLConfig.__dataclass_fields__[name].default != defaults[name]
        assert f"- `{name}`: Defaults to" in QeRLConfig.__doc__


@pytest.mark.parametrize("cls", [EvalArguments, QuantizeArguments], ids=lambda cls: cls.__name__)
def test_command_options_have_help(cls):
    assert all(f.metadata.get("help") for f in dataclasses.fields(cls))


def test_pad_to_multiple_of_auto_pads_only_on_cuda(tmp_path):
    from trl_qerl.config import CUDA_PAD_TO_MULTIPLE_OF

    expected = CUDA_PAD_TO_MULTIPLE_OF if torch.cuda.is_available() else None
    assert QeRLConfig(output_dir=str(tmp_path), report_to=[]).pad_to_multiple_of == expected
    assert QeRLConfig(output_dir=str(tmp_path), report_to=[], pad_to_multiple_of=32).pad_to_multiple_of == 32
    assert QeRLConfig(output_dir=str(tmp_path), report_to=[], pad_to_multiple_of="none").pad_to_multiple_of is None
