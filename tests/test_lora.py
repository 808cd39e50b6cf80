"""LoRA on NVFP4 layers through PEFT: dispatch, gradients, saving, plain-PEFT interop, merging."""

import json
import warnings

import pytest
import torch
from _tiny import random_tokens, tiny_model
from datasets import Dataset
from peft import LoraConfig, PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

import trl_qerl
from trl_qerl import NVFP4A16Config
from trl_qerl.lora import (
    PROJECTIONS,
    LoraNVFP4Linear,
    get_peft_model,
    load_adapter,
    merge_and_export,
    nvfp4_lora_config,
    resolve_target_modules,
)
from trl_qerl.nvfp4.format import relative_error
from trl_qerl.quantizer import quantize_model


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "bf16"
    tiny_model("qwen2").save_pretrained(path)
    return path


def _nvfp4(path):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=NVFP4A16Config(), dtype=torch.bfloat16)


def _logits(model, tokens=None):
    with torch.no_grad():
        return model(random_tokens() if tokens is None else tokens).logits


def _train_steps(model, steps=2, lr=0.5):
    tokens = random_tokens()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def test_every_projection_gets_the_nvfp4_lora_layer(checkpoint):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    layers = [m for m in model.modules() if isinstance(m, LoraNVFP4Linear)]
    assert len(layers) == 2 * len(PROJECTIONS)
    assert layers[0].lora_A["default"].weight.shape == (4, 64)
    assert layers[0].lora_A["default"].weight.device == layers[0].base_layer.weight_packed.device


def test_zero_b_gives_the_base_output_and_disable_adapter_restores_it(checkpoint):
    base = _nvfp4(checkpoint)
    expected = _logits(base)
    model = get_peft_model(base, nvfp4_lora_config(base, r=4))
    assert torch.equal(_logits(model), expected)
    _train_steps(model)
    assert not torch.equal(_logits(model), expected)
    with model.disable_adapter():
        # trained norms are PEFT modules_to_save: disabled too, so this is exactly the base model
        assert torch.equal(_logits(model), expected)


def test_gradients_reach_only_lora_and_trained_norms(checkpoint):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    tokens = random_tokens()
    model(tokens, labels=tokens).loss.backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {name for name, p in model.named_parameters() if p.requires_grad}
    assert all("lora_" in name or "modules_to_save" in name for name in with_grad)
    assert any("input_layernorm" in name for name in with_grad)
    assert all(p.grad is None for name, p in model.named_parameters() if "weight_packed" in name or "embed" in name)


def test_packed_weights_never_change_in_training(checkpoint):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    packed = {n: p.clone() for n, p in model.named_parameters() if "weight_" in n and "lora" not in n}
    _train_steps(model, steps=3)
    assert all(torch.equal(p, packed[n]) for n, p in model.named_parameters() if n in packed)


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_lora_layer_matches_the_formula_in_bf16_forward_and_backward(checkpoint, autocast):
    """``y = base(x) + scaling * B(A(x))``, its input gradient and the fp32 masters' gradients, in bf16 (the GPU
    path's dtype; with and without autocast, as in the loss forward and in rollouts), against float64 arithmetic on
    the same values. The expand, the scaling and the sum are one ``addmm``: nothing may change the result beyond
    bf16 rounding."""
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4, lora_alpha=8))  # scaling 2
    layer = next(m for m in model.modules() if isinstance(m, LoraNVFP4Linear))
    weight_a, weight_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    assert weight_a.dtype == weight_b.dtype == torch.float32 and layer.scaling["default"] == 2.0
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        weight_b.copy_(torch.randn(weight_b.shape, generator=generator) * 0.1)
    x = torch.randn(2, 5, weight_a.shape[1], generator=generator).bfloat16().requires_grad_()
    upstream = torch.randn(2, 5, weight_b.shape[0], generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    (y.float() * upstream).sum().backward()

    x64 = x.detach().double().requires_grad_()
    a64 = weight_a.detach().bfloat16().double().requires_grad_()
    b64 = weight_b.detach().bfloat16().double().requires_grad_()
    with torch.no_grad():
        base = layer.base_layer(x.detach()).double()
    expected = base + 2.0 * (x64 @ a64.T) @ b64.T
    (expected * upstream.double()).sum().backward()
    assert relative_error(y.double(), expected) < 1e-2
    assert relative_error(weight_b.grad.double(), b64.grad) < 2e-2
    assert relative_error(weight_a.grad.double(), a64.grad) < 2e-2
    x_base = x.detach().clone().requires_grad_()
    (layer.base_layer(x_base).float() * upstream).sum().backward()  # the frozen base's share of the input gradient
    expected_x_grad = x_base.grad.double() + 2.0 * (upstream.double() @ b64 @ a64)
    assert relative_error(x.grad.double(), expected_x_grad) < 2e-2
    assert weight_a.grad.dtype == weight_b.grad.dtype == torch.float32


def test_lora_product_accumulates_in_place_only_into_a_fresh_base_output():
    """The base layer's own output takes the LoRA product in place (no copy of the layer's output); a view, or an
    output of another dtype, gets a new tensor with the same values."""
    from trl_qerl.lora import _add_lora_product

    generator = torch.Generator().manual_seed(1)
    hidden, weight_a, weight_b = (torch.randn(shape, generator=generator) for shape in ((6, 8), (2, 8), (5, 2)))
    expected = 0.5 * hidden @ weight_a.T @ weight_b.T
    fresh = torch.randn(6, 5, generator=generator)
    base = fresh.clone()
    assert _add_lora_product(fresh, hidden, weight_a, weight_b, 0.5) is fresh
    torch.testing.assert_close(fresh, base + expected)
    view = base.clone()[:, :5]
    assert view._is_view()
    before = view.clone()
    out = _add_lora_product(view, hidden, weight_a, weight_b, 0.5)
    assert out is not view and torch.equal(view, before)
    torch.testing.assert_close(out, before + expected)
    wider = base.double()
    out = _add_lora_product(wider, hidden, weight_a, weight_b, 0.5)
    assert out.dtype == torch.float64 and torch.equal(wider, base.double())


def test_nvfp4_lora_model_traces_without_graph_breaks(checkpoint):
    """``torch.compile`` (the fast backend's ``model`` engine compiles the model's forward) traces the LoRA layer
    whole: its in-place check (`Tensor._is_view`) runs only eagerly."""
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(random_tokens())
    assert explanation.graph_break_count == 0, [str(b.reason)[:200] for b in explanation.break_reasons]


def test_saved_adapter_is_standard_and_round_trips(checkpoint, tmp_path):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    _train_steps(model)
    trained = _logits(model)
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(PROJECTIONS)
    assert sorted(config["modules_to_save"]) == ["input_layernorm", "post_attention_layernorm"]
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.post_attention_layernorm.weight" in keys
    assert not any("weight_packed" in key or "weight_scale" in key for key in keys)

    reloaded = load_adapter(_nvfp4(checkpoint), tmp_path / "adapter")
    assert torch.equal(_logits(reloaded), trained)
    plain = PeftModel.from_pretrained(_nvfp4(checkpoint), tmp_path / "adapter")  # PEFT's own lora.Linear
    assert not any(isinstance(m, LoraNVFP4Linear) for m in plain.modules())
    assert relative_error(trained, _logits(plain)) < 1e-2  # LoRA products in fp32 there, bf16 here


def test_plain_peft_on_the_bf16_base_matches_up_to_quantisation_error(checkpoint, tmp_path):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    _train_steps(model)
    model.save_pretrained(tmp_path / "adapter")
    bf16_base = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    plain = PeftModel.from_pretrained(bf16_base, tmp_path / "adapter")
    bf16_no_adapter = _logits(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))
    quantisation_error = relative_error(bf16_no_adapter, _logits(_nvfp4(checkpoint)))
    assert relative_error(_logits(plain), _logits(model)) < 1.5 * quantisation_error
    assert relative_error(_logits(plain), bf16_no_adapter) > 0.01  # the adapter did something


