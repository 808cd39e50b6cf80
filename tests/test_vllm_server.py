"""The rollout server's hardening (issue 13): timeouts, body limits and typed validation, over real HTTP with a
stand-in engine. Every request refused here must never reach the engine."""

import json
import socket
import threading
import time

import pytest
import torch
from safetensors.torch import save as save_safetensors
from safetensors.torch import save_file

from trl_qerl.rollout.vllm_client import ServerError, VLLMServerClient
from trl_qerl.rollout.vllm_server import (
    RolloutService,
    bind_warning,
    checkpoint_norm_shapes,
    make_server,
    parse_args,
)


VOCAB = 100
NORMS = {"model.norm.weight": (8,), "model.layers.0.input_layernorm.weight": (8,)}


class StandInEngine:
    def __init__(self):
        self.calls = []

    def load_adapter(self, path):
        self.calls.append(("adapter", path))

    def set_norms(self, values):
        self.calls.append(("norms", dict(values)))

    def generate(self, prompt_ids, sampling):
        self.calls.append(("generate", prompt_ids, sampling))
        length = sampling.get("max_tokens", 2)
        return [[ids[-1]] * length for ids in prompt_ids], [[-0.5] * length for _ in prompt_ids]


def _start(tmp_path, api_key=None, max_body=1 << 20, norm_shapes=NORMS, timeout=0.5):
    adapters = tmp_path / "adapters"
    adapters.mkdir(exist_ok=True)
    engine = StandInEngine()
    service = RolloutService(engine, adapters, {"max_lora_rank": 16}, vocab_size=VOCAB, max_model_len=64,
                             norm_shapes=norm_shapes)  # fmt: skip
    http = make_server(service, "127.0.0.1", 0, max_body=max_body, timeout=timeout, api_key=api_key)
    threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return http, engine, adapters


@pytest.fixture
def server(tmp_path):
    http, engine, adapters = _start(tmp_path)
    yield http, engine, adapters, VLLMServerClient(f"http://127.0.0.1:{http.server_port}", timeout=3, api_key="")
    http.shutdown()
    http.server_close()


def _read_all(sock) -> bytes:
    answer = b""
    while chunk := sock.recv(65536):  # the server closes the connection after each answer
        answer += chunk
    return answer


def _raw(port, data: bytes, wait: float = 3.0) -> tuple[int, str]:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        sock.sendall(data)
        answer = _read_all(sock)
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[1].decode()


def _post(port, path, body: bytes, extra: str = "") -> tuple[int, str]:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
    return _raw(port, head + body)


def _generate(port, payload) -> tuple[int, str]:
    return _post(port, "/generate", json.dumps(payload).encode())


# -- stalls -------------------------------------------------------------------------------------------------------


def test_an_idle_connection_does_not_stall_other_clients(server):
    http, _, _, client = server
    idle = socket.create_connection(("127.0.0.1", http.server_port))  # connects, never sends a byte
    try:
        start = time.monotonic()
        assert client.generate([[1, 2]], {"max_tokens": 1}) == ([[2]], [[-0.5]])
        assert time.monotonic() - start < 2
    finally:
        idle.close()


def test_a_short_body_times_out_without_stalling_others(server):
    http, engine, _, client = server
    short = socket.create_connection(("127.0.0.1", http.server_port), timeout=3)
    try:
        short.sendall(b'POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt')
        start = time.monotonic()
        assert client.info()["vocab_size"] == VOCAB
        assert time.monotonic() - start < 2
        answer = _read_all(short)  # the server gives up after its 0.5 s timeout
        assert b" 408 " in answer.split(b"\r\n")[0] and b"body bytes still to come" in answer
    finally:
        short.close()
    assert engine.calls == []


@pytest.mark.parametrize(
    ("length", "status", "message"),
    [("-1", 400, "non-negative integer"), ("abc", 400, "non-negative integer"), ("1e3", 400, "non-negative"),
     (None, 411, "needs a Content-Length"), (str(2 << 20), 413, "--max-body-mb")],
)  # fmt: skip
def test_content_length_is_validated(server, length, status, message):
    http, engine, _, _ = server
    header = "" if length is None else f"Content-Length: {length}\r\n"
    got, body = _raw(http.server_port, f"POST /generate HTTP/1.1\r\nHost: x\r\n{header}\r\n".encode() + b"{}")
    assert got == status and message in body
    assert engine.calls == []


def test_chunked_bodies_are_refused(server):
    http, *_ = server
    data = b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    assert _raw(http.server_port, data)[0] == 411


