"""The vLLM backend against a real vLLM engine (vllm-cpu 0.32 on CPU, float32): our NVFP4 checkpoint with LoRA
hot-swapped by new ids, trained norms and AQN noise written into vLLM's own layers, greedy outputs token for token
equal to our model's; then QeRL training with colocated and server rollouts.

Runs only where vLLM is installed (`make test-vllm` builds that environment; .ci/run calls it)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


vllm = pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trl_qerl import from_pretrained  # noqa: E402
from trl_qerl.config import QeRLConfig  # noqa: E402
from trl_qerl.data import tiny_arithmetic_dataset, tiny_assets  # noqa: E402
from trl_qerl.lora import get_peft_model, nvfp4_lora_config  # noqa: E402
from trl_qerl.noise import NormNoise  # noqa: E402
from trl_qerl.norms import active_module  # noqa: E402
from trl_qerl.rewards import accuracy_reward  # noqa: E402
from trl_qerl.rollout.vllm_checkpoint import norm_state, save_base_checkpoint, save_vllm_adapter  # noqa: E402
from trl_qerl.rollout.vllm_client import VLLMServerClient  # noqa: E402
from trl_qerl.rollout.vllm_engine import VLLMEngine  # noqa: E402
from trl_qerl.rollout.vllm_norms import DEFAULT_FP32_NORMS, fp32_norm_names  # noqa: E402
from trl_qerl.trainer import QeRLGRPOTrainer  # noqa: E402


if not torch.cuda.is_available():
    sys.path.insert(0, str(Path(__file__).parent))
    import nvfp4_cpu_kernel  # noqa: E402

    nvfp4_cpu_kernel.install()

QUESTIONS = ["Tom has 3 apples and buys 4 more. How many apples does he have?", "What is 12 + 7 - 5?",
             "A box holds 6 pens. How many pens are in 3 boxes?"]  # fmt: skip
ENGINE = dict(dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=8, seed=0)


pytestmark = pytest.mark.usefixtures("quiet_warnings")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tiny_assets(), padding_side="left")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
            for q in QUESTIONS]  # fmt: skip


def _with_trained_adapter(model, seed: int = 0):
    """LoRA (r=8) and trained norms moved far enough from their initial values to change greedy outputs."""
    torch.manual_seed(seed)  # lora_A's initialisation draws from the global generator: same adapter every run
    peft = get_peft_model(model, nvfp4_lora_config(model, r=8, train_norms=True))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=generator)
            elif "modules_to_save" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=generator))
    return peft.eval()


def greedy(model, prompts, tokenizer, max_new_tokens=24):
    """Our model's greedy completions (float32, one prompt at a time, no padding)."""
    completions = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)  # fmt: skip
        completions.append(output[0, len(ids) :].tolist())
    return completions


def assert_same_greedy(model, prompts, completions, tokenizer, tie=1e-3):
    """vLLM's greedy ``completions`` are our model's, token for token, except where our top two logits tie.

    Two float32 implementations can break a near-tie differently (the AQN noise makes those likelier); anywhere
    else a difference means the weights, adapter or noise did not arrive.
    """
    ours = greedy(model, prompts, tokenizer)
    for ids, theirs, mine in zip(prompts, completions, ours):
        if theirs == mine:
            continue
        split = next(i for i, (a, b) in enumerate(zip([*theirs, None], [*mine, None])) if a != b)
        assert split < min(len(theirs), len(mine)), f"one completion is a prefix of the other: {theirs} vs {mine}"
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids + mine[:split]])).logits[0, -1]
        gap = (logits[mine[split]] - logits[theirs[split]]).abs().item()
        where = f"vLLM chose token {theirs[split]} at position {split}, we chose {mine[split]}"
        assert gap <= tie * logits.abs().max().item(), where


