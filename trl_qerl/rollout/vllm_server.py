"""``trl-qerl vllm-serve``: a rollout server for multi-GPU training (N training GPUs + 1 rollout GPU).

It runs one `VLLMEngine` and answers five requests over HTTP, JSON or raw safetensors only (nothing pickled):

* ``GET /health``, ``GET /info`` (model, LoRA limit, adapter directory, quantisation);
* ``POST /adapter`` ``{"name": ...}``: serve the adapter ``<adapter-dir>/<name>`` from now on (only names of
  directories directly inside the adapter directory the server was started with are accepted);
* ``POST /norms`` (safetensors bytes): write RMSNorm weights (trained values + AQN noise) into vLLM's model (the
  norms named by ``--fp32-norms`` are held in fp32 from load on, so noise below bf16's precision survives);
* ``POST /generate`` ``{"prompt_ids": [[...]], "sampling": {...}}``: completions and their sampled log-probs.

It binds to 127.0.0.1 unless ``--host`` says otherwise. `VLLMServerClient` is the trainer's side.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from .vllm_checkpoint import VLLM_LORA_RANKS, check_vllm_shapes, choose_max_lora_rank
from .vllm_norms import DEFAULT_FP32_NORMS


logger = logging.getLogger(__name__)

_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and the message."""


class RolloutService:
    """The server's logic, independent of HTTP: validates requests and drives the engine.

    Args:
        engine: a `VLLMEngine` (or anything with ``load_adapter``, ``set_norms``, ``generate``).
        adapter_dir: the only directory adapters are read from.
        info: what ``GET /info`` reports.
    """

    def __init__(self, engine, adapter_dir: str | Path, info: dict[str, Any]) -> None:
        self.engine = engine
        self.adapter_dir = Path(adapter_dir).resolve()
        self.info = {**info, "adapter_dir": str(self.adapter_dir), "logprobs_mode": "processed_logprobs"}

    def adapter_path(self, name: Any) -> Path:
        """The adapter directory for ``name``, refusing anything that is not a plain directory inside ours."""
        if not isinstance(name, str) or not _ADAPTER_NAME.match(name):
            raise RequestError(
                f"adapter name {name!r} must be a plain directory name (letters, digits, '.', '_', '-')."
            )
        path = self.adapter_dir / name
        if path.is_symlink() or path.resolve().parent != self.adapter_dir or not path.is_dir():
            raise RequestError(f"no adapter directory {name!r} in {self.adapter_dir}.")
        missing = [file for file in _ADAPTER_FILES if not (path / file).is_file()]
        if missing:
            raise RequestError(f"adapter {name!r} lacks {missing}.")
        return path

    def load_adapter(self, payload: dict[str, Any]) -> dict[str, Any]:
        path = self.adapter_path(payload.get("name"))
        self.engine.load_adapter(str(path))
        return {"adapter": path.name}

    def set_norms(self, body: bytes) -> dict[str, Any]:
        try:
            values = load_safetensors(body)
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's
            raise RequestError(f"the body is not a safetensors payload: {error}") from error
        self.engine.set_norms(values)
        return {"norms": len(values)}

    def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        from .vllm import SAMPLING_KEYS

        prompt_ids = payload.get("prompt_ids")
        if not isinstance(prompt_ids, list) or not all(
            isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids) for ids in prompt_ids
        ):
            raise RequestError("prompt_ids must be a list of non-empty lists of token ids.")
        sampling = payload.get("sampling") or {}
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise RequestError(f"unsupported sampling options {unknown}; supported: {list(SAMPLING_KEYS)}.")
        completion_ids, logprobs = self.engine.generate(prompt_ids, sampling)
        return {"completion_ids": completion_ids, "logprobs": logprobs}


def _handler(service: RolloutService) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            routes = {"/health": lambda: {"status": "ok"}, "/info": lambda: service.info}
            self._answer(routes.get(self.path))

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            routes = {
                "/adapter": lambda: service.load_adapter(_json(body)),
                "/norms": lambda: service.set_norms(body),
                "/generate": lambda: service.generate(_json(body)),
            }
            self._answer(routes.get(self.path))

        def _answer(self, route):
            if route is None:
                return self._send(404, {"error": f"unknown path {self.path}"})
            try:
                self._send(200, route())
            except RequestError as error:
                self._send(400, {"error": str(error)})
            except Exception as error:  # noqa: BLE001 - report engine failures to the trainer instead of dying
                logger.exception("request %s failed", self.path)
                self._send(500, {"error": f"{type(error).__name__}: {error}"})

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):  # noqa: A002 - http.server's signature
            logger.debug("%s " + format, self.address_string(), *args)

    return Handler


def _json(body: bytes) -> dict[str, Any]:
    try:
        payload = json.loads(body or b"{}")
    except json.JSONDecodeError as error:
        raise RequestError(f"the body is not JSON: {error}") from error
    if not isinstance(payload, dict):
        raise RequestError("the body must be a JSON object.")
    return payload


def make_server(service: RolloutService, host: str = "127.0.0.1", port: int = 8000) -> HTTPServer:
    """An HTTP server for ``service`` (one request at a time: the engine is not re-entrant)."""
    return HTTPServer((host, port), _handler(service))


class ServerError(RuntimeError):
    """The rollout server answered with an error."""