def test_a_body_shorter_than_its_length_and_closed_is_400(server):
    http, engine, *_ = server
    with socket.create_connection(("127.0.0.1", http.server_port), timeout=3) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{}")
        sock.shutdown(socket.SHUT_WR)
        answer = _read_all(sock)
    assert b" 400 " in answer.split(b"\r\n")[0] and b"short of its Content-Length" in answer
    assert engine.calls == []


# -- JSON ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [(b'{"prompt_ids": [[1]], "x": "\xff\xfe"}', "not UTF-8"), (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
     (b'{"prompt_ids": [[1]], "sampling": {"temperature": NaN}}', "NaN"), (b"[1]", "JSON object"),
     (b'{"prompt_ids": ' + b"[" * 500 + b"1" + b"]" * 500 + b"}", "prompt_ids"),
     (b'{"prompt_ids": [[1]], "extra": 1}', "remove ['extra']")],
)  # fmt: skip
def test_bad_json_is_400(server, body, message):
    http, engine, *_ = server
    status, answer = _post(http.server_port, "/generate", body)
    assert status == 400 and message in json.loads(answer)["error"]
    assert engine.calls == []


# -- prompt ids and sampling --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_ids", "message"),
    [([[True, 2]], "integer token ids"), ([[-1]], "outside the vocabulary"), ([[VOCAB]], "[0, 100)"),
     ([[1.0]], "integer token ids"), ([["1"]], "integer token ids"), ([], "non-empty"), ([[]], "non-empty"),
     ([[1] * 64], "max length is 64"), ("rm -rf", "prompt_ids must be")],
)  # fmt: skip
def test_prompt_ids_are_checked(server, prompt_ids, message):
    http, engine, *_ = server
    status, answer = _generate(http.server_port, {"prompt_ids": prompt_ids})
    assert status == 400 and message in json.loads(answer)["error"]
    assert engine.calls == []


@pytest.mark.parametrize(
    ("sampling", "message"),
    [({"temperature": "hot"}, "finite number"), ({"max_tokens": 10**12}, "max length"), ({"max_tokens": 0}, "outside"),
     ({"max_tokens": 2.0}, "integer"), ({"max_tokens": True}, "integer"), ({"top_p": 0}, "outside (0.0, 1.0]"),
     ({"top_p": 1.5}, "outside"), ({"temperature": -1}, "outside"), ({"top_k": -2}, "outside"),
     ({"top_k": VOCAB + 1}, "outside"), ({"ignore_eos": "yes"}, "true or false"), ({"seed": 2**64}, "outside"),
     ({"stop_token_ids": [VOCAB]}, "outside the vocabulary"), ({"stop_token_ids": "0"}, "list of token ids"),
     ({"min_tokens": 5, "max_tokens": 2}, "must not exceed"), ({"logits_processors": ["os.system"]}, "unsupported"),
     ("fast", "JSON object")],
)  # fmt: skip
def test_sampling_values_are_typed(server, sampling, message):
    http, engine, *_ = server
    status, answer = _generate(http.server_port, {"prompt_ids": [[1]], "sampling": sampling})
    assert status == 400 and message in json.loads(answer)["error"]
    assert engine.calls == []


def test_valid_sampling_reaches_the_engine(server):
    _, engine, _, client = server
    sampling = {"temperature": 1, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_tokens": 3, "seed": None,
                "repetition_penalty": 1.0, "stop_token_ids": [0], "ignore_eos": False, "min_tokens": 1}  # fmt: skip
    assert client.generate([[VOCAB - 1], [0]], sampling)[0] == [[VOCAB - 1] * 3, [0] * 3]
    assert engine.calls == [("generate", [[VOCAB - 1], [0]], sampling)]


# -- norms --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [({"model.norm.weight": torch.tensor([float("nan")] * 8)}, "NaN or infinite"),
     ({"model.norm.weight": torch.full((8,), float("inf"))}, "NaN or infinite"),
     ({"model.norm.weight": torch.ones(8, dtype=torch.int64)}, "dtype torch.int64"),
     ({"model.norm.weight": torch.ones(8, dtype=torch.float64)}, "dtype torch.float64"),
     ({"model.norm.weight": torch.ones(9)}, "shape (8,)"),
     ({"lm_head.weight": torch.ones(8)}, "not a norm weight"), ({}, "no tensors")],
)  # fmt: skip
def test_norms_must_be_finite_float_known_and_shaped(server, values, message):
    _, engine, _, client = server
    with pytest.raises(ServerError, match="HTTP 400") as error:
        client._request("POST", "/norms", save_safetensors(values), "application/octet-stream")
    assert message in str(error.value)
    assert engine.calls == []


