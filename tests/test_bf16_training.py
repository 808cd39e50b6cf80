"""Training numerics of the GPU configuration (bf16 model, NVFP4 or 16-bit base) checked on CPU in bf16.

CPU tests elsewhere run in fp32, which hides rounding: a bf16 weight near 1.0 moves in steps of 7.8e-3, so AdamW
updates at lr 1e-5 and AQN draws below ~4e-3 vanish in it. These tests pin the fixes: fp32 masters for every
trainable weight, noise formed in fp32 and rounded once in the norm's output, activations kept in bf16.
"""

import math

import pytest
import torch
from _tiny import random_tokens, tiny_chat_checkpoint, tiny_model

from trl_qerl.config import QeRLConfig
from trl_qerl.data import tiny_arithmetic_dataset
from trl_qerl.lora import get_peft_model, nvfp4_lora_config
from trl_qerl.noise import NormNoise
from trl_qerl.norms import active_module
from trl_qerl.nvfp4.linear import NVFP4A16Linear
from trl_qerl.quantizer import quantize_model
from trl_qerl.rewards import completion_text
from trl_qerl.trainer import QeRLGRPOTrainer


pytestmark = pytest.mark.usefixtures("quiet_warnings")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


def varied_reward(completions, **kwargs):
    return [float(len(set(completion_text(c)))) / 10 for c in completions]


def _trainer(checkpoint, tmp_path, quantization, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"), max_steps=5, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, report_to="none", logging_steps=1, lora_r=4, learning_rate=1e-5,
        save_strategy="no", use_cpu=True, seed=0, bf16=True, quantization=quantization,
        model_init_kwargs={"dtype": torch.bfloat16}, aqn_sigma_start=1e-3, aqn_sigma_end=1e-4, aqn_num_stages=2,
    )  # fmt: skip
    settings.update(overrides)
    dataset = tiny_arithmetic_dataset("train", limit=20)
    return QeRLGRPOTrainer(str(checkpoint), reward_funcs=varied_reward, args=QeRLConfig(**settings),
                           train_dataset=dataset)  # fmt: skip


def _share_changed(before: torch.Tensor, after: torch.Tensor) -> float:
    return (before != after).float().mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["nvfp4", "bf16"])
def test_trainable_weights_are_fp32_masters_that_move_at_lr_1e_5(checkpoint, tmp_path, quantization):
    trainer = _trainer(checkpoint, tmp_path, quantization)
    trainable = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(p.dtype == torch.float32 for p in trainable.values())
    assert any(isinstance(m, NVFP4A16Linear) for m in trainer.model.modules()) == (quantization == "nvfp4")
    assert trainer.model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16  # the model stays bf16
    before = {n: p.detach().clone() for n, p in trainable.items()}
    trainer.train()
    groups = {"lora_A": [], "lora_B": [], "layernorm": []}
    for name, param in trainable.items():
        group = next(g for g in groups if g in name)
        groups[group].append(_share_changed(before[name], param.detach()))
    for group, shares in groups.items():
        assert shares and min(shares) >= 0.95, (group, shares)


def test_norm_output_stays_in_the_activation_dtype_and_nvfp4_layers_see_bf16():
    model = quantize_model(tiny_model("qwen2"))
    model = get_peft_model(model, nvfp4_lora_config(model, r=4))
    NormNoise(model, seed=0)  # upcasts the AQN norms to fp32 masters
    seen = set()
    hooks = [m.register_forward_pre_hook(lambda m, a: seen.add(a[0].dtype)) for m in model.modules()
             if isinstance(m, NVFP4A16Linear)]  # fmt: skip
    with torch.no_grad():
        logits = model(random_tokens()).logits
    for hook in hooks:
        hook.remove()
    assert seen == {torch.bfloat16}
    assert logits.dtype == torch.bfloat16
    norm = active_module(model.get_submodule("base_model.model.model.layers.0.input_layernorm"))
    assert norm.weight.dtype == torch.float32


@pytest.mark.parametrize("sigma", [1e-2, 1e-3, 1e-4])
def test_noise_is_really_sigma_in_a_bf16_model(sigma):
    """Mean relative change of the norm output over many tokens ≈ E|Z| = σ·sqrt(2/π) (within 20 %)."""
    model = tiny_model("qwen2")
    model = get_peft_model(model, nvfp4_lora_config(model, r=4))  # trained norms: PEFT's modules_to_save copies
    noise = NormNoise(model, seed=0)
    norms = [active_module(m) for m in noise.modules.values()]
    with torch.no_grad():  # trained fp32 masters near 1 (at exactly 1.0, w·h would sit on the bf16 grid)
        for index, norm in enumerate(norms):
            norm.weight.uniform_(0.95, 1.05, generator=torch.Generator().manual_seed(index))
    hidden = torch.randn(16, 256, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        clean = [norm(hidden) for norm in norms]
        changes = []
        for _ in range(4):
            with noise.rollout(sigma):
                for norm, reference in zip(norms, clean):
                    noisy = norm(hidden)
                    assert noisy.dtype == torch.bfloat16
                    changes.append(((noisy.float() - reference.float()).abs() / reference.float().abs()).mean())
            assert noise.realised_sigma() == pytest.approx(sigma, rel=0.15)  # 256 noisy elements
    expected = sigma * math.sqrt(2 / math.pi)
    assert torch.stack(changes).mean().item() == pytest.approx(expected, rel=0.2)
    assert all(torch.equal(norm(hidden), reference) for norm, reference in zip(norms, clean))  # restored exactly


def test_bf16_weights_would_lose_the_noise_which_realised_sigma_reports():
    """The failure the fp32 masters prevent, shown on a norm forced back to bf16."""
    model = tiny_model("qwen2")
    noise = NormNoise(model, seed=0)
    for weight in noise._weights:
        weight.data = weight.data.to(torch.bfloat16)
    with noise.rollout(1e-4):
        assert noise.realised_sigma() < 1e-5
