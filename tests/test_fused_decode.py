"""The fused decode step (`FusedDecoder` over `read_decoder`) against transformers' own forward and generate."""

from __future__ import annotations

import logging

import pytest
import torch
from _tiny import TINY, randomize_lora_b, tiny_model
from transformers import GemmaConfig, GemmaForCausalLM, MistralConfig, MistralForCausalLM

from trl_qerl.lora import get_peft_model, nvfp4_lora_config
from trl_qerl.noise import NormNoise
from trl_qerl.quantizer import quantize_model
from trl_qerl.rollout.decoder_spec import UnsupportedDecoder, read_decoder
from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12]]
GREEDY = SamplingParams(max_new_tokens=12, temperature=0)

pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _mistral(dtype=torch.float32):
    torch.manual_seed(0)
    config = MistralConfig(**{**TINY, "sliding_window": None})
    return MistralForCausalLM(config).to(dtype).eval()


def _model(arch: str, dtype=torch.float32, quantized=True, lora_targets=None):
    model = _mistral(dtype) if arch == "mistral" else tiny_model(arch, dtype=dtype)
    if quantized:
        model = quantize_model(model)
    if lora_targets is not None:
        model = randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=4, target_modules=lora_targets)))
    return model.eval()


def _greedy(model, engine, prompts=PROMPTS, params=GREEDY, **kwargs):
    generator = StaticCacheGenerator(model, cuda_graph=False, engine=engine, **kwargs)
    assert generator.engine == engine
    return generator.sample(prompts, params, [1], 0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("variant", ["fp32", "nvfp4", "nvfp4+lora"])
def test_fused_step_matches_the_model_forward(arch, variant):
    model = _model(arch, quantized=variant != "fp32", lora_targets="all-linear" if "lora" in variant else None)
    fused, reference = _greedy(model, "fused"), _greedy(model, "model")
    assert fused.completion_ids == reference.completion_ids
    assert all(len(row) == GREEDY.max_new_tokens for row in fused.completion_ids)  # eos 1 never drawn here


def test_lora_on_some_projections_and_qwen2_bias():
    model = _model("qwen2", lora_targets=["q_proj", "v_proj", "down_proj"])
    spec = read_decoder(model)
    layer = spec.layers[0]
    assert [bool(p.lora) for p in layer.qkv] == [True, False, True]
    assert not layer.o.lora and not any(p.lora for p in layer.gate_up) and layer.down.lora
    assert all(p.bias is not None for p in layer.qkv)  # Qwen2's q/k/v bias, added by the grouped product
    assert _greedy(model, "fused").completion_ids == _greedy(model, "model").completion_ids


def test_sampled_logprobs_match_the_model_path():
    model = _model("qwen3", lora_targets="all-linear")
    params = SamplingParams(max_new_tokens=6, temperature=0.8, top_k=20)
    torch.manual_seed(3)
    fused = _greedy(model, "fused", params=params)
    torch.manual_seed(3)
    reference = _greedy(model, "model", params=params)
    assert fused.completion_ids == reference.completion_ids  # same draws from the same logits
    for ours, theirs in zip(fused.logprobs, reference.logprobs):
        assert torch.allclose(torch.tensor(ours), torch.tensor(theirs), atol=1e-4)


def test_spec_reads_the_training_tensors_in_place():
    model = _model("llama", lora_targets="all-linear")
    spec = read_decoder(model)
    lora_a = model.base_model.model.model.layers[1].self_attn.k_proj.lora_A["default"].weight
    norm = model.base_model.model.model.layers[1].post_attention_layernorm.weight
    assert spec.layers[1].qkv[1].lora[0].lora_a is lora_a
    assert spec.layers[1].post_attention_norm.weight is norm


def test_aqn_noise_reaches_the_fused_step_and_sigma_zero_is_the_clean_model():
    model = _model("qwen2", dtype=torch.bfloat16, lora_targets="all-linear")
    noise = NormNoise(model, seed=0)
    generator = StaticCacheGenerator(model, cuda_graph=False, engine="fused")
    clean = generator.sample(PROMPTS, GREEDY, [1], 0)
    noise.set_step(1, 0.0)
    with noise.rollout():
        assert generator.sample(PROMPTS, GREEDY, [1], 0) == clean  # bit for bit: log-probs and entropies too
    noise.set_step(1, 0.3)
    with noise.rollout():
        noisy = generator.sample(PROMPTS, GREEDY, [1], 0).completion_ids
        reference = _greedy(model, "model").completion_ids  # the same draw, through the model's forward
    assert noisy != clean.completion_ids and noisy == reference


def test_bf16_fused_logits_match_the_model_forward():
    """bf16 on CPU: the fused step's first-token logits against transformers' forward of the whole prompt."""
    model = _model("qwen3", dtype=torch.bfloat16, lora_targets="all-linear")
    NormNoise(model)  # fp32 norm weights, as in training
    generator = StaticCacheGenerator(model, cuda_graph=False, engine="fused")
    prompt = [[5, 6, 7, 8, 9, 10, 11, 12]]
    params = SamplingParams(max_new_tokens=4, temperature=0)
    completion = generator.generate(prompt, params, [1], 0)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt[0] + completion])).logits[0, len(prompt[0]) - 1 : -1].float()
    chosen = logits[torch.arange(len(completion)), torch.tensor(completion)]
    assert (logits.max(dim=-1).values - chosen).max() <= 0.05 * logits.abs().max()  # argmax up to bf16 ties