def test_norms_without_known_shapes_still_need_norm_names(tmp_path):
    http, engine, _ = _start(tmp_path, norm_shapes=None)
    try:
        client = VLLMServerClient(f"http://127.0.0.1:{http.server_port}", timeout=3, api_key="")
        with pytest.raises(ServerError, match="not a norm weight name"):
            client.set_norms({"model.embed_tokens.weight": torch.ones(8)})
        with pytest.raises(ServerError, match="1-D"):
            client.set_norms({"model.norm.weight": torch.ones(2, 2)})
        client.set_norms({"model.layers.3.post_attention_layernorm.weight": torch.ones(16, dtype=torch.bfloat16)})
        assert [call[0] for call in engine.calls] == ["norms"]
    finally:
        http.shutdown()
        http.server_close()


def test_valid_norms_reach_the_engine(server):
    _, engine, _, client = server
    client.set_norms({name: torch.ones(shape) for name, shape in NORMS.items()})
    assert engine.calls[0][0] == "norms" and set(engine.calls[0][1]) == set(NORMS)


def test_norm_shapes_come_from_the_checkpoint_headers(tmp_path):
    save_file({"model.norm.weight": torch.ones(8), "model.layers.0.self_attn.q_norm.weight": torch.ones(4),
               "model.embed_tokens.weight": torch.ones(3, 8), "lm_head.weight": torch.ones(3)},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    assert checkpoint_norm_shapes(tmp_path) == {
        "model.norm.weight": (8,),
        "model.layers.0.self_attn.q_norm.weight": (4,),
    }
    assert checkpoint_norm_shapes(tmp_path / "none") is None


# -- adapters -----------------------------------------------------------------------------------------------------


def _adapter(path):
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"x")


@pytest.mark.parametrize("linked", ["adapter_model.safetensors", "adapter_config.json", "extra.bin"])
def test_adapter_files_may_not_be_symlinks(server, tmp_path, linked):
    _, engine, adapters, client = server
    secret = tmp_path / "secret"
    secret.write_text("{}")
    _adapter(adapters / "step-1")
    target = adapters / "step-1" / linked
    target.unlink(missing_ok=True)
    target.symlink_to(secret)
    with pytest.raises(ServerError, match="HTTP 400.*symlink"):
        client.load_adapter(str(adapters / "step-1"))
    assert engine.calls == []


def test_plain_adapters_still_load(server):
    _, engine, adapters, client = server
    _adapter(adapters / "step-2")
    client.load_adapter(str(adapters / "step-2"))
    assert engine.calls == [("adapter", str(adapters.resolve() / "step-2"))]


# -- binding and authentication -----------------------------------------------------------------------------------


def test_binding_beyond_loopback_without_a_key_warns():
    assert "WITHOUT AUTHENTICATION" in bind_warning("0.0.0.0", None)
    assert "WITHOUT AUTHENTICATION" in bind_warning("10.1.2.3", "")
    assert "WITHOUT AUTHENTICATION" in bind_warning("example.org", None)
    assert all(bind_warning(host, None) is None for host in ("127.0.0.1", "127.0.0.5", "::1", "localhost"))
    assert bind_warning("0.0.0.0", "s3cret") is None


def test_cli_flags(monkeypatch):
    monkeypatch.setenv("TRL_QERL_VLLM_API_KEY", "from-env")
    args = parse_args(["--model", "m"])
    assert (args.api_key, args.max_body_mb, args.request_timeout) == ("from-env", 64, 10.0)
    args = parse_args(["--model", "m", "--api-key", "k", "--max-body-mb", "8", "--request-timeout", "2.5"])
    assert (args.api_key, args.max_body_mb, args.request_timeout) == ("k", 8.0, 2.5)
    with pytest.raises(SystemExit):
        parse_args(["--model", "m", "--max-body-mb", "-1"])


def test_api_key_is_required_when_set(tmp_path, monkeypatch):
    http, engine, _ = _start(tmp_path, api_key="s3cret")
    try:
        url = f"http://127.0.0.1:{http.server_port}"
        assert _raw(http.server_port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
        for key in ("", "wrong", "s3cret2"):
            with pytest.raises(ServerError, match="HTTP 401"):
                VLLMServerClient(url, timeout=3, api_key=key).generate([[1]], {"max_tokens": 1})
        status, _ = _post(http.server_port, "/generate", b'{"prompt_ids": [[1]]}', "Authorization: Bearer wrong\r\n")
        assert status == 401 and engine.calls == []
        monkeypatch.setenv("TRL_QERL_VLLM_API_KEY", "s3cret")
        assert VLLMServerClient(url, timeout=3).generate([[1]], {"max_tokens": 1})[0] == [[1]]
    finally:
        http.shutdown()
        http.server_close()