def _largest_difference(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def sampling(tokenizer):
    return dict(temperature=0.0, max_tokens=24, stop_token_ids=[tokenizer.eos_token_id])


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory, tokenizer):
    """(our NVFP4 PeftModel, a VLLMEngine on its exported base, adapter directory root)."""
    root = tmp_path_factory.mktemp("nvfp4")
    peft = _with_trained_adapter(from_pretrained(tiny_assets(), dtype=torch.float32))
    save_base_checkpoint(peft, root / "base", tokenizer=tokenizer)
    engine = VLLMEngine(root / "base", max_lora_rank=8, **ENGINE)
    yield peft, engine, root
    del engine


def test_nvfp4_checkpoint_in_vllm_matches_our_model(nvfp4, prompts, tokenizer):
    peft, engine, _ = nvfp4
    layer = engine.llm.apply_model(lambda model: type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__)
    assert layer == ["CompressedTensorsLinearMethod"]  # vLLM runs the NVFP4 weights, not a 16-bit copy
    completions, logprobs = engine.generate(prompts, sampling(tokenizer))
    with peft.disable_adapter():
        assert_same_greedy(peft, prompts, completions, tokenizer)
    assert all(len(lp) == len(ids) and all(v <= 0 for v in lp) for lp, ids in zip(logprobs, completions))


def test_adapter_and_trained_norms_reach_vllm_without_merging(nvfp4, prompts, tokenizer):
    peft, engine, root = nvfp4
    before, _ = engine.generate(prompts, sampling(tokenizer))
    engine.load_adapter(str(save_vllm_adapter(peft, root / "adapter-1")))
    first = engine.adapter.lora_int_id
    engine.set_norms(norm_state(peft))
    after, _ = engine.generate(prompts, sampling(tokenizer))
    assert after != before
    assert_same_greedy(peft, prompts, after, tokenizer)
    # a changed adapter under a new id is picked up at once; the old id is dropped
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.mul_(-1.0)
    engine.load_adapter(str(save_vllm_adapter(peft, root / "adapter-2")))
    assert engine.adapter.lora_int_id == first + 1 and engine.llm.llm_engine.list_loras() == {first + 1}
    flipped, _ = engine.generate(prompts, sampling(tokenizer))
    assert flipped != after
    assert_same_greedy(peft, prompts, flipped, tokenizer)


def test_aqn_noise_changes_vllm_generation_and_sigma_zero_restores_it(nvfp4, prompts, tokenizer):
    peft, engine, root = nvfp4
    engine.load_adapter(str(save_vllm_adapter(peft, root / "adapter-3")))
    engine.set_norms(norm_state(peft))
    clean, clean_logprobs = engine.generate(prompts, sampling(tokenizer))
    noise = NormNoise(peft, seed=0)
    for sigma in (0.05, 0.2):
        with noise.rollout(sigma):
            engine.set_norms(norm_state(peft))
            noisy, noisy_logprobs = engine.generate(prompts, sampling(tokenizer))
            # the noise reached vLLM's own RMSNorm layers: other tokens, or (a confident model may keep its greedy
            # tokens under small noise) clearly other log-probs for them
            moved = noisy != clean or _largest_difference(noisy_logprobs, clean_logprobs) > 1e-3
            assert moved, sigma
            assert_same_greedy(peft, prompts, noisy, tokenizer)  # ... exactly as it perturbs our model
    with noise.rollout(0.0):
        engine.set_norms(norm_state(peft))
        assert engine.generate(prompts, sampling(tokenizer))[0] == clean
    engine.set_norms(norm_state(peft))  # after the rollout: the clean weights, bit for bit
    assert engine.generate(prompts, sampling(tokenizer))[0] == clean


def test_bf16_base_with_lora(tmp_path, prompts, tokenizer, nvfp4):
    """The 16-bit LoRA baseline through the same path (float32 here)."""
    peft = _with_trained_adapter(AutoModelForCausalLM.from_pretrained(tiny_assets(), dtype=torch.float32), seed=1)
    save_base_checkpoint(peft, tmp_path / "base", tokenizer=tokenizer)
    engine = VLLMEngine(tmp_path / "base", max_lora_rank=8, **ENGINE)
    engine.load_adapter(str(save_vllm_adapter(peft, tmp_path / "adapter")))
    engine.set_norms(norm_state(peft))
    assert_same_greedy(peft, prompts, engine.generate(prompts, sampling(tokenizer))[0], tokenizer)