def test_in_place_merge_is_refused_with_the_alternative(checkpoint):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    with pytest.raises(ValueError, match="merge_and_export"):
        model.merge_adapter()
    with pytest.raises(ValueError, match="E2M1 step"):
        model.merge_and_unload()


@pytest.mark.parametrize("export_format", ["bf16", "nvfp4"])
def test_merge_and_export_merges_into_16_bit_masters(checkpoint, tmp_path, export_format):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    _train_steps(model)
    model.save_pretrained(tmp_path / "adapter")
    expected = _logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16),
                                                 tmp_path / "adapter"))  # fmt: skip
    merge_and_export(model, tmp_path / "merged", base_model=checkpoint, export_format=export_format)
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    if export_format == "bf16":
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    else:
        merged = trl_qerl.from_pretrained(tmp_path / "merged", dtype=torch.bfloat16)
    if export_format == "bf16":
        assert "quantization_config" not in saved
        assert relative_error(expected, _logits(merged)) < 0.02  # bf16 rounding of the merged weights
    else:
        assert saved["quantization_config"]["format"] == "nvfp4-pack-quantized"
        assert relative_error(expected, _logits(merged)) < 0.35


def test_merge_and_export_refuses_an_nvfp4_base(checkpoint, tmp_path):
    _nvfp4(checkpoint).save_pretrained(tmp_path / "nvfp4")
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    with pytest.raises(ValueError, match="16-bit master weights"):
        merge_and_export(model, tmp_path / "out", base_model=tmp_path / "nvfp4")


def test_all_linear_and_bad_targets(checkpoint):
    model = _nvfp4(checkpoint)
    assert resolve_target_modules(model, "all-linear") == sorted(PROJECTIONS)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert sum(isinstance(m, LoraNVFP4Linear) for m in peft_model.modules()) == 14
    with pytest.raises(ValueError, match="not Linear layers of this model"):
        nvfp4_lora_config(_nvfp4(checkpoint), target_modules=["qkv_proj"])
    with pytest.raises(ValueError, match="pass model"):
        nvfp4_lora_config(target_modules="all-linear")
    with pytest.raises(ValueError, match="positive integer"):
        nvfp4_lora_config(r=0)


def test_unsupported_lora_options_are_refused(checkpoint):
    with pytest.raises(ValueError, match="does not support use_dora"):
        get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4, use_dora=True))


def test_quantize_model_in_memory_matches_quantise_on_load(checkpoint):
    loaded = _nvfp4(checkpoint)
    in_memory = quantize_model(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16))
    assert torch.equal(_logits(loaded), _logits(in_memory))
    assert in_memory.hf_quantizer.is_trainable and in_memory.is_quantized


def test_trainer_trains_a_peft_wrapped_nvfp4_model(checkpoint, tmp_path):
    model = get_peft_model(_nvfp4(checkpoint), nvfp4_lora_config(r=4))
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    tokens = random_tokens(batch=8, length=12)
    dataset = Dataset.from_dict({"input_ids": tokens.tolist(), "labels": tokens.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
        report_to="none", use_cpu=True, save_strategy="no", logging_steps=1,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = Trainer(model=model, args=args, train_dataset=dataset).train()
    assert result.training_loss > 0
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert any("lora_B" in n for n in changed) and any("layernorm" in n for n in changed)