def test_unsupported_models_fall_back_with_one_log_line(caplog):
    gemma = GemmaForCausalLM(GemmaConfig(**{**TINY, "head_dim": 16})).eval()
    with caplog.at_level(logging.INFO, logger="trl_qerl.rollout.fast"):
        generator = StaticCacheGenerator(gemma, cuda_graph=False)
    assert generator.engine == "model"
    assert "fused decode step unavailable (model_type 'gemma'" in caplog.text
    with pytest.raises(UnsupportedDecoder, match="gemma"):
        StaticCacheGenerator(gemma, cuda_graph=False, engine="fused")
    gelu = tiny_model("llama", hidden_act="gelu")
    with pytest.raises(UnsupportedDecoder, match="hidden_act"):
        read_decoder(gelu)
    with pytest.raises(ValueError, match="Unknown engine"):
        StaticCacheGenerator(gelu, engine="vllm")


def test_dora_is_refused_by_the_fused_step():
    from peft import LoraConfig
    from peft import get_peft_model as peft_get_peft_model

    model = peft_get_peft_model(tiny_model("llama", dtype=torch.float32), LoraConfig(r=4, use_dora=True))
    with pytest.raises(UnsupportedDecoder, match="use_dora"):
        read_decoder(model)
    assert StaticCacheGenerator(model, cuda_graph=False).engine == "model"


def test_sliding_window_shorter_than_the_cache_is_refused_with_the_fix():
    model = MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": 16})).eval()
    generator = StaticCacheGenerator(model, cuda_graph=False, length_bucket=64)
    with pytest.raises(ValueError, match="exceeds the model's sliding window 16.*rollout_backend='transformers'"):
        generator.generate(PROMPTS, GREEDY, [1], 0)  # FastRollout logs this and falls back to generate