# -- AQN at the end of the schedule (σ = 1e-4) in a bf16 engine: fp32 norm weights, the product rounded once ------


@pytest.fixture(scope="module")
def bf16(tmp_path_factory, tokenizer):
    """(our bf16 NVFP4 PeftModel, its NormNoise, a bf16 VLLMEngine holding the norms NormNoise perturbs in fp32).

    The trained norms are bf16 values (the model is bf16) held in fp32 masters by `NormNoise`: every element of a
    σ = 1e-4 draw is far below half a bf16 step of these weights (0.3 to 1.3), so a bf16 copy would drop all of it."""
    root = tmp_path_factory.mktemp("bf16")
    peft = _with_trained_adapter(from_pretrained(tiny_assets(), dtype=torch.bfloat16))
    noise = NormNoise(peft, seed=0)
    save_base_checkpoint(peft, root / "base", tokenizer=tokenizer)
    fp32_norms = fp32_norm_names(norm_state(peft))
    engine = VLLMEngine(root / "base", max_lora_rank=8, fp32_norms=fp32_norms, **{**ENGINE, "dtype": "bfloat16"})
    engine.load_adapter(str(save_vllm_adapter(peft, root / "adapter")))
    engine.set_norms(norm_state(peft))
    yield peft, noise, engine
    del engine


def test_vllm_holds_the_noisy_norms_in_fp32_and_the_others_as_loaded(bf16):
    peft, _, engine = bf16
    sent = {key: value.dtype for key, value in norm_state(peft).items()}
    held = engine.llm.apply_model(lambda model: {n: p.dtype for n, p in model.named_parameters() if "norm" in n})[0]
    assert held == sent  # AQN targets (= trained norms) fp32; model.norm, neither trained nor perturbed, bf16
    assert sorted({key.split(".")[-2] for key, dtype in sent.items() if dtype == torch.float32}) == sorted(
        DEFAULT_FP32_NORMS[:2]
    )


def test_noisy_norm_output_is_the_fp32_product_rounded_once(bf16):
    peft, noise, engine = bf16
    vllm_model = engine.llm.apply_model(lambda model: model)[0]  # in-process engine: the model object itself
    key = "model.layers.1.post_attention_layernorm.weight"
    layer = vllm_model.model.layers[1].post_attention_layernorm
    ours = active_module(peft.base_model.model.model.layers[1].post_attention_layernorm)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(7, layer.weight.numel(), generator=generator).to(torch.bfloat16)
    residual = torch.randn(x.shape, generator=generator).to(torch.bfloat16)
    clean = norm_state(peft)[key].clone()  # norm_state hands out the live weights
    with torch.no_grad(), noise.rollout(1e-4):
        values = norm_state(peft)
        engine.set_norms(values)
        noisy = values[key].clone()
        assert noisy.dtype == torch.float32 and 0 < (noisy - clean).abs().max() < 1e-3
        assert torch.equal(layer.weight, noisy)  # vLLM holds the fp32 noisy weight, every bit of it
        out = layer(x)
        fused_out, fused_residual = layer(x.clone(), residual.clone())  # vLLM's fused residual-add variant
        trainer_out = ours(x)
    with torch.no_grad():
        engine.set_norms(norm_state(peft))
        clean_out = layer(x)

    def rounded_once(h, weight):
        h = h.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon) * weight).to(x.dtype)

    assert out.dtype == fused_out.dtype == torch.bfloat16  # bf16 activations go on to the NVFP4 projections
    assert torch.equal(out, rounded_once(x, noisy))
    summed = x.float() + residual.float()
    assert torch.equal(fused_out, rounded_once(summed, noisy)) and torch.equal(fused_residual, summed.to(x.dtype))
    # the trainer's norm (fp32 master + noise, product rounded once) agrees within one bf16 step: it rounds the
    # normalised input to bf16 before the product, vLLM keeps it in fp32
    torch.testing.assert_close(out, trainer_out, rtol=2**-7, atol=1e-5)
    changed = (out != clean_out).float().mean().item()
    assert changed > 0.005, changed  # σ = 1e-4 reaches the output (about σ/w of a bf16 step: ~1-3 % of elements)
    # the former write path, a bf16 weight, would have dropped the whole draw
    assert torch.equal(noisy.to(torch.bfloat16), clean.to(torch.bfloat16))