class VLLMServerClient:
    """The trainer's side of ``trl-qerl vllm-serve``; the same calls as a local `VLLMEngine`."""

    def __init__(self, base_url: str, timeout: float = 240.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._info: dict[str, Any] | None = None

    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._request("GET", "/info")
        return self._info

    def check_rank(self, rank: int) -> None:
        """Raise if the server cannot serve adapters of this rank."""
        choose_max_lora_rank(rank, self.info()["max_lora_rank"])

    def adapter_dir(self) -> Path:
        """Where the trainer writes adapters: the server's adapter directory (a filesystem both can see)."""
        path = Path(self.info()["adapter_dir"])
        if not path.is_dir():
            raise ServerError(
                f"The rollout server reads adapters from {path}, which this machine cannot see; run the trainer on the "
                "same machine as `trl-qerl vllm-serve` (or give both a shared --adapter-dir)."
            )
        return path

    def load_adapter(self, path: str) -> None:
        path = Path(path)
        if path.parent.resolve() != Path(self.info()["adapter_dir"]).resolve():
            raise ValueError(f"{path} is not inside the server's adapter directory {self.info()['adapter_dir']}.")
        self._request("POST", "/adapter", json.dumps({"name": path.name}).encode())

    def set_norms(self, values: dict[str, torch.Tensor]) -> None:
        body = save_safetensors({name: value.detach().cpu().contiguous() for name, value in values.items()})
        self._request("POST", "/norms", body, content_type="application/octet-stream")

    def generate(self, prompt_ids, sampling):
        answer = self._request(
            "POST", "/generate", json.dumps({"prompt_ids": prompt_ids, "sampling": sampling}).encode()
        )
        return answer["completion_ids"], answer["logprobs"]

    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
        request = urllib.request.Request(self.base_url + path, data=body, method=method)
        request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            raise ServerError(f"{method} {path} -> HTTP {error.code}: {detail}") from None
        except urllib.error.URLError as error:
            raise ServerError(
                f"Cannot reach the rollout server at {self.base_url} ({error.reason}). Start it with "
                "`trl-qerl vllm-serve --model <checkpoint>` and point vllm_server_base_url at it."
            ) from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="trl-qerl vllm-serve",
        description="Serve rollouts for QeRL training from vLLM: a base checkpoint (compressed-tensors NVFP4 or "
        "16-bit) with LoRA adapters pushed by the trainer, and AQN noise written into its norms.",
    )
    parser.add_argument("--model", required=True, help="Base checkpoint directory (e.g. from `trl-qerl quantize`).")
    parser.add_argument(
        "--adapter-dir",
        default=None,
        help="The only directory adapters are read from (default: a new one under /dev/shm or /tmp).",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="Interface to bind (default 127.0.0.1: this machine only)."
    )
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument(
        "--max-lora-rank", type=int, default=64, choices=VLLM_LORA_RANKS, help="Largest LoRA rank served."
    )
    parser.add_argument("--dtype", default="bfloat16", help="Compute dtype (bfloat16; float32 on CPU tests).")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="Fraction of GPU memory vLLM uses.")
    parser.add_argument("--max-model-len", type=int, default=None, help="Longest prompt + completion.")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="Most sequences decoded at once.")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs the engine is sharded over.")
    parser.add_argument("--enforce-eager", action="store_true", help="Disable CUDA graphs (slower; for debugging).")
    parser.add_argument("--seed", type=int, default=0, help="Sampling seed.")
    parser.add_argument(
        "--fp32-norms",
        type=_norm_list,
        default=DEFAULT_FP32_NORMS,
        help="Comma-separated RMSNorms held in fp32 so that small AQN noise survives (module names or suffixes; "
        f"'none' for none). Default: {','.join(DEFAULT_FP32_NORMS)} (the norms QeRL trains and perturbs).",
    )
    return parser.parse_args(argv)


def _norm_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    return () if names in ((), ("none",)) else names


def serve(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``trl-qerl vllm-serve``."""
    from transformers import AutoConfig

    from .vllm import VLLMEngine, adapter_root, require_vllm

    args = parse_args(argv)
    version = require_vllm()
    config = AutoConfig.from_pretrained(args.model)
    quantization = getattr(config, "quantization_config", None)
    quantized = quantization is not None
    check_vllm_shapes(config, args.tensor_parallel_size, quantized=quantized)
    choose_max_lora_rank(1, args.max_lora_rank)
    adapter_dir = Path(args.adapter_dir) if args.adapter_dir else adapter_root()
    adapter_dir.mkdir(parents=True, exist_ok=True)
    engine = VLLMEngine(
        args.model,
        max_lora_rank=args.max_lora_rank,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager,
        seed=args.seed,
        fp32_norms=args.fp32_norms,
    )
    info = {
        "model": str(args.model),
        "quantization": "nvfp4" if quantized else "none",
        "max_lora_rank": args.max_lora_rank,
        "vllm_version": str(version),
        "dtype": args.dtype,
        "fp32_norms": list(args.fp32_norms),
    }
    server = make_server(RolloutService(engine, adapter_dir, info), args.host, args.port)
    print(f"trl-qerl vllm-serve: {args.model} on http://{args.host}:{server.server_port}, adapters from {adapter_dir}",
          flush=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