# -- on the GPU: CUDA graphs, torch.compile, 7B widths -----------------------------------------------------------
def _assert_greedy(model, prompts, completions, tolerance):
    """Every greedy token is the argmax of transformers' forward over the same sequence, up to ``tolerance`` (a
    fraction of the largest logit) where bf16 rounding flips a near tie; most tokens are the exact argmax."""
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            ids = torch.tensor([prompt + completion], device=model.device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits[torch.arange(len(completion)), torch.tensor(completion)]
        gap = logits.max(dim=-1).values - chosen
        assert gap.max() <= tolerance * logits.abs().max(), gap.max()
        assert (gap == 0).float().mean() >= 0.9


@needs_cuda
@pytest.mark.parametrize("compile", [False, True])
def test_captured_fused_step_on_cuda(compile):
    model = _model("qwen2", dtype=torch.bfloat16, lora_targets="all-linear").cuda()
    noise = NormNoise(model, seed=0)
    # (an eager prefill as in `eager`: a captured one rounds prompt lengths up, and bf16 sums then differ)
    generator = StaticCacheGenerator(model, engine="fused", compile=compile, capture_prefill=False)
    eager = StaticCacheGenerator(model, engine="fused", cuda_graph=False, compile=False)
    ours = generator.generate(PROMPTS, GREEDY, [1], 0)
    if compile:  # inductor sums in another order: equal up to bf16 ties
        _assert_greedy(model, PROMPTS, ours, 0.02)
    else:
        assert ours == eager.generate(PROMPTS, GREEDY, [1], 0)
    noise.set_step(1, 0.3)
    with noise.rollout():  # a new draw, replayed by the same graph
        noisy = generator.generate(PROMPTS, GREEDY, [1], 0)
        assert noisy != ours
        _assert_greedy(model, PROMPTS, noisy, 0.02)
    assert generator.captures == 1


@needs_cuda
def test_seven_b_widths_greedy_for_64_tokens():
    """4 layers at Qwen2.5-7B widths, NVFP4 + LoRA, bf16: 64 fused greedy tokens against transformers' forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=4, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=4096)  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    model = _lora(quantize_model(model))
    prompts = torch.randint(3, config.vocab_size, (2, 32)).tolist()
    params = SamplingParams(max_new_tokens=64, temperature=0)
    completions = StaticCacheGenerator(model, engine="fused").generate(prompts, params, [1], 0)
    assert all(len(completion) == 64 for completion in completions)
    _assert_greedy(model, prompts, completions, 0.02)


def _lora(model):
    return randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=32)), std=0.01).eval()


def test_lora_reductions_equal_the_lora_products():
    """The compiled step's multiply-and-sum LoRA form computes what the GEMV form computes."""
    from trl_qerl.rollout.fused_decode import _add_lora_as_reductions, project

    model = _model("qwen2", lora_targets=["q_proj", "v_proj"])
    layer = read_decoder(model).layers[0]
    x = torch.randn(3, 64)
    with_gemv = project(x, layer.qkv)
    bases = project(x, [p.__class__(**{**p.__dict__, "lora": ()}) for p in layer.qkv])
    with_reductions = _add_lora_as_reductions(x, layer.qkv, list(bases))
    for ours, theirs in zip(with_reductions, with_gemv):
        assert torch.allclose(ours, theirs, atol=1e-5)
    assert not torch.allclose(with_gemv[0], bases[0])  # the adapter is not a no-op


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_step_ends_trace_whole(monkeypatch, arch):
    """`decode_inputs` (embedding, the model's rotary module) and `decode_logits` (final norm, LM head) as the
    compiled decode step traces them (``fullgraph``; ``aot_eager`` here, inductor in the CUDA tests): same logits."""
    from trl_qerl.rollout import fused_decode

    model = _model(arch, lora_targets="all-linear")
    spec = read_decoder(model)
    ids, positions = torch.tensor([[5], [9]]), torch.tensor([[3], [7]])
    traced = [torch.compile(f, fullgraph=True, backend="aot_eager")
              for f in (fused_decode.decode_inputs, fused_decode.decode_logits)]  # fmt: skip
    eager_inputs, traced_inputs = fused_decode.decode_inputs(spec, ids, positions), traced[0](spec, ids, positions)
    for ours, theirs in zip(traced_inputs, eager_inputs):
        assert torch.equal(ours, theirs)
    x, delta = eager_inputs[0] * 3, eager_inputs[0] - 1
    assert torch.equal(traced[1](spec, x, delta), fused_decode.decode_logits(spec, x, delta))


@pytest.mark.compile_fallback_expected
@pytest.mark.parametrize("part", ["layer", "ends"])
def test_a_failing_compile_falls_back_to_eager_layers_with_one_warning(monkeypatch, caplog, part):
    """The compiled layer or the compiled ends of the step (`decode_inputs`, `decode_logits`) failing: one warning, then
    the whole step eager (the other part is left eager here too, so that nothing compiles on CPU)."""
    from trl_qerl.rollout import fused_decode

    def broken(*args, **kwargs):
        raise RuntimeError("inductor exploded")

    eager_ends = (fused_decode.decode_inputs, fused_decode.decode_logits)
    monkeypatch.setattr(
        fused_decode, "_compiled_layer", lambda: broken if part == "layer" else fused_decode.decoder_layer
    )
    monkeypatch.setattr(fused_decode, "_compiled_ends", lambda: (broken, broken) if part == "ends" else eager_ends)
    model = _model("llama", lora_targets="all-linear")
    with caplog.at_level(logging.DEBUG, logger="trl_qerl.rollout.fused_decode"):
        ours = _greedy(model, "fused", compile=True)
    assert ours.completion_ids == _greedy(model, "model").completion_ids
    warnings = [r for r in caplog.records if "running it eagerly" in r.message]
    assert len(warnings) == 1 and "inductor exploded" in warnings[0].message and warnings[0].levelno == logging.WARNING
    # the whole error, for the frame dynamo stopped at, one level down
    (full,) = [r for r in caplog.records if r.levelno == logging.DEBUG and "compile error in full" in r.message]
    assert full.exc_info[1] is not None and "inductor exploded" in str(full.exc_info[1])


def test_switching_the_active_adapter_is_seen_by_the_next_rollout():
    model = _model("qwen2", lora_targets="all-linear")
    model.add_adapter("other", nvfp4_lora_config(r=4, train_norms=False))
    generator = StaticCacheGenerator(model, cuda_graph=False, engine="fused")
    first = generator.generate(PROMPTS, GREEDY, [1], 0)
    model.set_adapter("other")  # lora_B of a fresh adapter is zero: the base model's tokens
    assert generator.generate(PROMPTS, GREEDY, [1], 0) == _greedy(model, "model").completion_ids != first


def test_trainer_config_chooses_the_engine(tmp_path):
    from trl_qerl.config import QeRLConfig
    from trl_qerl.rollout import make_rollout_backend

    with pytest.raises(ValueError, match="fast_rollout_engine"):
        QeRLConfig(output_dir=str(tmp_path), fast_rollout_engine="vllm", report_to="none")
    args = QeRLConfig(output_dir=str(tmp_path), fast_rollout_engine="model", fast_rollout_compile=False,
                      fast_rollout_twiddled_decode=False, report_to="none", use_cpu=True)  # fmt: skip

    class Trainer:  # what make_rollout_backend reads
        pass

    trainer = Trainer()
    trainer.args = args
    backend = make_rollout_backend("fast", trainer)
    assert (backend.engine, backend.compile, backend.twiddled_decode) == ("model", False, False)
    assert QeRLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True).fast_rollout_twiddled_decode is None


def test_the_compile_options_exist_in_this_torch():
    """An inductor option renamed by a torch release would make every compile fail (then eager layers, slower):
    caught here first, on the torch that CI installs."""
    import torch._inductor.config as inductor_config

    from trl_qerl.rollout.fused_decode import COMPILE_OPTIONS

    assert COMPILE_OPTIONS["emulate_precision_casts"] and COMPILE_OPTIONS["combo_kernels"]
    for name in COMPILE_OPTIONS:
        assert hasattr(inductor_config, name), name