def test_a_norm_held_in_bf16_loses_small_noise(bf16, caplog):
    """What every norm did before: `model.norm` stays bf16 (not trained, not perturbed); fp32 noise written into
    it rounds away entirely, and the write says so."""
    peft, _, engine = bf16
    clean = norm_state(peft)["model.norm.weight"].clone()
    noisy = clean.float() + 1e-4 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(1))
    with caplog.at_level("WARNING", logger="trl_qerl.rollout.vllm_engine"):
        engine.set_norms({"model.norm.weight": noisy})
    held = engine.llm.apply_model(lambda model: model.model.norm.weight.detach().clone())[0]
    assert held.dtype == torch.bfloat16 and torch.equal(held, clean)
    assert "model.norm.weight" in caplog.text
    engine.set_norms(norm_state(peft))


def test_sigma_1e4_changes_vllm_rollouts_and_sigma_zero_is_the_clean_engine(bf16, prompts, tokenizer):
    peft, noise, engine = bf16
    options = {**sampling(tokenizer), "max_tokens": 8}  # a few tokens show it; bf16 NVFP4 decoding on CPU is slow
    engine.set_norms(norm_state(peft))
    clean = engine.generate(prompts, options)
    with noise.rollout(1e-4):
        engine.set_norms(norm_state(peft))
        noisy = engine.generate(prompts, options)
    assert noisy != clean  # tokens or log-probs: the smallest σ of the schedule reaches vLLM's rollouts
    with noise.rollout(0.0):
        engine.set_norms(norm_state(peft))
        assert engine.generate(prompts, options) == clean  # bit for bit: ids and log-probs


def test_fp32_norms_under_torch_compile_take_in_place_writes(tmp_path, tokenizer, monkeypatch):
    """The fp32 weights exist before vLLM traces and compiles the model (Dynamo + Inductor here; on a GPU the same
    compiled graph is captured into CUDA graphs), and later writes go into the same storage: the compiled model sees
    a σ = 1e-4 draw and gives the clean outputs back bit for bit, with no recompilation. vLLM on CPU compiles only
    without LoRA, so this builds a plain ``vllm.LLM`` with our load format."""
    from vllm import LLM, SamplingParams

    from trl_qerl.rollout.vllm_engine import copy_parameters
    from trl_qerl.rollout.vllm_norms import loader_options, register_loader

    AutoModelForCausalLM.from_pretrained(tiny_assets(), dtype=torch.bfloat16).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as VLLMEngine runs it
    register_loader()
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=128, max_num_seqs=2, skip_tokenizer_init=True, seed=0,
              compilation_config={"mode": 3}, **loader_options(DEFAULT_FP32_NORMS, {}))  # fmt: skip
    assert llm.llm_engine.vllm_config.compilation_config.backend == "inductor"
    model = llm.apply_model(lambda m: m)[0]
    key = "model.layers.0.input_layernorm.weight"
    weight = model.get_parameter(key)
    assert weight.dtype == torch.float32 and model.get_parameter("model.norm.weight").dtype == torch.bfloat16
    storage, clean = weight.data_ptr(), weight.detach().clone()
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)

    def run(values):
        copy_parameters(model, values)
        llm.reset_prefix_cache()
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 9, 11]}], params, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]

    base = run({key: clean})
    noise = 1e-4 * torch.randn(clean.shape, generator=torch.Generator().manual_seed(0))
    assert run({key: clean + noise}) != base
    assert run({key: clean}) == base and weight.data_ptr() == storage


