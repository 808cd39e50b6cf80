"""Tiny random Llama/Qwen2/Qwen3 models built offline (no Hub access), shared by the tests."""

from __future__ import annotations

import os
import socket

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.bfloat16, **overrides):
    """A randomly initialised tiny causal LM (weights scaled up so quantisation error is visible, not noise)."""
    config_class, model_class = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = model_class(config_class(**{**TINY, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0.0, 0.08)
    return model.to(dtype).eval()


def tiny_nvfp4_lora_model(dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """`tiny_model("qwen2")` quantised to NVFP4 with LoRA r4 on every linear layer, its B matrices non-zero (a
    non-trivial adapter), in eval mode on ``device``."""
    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model

    model = get_peft_model(quantize_model(tiny_model("qwen2", dtype=dtype)), nvfp4_lora_config(r=4))
    return randomize_lora_b(model).to(device).eval()


def randomize_lora_b(model, std: float = 0.05):
    """Draw every LoRA B matrix from N(0, std) in place (PEFT starts them at zero, where an adapter changes
    nothing and a test of it would pass vacuously); returns ``model``."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)
    return model


def random_tokens(batch: int = 2, length: int = 9, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def tiny_tokenizer():
    """The shipped tiny-task tokenizer (byte-level BPE with a chat template), loaded offline."""
    from transformers import AutoTokenizer

    from trl_qerl.data import tiny_assets

    return AutoTokenizer.from_pretrained(tiny_assets(), padding_side="left")


def tiny_chat_checkpoint(path, arch: str = "qwen2", seed: int = 0, **overrides):
    """Save a random tiny model whose vocabulary and special tokens match `tiny_tokenizer`; returns the path."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(arch, seed=seed, vocab_size=len(tokenizer), **overrides)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def free_port() -> int:
    """A free TCP port on the loopback interface (for 2-process gloo tests)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def record_calls(monkeypatch, module, names) -> dict[str, bool]:
    """Wraps each function ``module.<name>`` so that a call sets its name as a key of the returned dict. Safe inside a
    compiled step: dynamo replays the recorded mutation on every step, and setting the same keys keeps the dict's
    length, where a growing list would fail dynamo's guard and recompile each step until the limit makes the step
    eager (a test of the fused shrinks did, unseen until the conftest guard)."""
    calls: dict[str, bool] = {}
    for name in names:
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name: calls.update({_n: True}) or _o(*a))
    return calls


def assert_first_draws_agree(ours, theirs, draws: int = 3) -> None:
    """Greedy samples of a compiled step against a reference: each completion's first ``draws`` tokens equal and their
    log-probs within 0.05 (later tokens may flip at a near-tie: the products' fp32 sums run in another order)."""
    for our_ids, their_ids, our_logprobs, their_logprobs in zip(
        ours.completion_ids, theirs.completion_ids, ours.logprobs, theirs.logprobs
    ):
        assert our_ids[:draws] == their_ids[:draws]
        assert torch.allclose(torch.tensor(our_logprobs[:draws]), torch.tensor(their_logprobs[:draws]), atol=0.05)


def fused_samples_with_and_without(
    monkeypatch, setting: str, recorded: tuple[str, ...], device: str = "cuda", compile: bool = True,
    arch: str = "qwen2", rank: int = 16, prompts: list[list[int]] | None = None, decode_attention: str = "auto",
):  # fmt: skip
    """Greedy samples (6 tokens) from the fused engine (compiled and, on CUDA, captured if ``compile``) on a tiny NVFP4
    ``arch`` model with LoRA of ``rank`` (random B), with ``fused_decode.<setting>`` True and then False. Asserts that
    some function ``fused_decode.<name>`` of ``recorded`` was called (inside the compiled step) exactly when it was
    True. Returns ``({True: samples, False: samples}, names called while True)``. ``prompts``: 20 short ones by
    default; ``decode_attention``: the generator's."""
    from trl_qerl.lora import get_peft_model, nvfp4_lora_config
    from trl_qerl.quantizer import quantize_model
    from trl_qerl.rollout import fused_decode
    from trl_qerl.rollout.fast import SamplingParams, StaticCacheGenerator

    if compile:
        torch._dynamo.reset()  # this test's recompiles (one per setting) must not meet earlier tests' at dynamo's limit
    torch.manual_seed(0)
    model = quantize_model(tiny_model(arch, dtype=torch.bfloat16).to(device))
    model = randomize_lora_b(get_peft_model(model, nvfp4_lora_config(model, r=rank))).eval()
    calls = record_calls(monkeypatch, fused_decode, recorded)
    prompts = prompts if prompts is not None else [[5 + i % 7, 6, 7 + i % 3] for i in range(20)]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    samples, called = {}, []
    for on in (True, False):
        monkeypatch.setattr(fused_decode, setting, on)
        generator = StaticCacheGenerator(
            model, engine="fused", cuda_graph=compile and device == "cuda", compile=compile,
            decode_attention=decode_attention,
        )  # fmt: skip
        samples[on] = generator.sample(prompts, params, eos_token_ids=[], pad_token_id=0)
        assert bool(calls) == on, f"{recorded} {'not ' if on else ''}called with {setting}={on}"
        if on:
            called = list(calls)
        calls.clear()
    return samples, called
