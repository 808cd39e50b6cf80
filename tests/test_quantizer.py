"""NVFP4A16Config + quantizer: quantise on load, save as compressed-tensors, load back, and refuse bad input."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from _tiny import random_tokens, tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import trl_qerl
from trl_qerl import NVFP4A16Config, NVFP4A16Linear
from trl_qerl.nvfp4.format import relative_error
from trl_qerl.quantizer import QUANT_METHOD, NVFP4A16HfQuantizer, register


PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _load(path, **kwargs):
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=NVFP4A16Config(), dtype=torch.bfloat16, **kwargs
    )


def _logits(model, tokens=None):
    with torch.no_grad():
        return model(random_tokens() if tokens is None else tokens).logits


def _bits(tensor):
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def test_quantise_on_load_converts_every_projection_and_nothing_else(bf16_checkpoint):
    arch, path = bf16_checkpoint
    model = _load(path)
    converted = {name for name, m in model.named_modules() if isinstance(m, NVFP4A16Linear)}
    assert {name.rpartition(".")[2] for name in converted} == PROJECTIONS
    assert len(converted) == 2 * len(PROJECTIONS)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16
    for layer in model.modules():
        if isinstance(layer, NVFP4A16Linear):
            assert "weight" not in layer._parameters
            assert layer.weight_packed.dtype == torch.uint8 and layer.weight_scale.dtype == torch.float8_e4m3fn
            assert layer.weight_global_scale.dtype == torch.float32
            assert not any(p.requires_grad for n, p in layer.named_parameters() if n != "bias")
            assert layer.weight_scale.float().max() > 1  # real scales, not an untouched placeholder
    assert model.is_quantized and model.hf_quantizer.is_trainable and model.hf_quantizer.is_serializable()
    assert model.config.quantization_config.ignore == ["lm_head"]
    error = relative_error(_logits(tiny_model(arch)), _logits(model))
    assert 0.01 < error < 0.35, error


def test_qkv_and_gate_up_share_one_global_scale(bf16_checkpoint):
    _, path = bf16_checkpoint
    model = _load(path)
    reference = tiny_model(bf16_checkpoint[0])
    for layer, ref_layer in zip(model.model.layers, reference.model.layers):
        for group, attr in ((("q_proj", "k_proj", "v_proj"), "self_attn"), (("gate_proj", "up_proj"), "mlp")):
            scales = {getattr(getattr(layer, attr), name).weight_global_scale.item() for name in group}
            assert len(scales) == 1
            amax = max(getattr(getattr(ref_layer, attr), name).weight.float().abs().max() for name in group)
            assert scales.pop() == pytest.approx(448 * 6 / amax.item(), rel=1e-6)
        own_amax = ref_layer.self_attn.o_proj.weight.float().abs().max().item()
        assert layer.self_attn.o_proj.weight_global_scale.item() == pytest.approx(448 * 6 / own_amax, rel=1e-6)


def test_quantise_on_load_holds_at_most_one_group_of_16_bit_weights(tmp_path, monkeypatch):
    path = tmp_path / "model"
    tiny_model("llama", num_hidden_layers=3).save_pretrained(path)
    largest_group = 2 * 128 * 64  # gate_proj + up_proj
    peak = []
    original = NVFP4A16HfQuantizer.quantize_loaded_weight

    def spy(self, model, name, tensor, missing_keys):
        held = sum(t.numel() for pending in self._pending.values() for t in pending.values())
        peak.append(held + tensor.numel())
        return original(self, model, name, tensor, missing_keys)

    monkeypatch.setattr(NVFP4A16HfQuantizer, "quantize_loaded_weight", spy)
    _load(path)
    assert len(peak) == 3 * len(PROJECTIONS)
    assert max(peak) <= largest_group


def test_layers_with_unaligned_in_features_stay_16_bit_with_one_warning(tmp_path):
    path = tmp_path / "model"
    tiny_model("qwen2", intermediate_size=40).save_pretrained(path)  # down_proj.in_features = 40
    with pytest.warns(UserWarning, match="in_features is not a multiple of 16") as record:
        model = _load(path)
    messages = [str(w.message) for w in record if "multiple of 16" in str(w.message)]
    assert len(messages) == 1
    assert "model.layers.0.mlp.down_proj" in messages[0] and "model.layers.1.mlp.down_proj" in messages[0]
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, NVFP4A16Linear)
    assert "model.layers.1.mlp.down_proj" in model.config.quantization_config.ignore


def test_modules_to_not_convert_is_honoured(tmp_path):
    path = tmp_path / "model"
    tiny_model("llama").save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=NVFP4A16Config(modules_to_not_convert=["o_proj", "re:.*layers\\.1\\.mlp\\..*"])
    )
    assert isinstance(model.model.layers[0].self_attn.o_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[1].mlp.up_proj, torch.nn.Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, NVFP4A16Linear)
    assert "model.layers.1.mlp.gate_proj" in model.config.quantization_config.ignore


def test_save_writes_compressed_tensors_and_round_trips_bit_identically(bf16_checkpoint, tmp_path):
    _, path = bf16_checkpoint
    model = _load(path)
    saved = tmp_path / "nvfp4"
    model.save_pretrained(saved)
    config = json.loads((saved / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "nvfp4-pack-quantized"
    group = config["config_groups"]["group_0"]
    assert group["input_activations"] is None and group["targets"] == ["Linear"]
    assert group["weights"] | {"dynamic": False} == {
        "num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
        "dynamic": False, "scale_dtype": "torch.float8_e4m3fn",
    }  # fmt: skip
    assert config["ignore"] == ["lm_head"]
    tensors = load_file(saved / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight_packed"].dtype == torch.uint8
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors

    reloaded = trl_qerl.from_pretrained(saved)
    assert isinstance(reloaded.model.layers[0].mlp.gate_proj, NVFP4A16Linear)
    original, again = model.state_dict(), reloaded.state_dict()
    assert original.keys() == again.keys()
    assert all(
        torch.equal(_bits(original[k]), _bits(again[k])) and original[k].dtype == again[k].dtype for k in original
    )
    assert torch.equal(_logits(model), _logits(reloaded))


def test_sharded_save_round_trips(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("qwen3").save_pretrained(path)
    model = _load(path)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="30KB")
    assert len(list((tmp_path / "sharded").glob("model-*.safetensors"))) > 1
    assert torch.equal(_logits(model), _logits(trl_qerl.from_pretrained(tmp_path / "sharded")))


def test_transformers_compressed_tensors_path_loads_our_checkpoint_without_our_package(tmp_path):
    pytest.importorskip("compressed_tensors")
    path = tmp_path / "bf16"
    tiny_model("qwen2").save_pretrained(path)
    model = _load(path)
    model.save_pretrained(tmp_path / "nvfp4")
    ours = _logits(model)
    script = textwrap.dedent(
        f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "nvfp4")!r}, dtype=torch.bfloat16)
        assert "trl_qerl" not in sys.modules
        with torch.no_grad():
            logits = model(torch.tensor({random_tokens().tolist()})).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, capture_output=True)
    theirs = torch.load(tmp_path / "logits.pt")
    assert relative_error(ours, theirs) < 1e-2


def test_dequantize_gives_a_plain_model_with_the_same_outputs(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("llama").save_pretrained(path)
    model = _load(path)
    expected = _logits(model)
    plain = model.dequantize()
    assert not any(isinstance(m, NVFP4A16Linear) for m in plain.modules())
    assert torch.equal(_logits(plain), expected)


# -- bad input ----------------------------------------------------------------------------------------------
@pytest.fixture
def nvfp4_checkpoint(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("qwen2").save_pretrained(path)
    saved = tmp_path / "nvfp4"
    _load(path).save_pretrained(saved)
    return saved


def _edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _edit_config(path, edit):
    config = json.loads((path / "config.json").read_text())
    edit(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.update({"model.layers.1.mlp.up_proj.weight_packed": t["model.layers.1.mlp.up_proj.weight_packed"].view(torch.int8)}),
         r"model.layers.1.mlp.up_proj.weight_packed: dtype I8"),
        (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight_scale": t["model.layers.0.self_attn.k_proj.weight_scale"][:, :2].contiguous()}),
         r"model.layers.0.self_attn.k_proj.weight_scale: dtype F8_E4M3 shape \[32, 2\], expected .* shape \[32, 4\]"),
        (lambda t: t.update({"model.layers.0.mlp.down_proj.weight_scale": t["model.layers.0.mlp.down_proj.weight_scale"].to(torch.bfloat16)}),
         r"model.layers.0.mlp.down_proj.weight_scale: dtype BF16"),
        (lambda t: t.pop("model.layers.1.self_attn.o_proj.weight_global_scale"),
         r"model.layers.1.self_attn.o_proj.weight_global_scale: missing from the checkpoint"),
        (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_global_scale": torch.tensor([float("nan")])}),
         r"model.layers.0.self_attn.q_proj: weight_global_scale is \[nan\]"),
    ],
    ids=["packed-dtype", "scale-shape", "scale-dtype", "missing-tensor", "nan-global-scale"],
)  # fmt: skip
def test_corrupt_prequantised_checkpoint_gets_a_clear_error(nvfp4_checkpoint, edit, message):
    _edit_tensors(nvfp4_checkpoint, edit)
    with pytest.raises(ValueError, match=message):
        trl_qerl.from_pretrained(nvfp4_checkpoint)


def test_nan_in_16_bit_weight_names_the_layer(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("llama").save_pretrained(path)

    def poison(tensors):
        tensors["model.layers.1.mlp.gate_proj.weight"][3, 5] = float("nan")

    _edit_tensors(path, poison)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.gate_proj: weight holds 1 NaN/Inf"):
        _load(path)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda c: c["config_groups"]["group_0"].update({"input_activations": {"num_bits": 4, "type": "float"}}),
            "W4A4",
        ),
        (lambda c: c.update({"format": "int-quantized"}), "format 'int-quantized'"),
        (lambda c: c["config_groups"]["group_0"]["weights"].update({"group_size": 32}), "group_size"),
        (lambda c: c.clear() or c.update({"quant_method": "gptq", "bits": 4}), "quantised with 'gptq'"),
    ],
    ids=["w4a4", "other-format", "mxfp4-group", "gptq"],
)
def test_unsupported_quantisation_formats_are_refused(nvfp4_checkpoint, edit, message):
    _edit_config(nvfp4_checkpoint, edit)
    with pytest.raises(ValueError, match=message):
        trl_qerl.from_pretrained(nvfp4_checkpoint)


def test_pickled_checkpoints_are_never_loaded(tmp_path):
    model = tiny_model("llama")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=NVFP4A16Config(), use_safetensors=False)
    with pytest.raises(ValueError, match="safetensors only"):
        trl_qerl.from_pretrained(tmp_path, use_safetensors=False)
    with pytest.raises(OSError):
        trl_qerl.from_pretrained(tmp_path)


def test_missing_shard_is_reported(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("qwen2").save_pretrained(path, max_shard_size="30KB")
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        trl_qerl.from_pretrained(path)


def test_disk_offload_is_refused(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("qwen2").save_pretrained(path)
    with pytest.raises(ValueError, match="cannot be offloaded"):
        AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4A16Config(), device_map={"": "disk"})


def test_config_round_trip_and_validation():
    config = NVFP4A16Config(modules_to_not_convert=["o_proj"])
    again = NVFP4A16Config(**config.to_loading_dict())
    assert again.to_loading_dict() == config.to_loading_dict()
    assert config.to_dict()["quant_method"] == "compressed-tensors"
    assert QUANT_METHOD in repr(config)
    with pytest.raises(ValueError, match="unknown arguments"):
        NVFP4A16Config(group_size=32)
    with pytest.raises(ValueError, match="list of strings"):
        NVFP4A16Config(modules_to_not_convert=[3])


def test_registration_is_idempotent():
    register()
    register()
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    assert AUTO_QUANTIZER_MAPPING[QUANT_METHOD] is NVFP4A16HfQuantizer


def test_import_is_lean():
    # transformers' modeling code may import triton itself (through torch._dynamo); we must not add to that
    script = (
        "import sys, torch, transformers.modeling_utils; before = 'triton' in sys.modules; import trl_qerl; "
        "assert 'trl_qerl.nvfp4.kernels' not in sys.modules; assert ('triton' in sys.modules) == before; "
        "assert not torch.cuda.is_initialized()"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantise_on_load_never_holds_the_16_bit_model_on_the_device(tmp_path):
    path = tmp_path / "bf16"
    model = tiny_model("qwen2", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, head_dim=64)
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(path)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    quantized = _load(path, device_map="cuda")
    peak = torch.cuda.max_memory_allocated() - base
    assert quantized.model.layers[0].mlp.up_proj.weight_packed.is_cuda
    assert peak < 0.6 * bf16_bytes, (peak, bf16_bytes)