def _trainer_args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=24, report_to="none", logging_steps=1, lora_r=8, learning_rate=1e-3,
        save_strategy="no", use_cpu=True, seed=0, use_vllm=True, vllm_enforce_eager=True, vllm_max_model_length=256,
        aqn_schedule="constant", aqn_sigma_start=0.05, aqn_num_stages=2, temperature=1.0,
        vllm_engine_kwargs={"max_num_batched_tokens": 512}, rollout_importance_sampling=True,
    )  # fmt: skip
    settings.update(overrides)
    return QeRLConfig(**settings)


def test_training_with_colocated_vllm_rollouts(tmp_path):
    args = _trainer_args(tmp_path)
    trainer = QeRLGRPOTrainer(tiny_assets(), reward_funcs=accuracy_reward, args=args,
                              train_dataset=tiny_arithmetic_dataset("train", limit=32))  # fmt: skip
    assert type(trainer.rollout_backend.engine).__name__ == "VLLMEngine"
    # vLLM loaded the norms the trainer sends in fp32 (the trained, noisy ones) as fp32
    load_config = trainer.rollout_backend.llm.llm_engine.vllm_config.load_config
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert load_config.load_format == "qerl-fp32-norms"
    assert load_config.model_loader_extra_config["fp32_norms"] == fp32_norm_names(norm_state(model))
    trainer.train()
    assert trainer.rollout_backend.engine.adapter.lora_int_id == 2  # one adapter per optimizer step
    logs = trainer.state.log_history
    # sampled by vLLM under NVFP4 + noise, scored by the trained policy: the logged mismatch stays small
    assert all(0 <= log["sampling/sampling_logp_difference/mean"] < 0.5 for log in logs[:2])
    assert logs[1]["aqn/sigma"] == 0.05 and logs[0]["completions/mean_length"] > 0


def test_training_with_a_rollout_server(tmp_path, tokenizer):
    checkpoint = tmp_path / "nvfp4"
    from_pretrained(tiny_assets(), dtype=torch.float32).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    command = [sys.executable, "-c", SERVE, "--model", str(checkpoint), "--port", "0", "--dtype", "float32",
               "--max-lora-rank", "8", "--max-model-len", "256", "--enforce-eager", "--max-num-seqs", "8",
               "--adapter-dir", str(tmp_path / "adapters")]  # fmt: skip
    log = tmp_path / "server.log"
    with open(log, "w") as output:
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = _wait_for_url(server, log)
        client = VLLMServerClient(url)
        assert client.info()["quantization"] == "nvfp4" and client.info()["adapter_dir"] == str(tmp_path / "adapters")
        assert client.info()["fp32_norms"] == list(DEFAULT_FP32_NORMS)
        args = _trainer_args(tmp_path, vllm_mode="server", vllm_server_base_url=url)
        trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=accuracy_reward, args=args,
                                  train_dataset=tiny_arithmetic_dataset("train", limit=32))  # fmt: skip
        trainer.train()
        assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["step-1"]
        assert trainer.state.log_history[0]["sampling/sampling_logp_difference/mean"] < 0.5
    finally:
        server.terminate()
        server.wait(timeout=30)


# `trl-qerl vllm-serve` with the test-only CPU NVFP4 kernel installed first (the real command has none on CPU).
SERVE = "import sys, nvfp4_cpu_kernel; nvfp4_cpu_kernel.install(); from trl_qerl.cli import main; sys.exit(main(['vllm-serve', *sys.argv[1:]]))"


def _wait_for_url(server, log: Path, timeout: float = 240) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline and server.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("trl-qerl vllm-serve:"):
                return line.split(" on ", 1)[1].split(",", 1)[0]
        time.sleep(0.5)
    raise RuntimeError("the rollout server did not start:\n" + "\n".join(log.read_text().splitlines()[-30:]))
