"""``trl-qerl vllm-serve``: a rollout server for multi-GPU training (N training GPUs + 1 rollout GPU).

It runs one `VLLMEngine` and answers five requests over HTTP, JSON or raw safetensors only (nothing pickled):

* ``GET /health``, ``GET /info`` (model, LoRA limit, adapter directory, quantisation);
* ``POST /adapter`` ``{"name": ...}``: serve the adapter ``<adapter-dir>/<name>`` from now on (only names of
  directories directly inside the adapter directory the server was started with are accepted);
* ``POST /norms`` (safetensors bytes): write RMSNorm weights (trained values + AQN noise) into vLLM's model (the
  norms named by ``--fp32-norms`` are held in fp32 from load on, so noise below bf16's precision survives);
* ``POST /generate`` ``{"prompt_ids": [[...]], "sampling": {...}}``: completions and their sampled log-probs.

It binds to 127.0.0.1 unless ``--host`` says otherwise (bound beyond loopback without ``--api-key`` it warns
loudly: anyone who can reach the port can then drive the engine). The trainer's side is `VLLMServerClient`
(`trl_qerl.rollout.vllm_client`); the engine is `trl_qerl.rollout.vllm_engine.VLLMEngine`.

What it accepts (everything else is answered with 4xx and a message that says what to change, before the engine
sees it): bodies with a valid ``Content-Length`` no larger than ``--max-body-mb`` (411 without one, 400 when it is
not a non-negative integer, 413 above the cap, 408 when the body does not arrive within ``--request-timeout``
seconds of silence); JSON bodies that are UTF-8 JSON objects without NaN/Infinity; token ids that are ints (not
bools) in ``[0, vocab_size)``; sampling values of the right type and range (``max_tokens`` at most the model's
length); norm tensors that are floating, finite, 1-D and named and shaped like the checkpoint's norms; adapters that
are plain directories inside the adapter directory holding no symlinks. Connections are served on their own
threads with a socket timeout, so a slow or idle client cannot stall others; engine calls are serialised by a lock.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from .vllm_checkpoint import VLLM_LORA_RANKS, check_vllm_shapes, choose_max_lora_rank
from .vllm_client import API_KEY_ENV
from .vllm_engine import SAMPLING_KEYS, VLLMEngine, adapter_root, require_vllm
from .vllm_norms import DEFAULT_FP32_NORMS


logger = logging.getLogger(__name__)

_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_ADAPTER_MAX_ENTRIES = 64
_NORM_NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*\.weight$")
_NORM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_NORM_TENSORS = 100_000
_MAX_NORM_SIZE = 1 << 20
# Used when the model's limits are unknown (a stand-in engine): generous, but finite.
MAX_TOKENS_CAP = 1 << 20
MAX_PROMPTS = 1 << 16
MAX_STOP_TOKEN_IDS = 1024
DEFAULT_MAX_BODY_MB = 64
DEFAULT_REQUEST_TIMEOUT = 10.0


class RequestError(ValueError):
    """A bad request: answered with HTTP 400 and the message."""


class RolloutService:
    """The server's logic, independent of HTTP: validates requests and drives the engine.

    Args:
        engine: a `VLLMEngine` (or anything with ``load_adapter``, ``set_norms``, ``generate``).
        adapter_dir: the only directory adapters are read from.
        info: what ``GET /info`` reports.
        vocab_size: token ids must lie in ``[0, vocab_size)`` (default: ``engine.vocab_size`` if it has one, else only
            non-negative ids are checked).
        max_model_len: the longest prompt + completion (default: ``engine.max_model_len`` if set, else
            `MAX_TOKENS_CAP`); ``max_tokens`` and prompt lengths are bounded by it.
        norm_shapes: checkpoint key -> shape of every norm ``/norms`` may write (see `checkpoint_norm_shapes`);
            ``None``: any 1-D ``*.weight`` whose name contains "norm".
    """

    def __init__(
        self,
        engine,
        adapter_dir: str | Path,
        info: dict[str, Any],
        vocab_size: int | None = None,
        max_model_len: int | None = None,
        norm_shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> None:
        self.engine = engine
        self.adapter_dir = Path(adapter_dir).resolve()
        self.vocab_size = vocab_size if vocab_size is not None else getattr(engine, "vocab_size", None)
        self.max_model_len = max_model_len if max_model_len is not None else getattr(engine, "max_model_len", None)
        self.norm_shapes = None if norm_shapes is None else {k: tuple(v) for k, v in norm_shapes.items()}
        self.lock = threading.Lock()  # the engine is not re-entrant
        self.info = {
            **info,
            "adapter_dir": str(self.adapter_dir),
            "logprobs_mode": "processed_logprobs",
            "vocab_size": self.vocab_size,
            "max_model_len": self.max_model_len,
        }

    @property
    def max_tokens_cap(self) -> int:
        return self.max_model_len or MAX_TOKENS_CAP

    def adapter_path(self, name: Any) -> Path:
        """The adapter directory for ``name``, refusing anything that is not a plain directory inside ours whose
        entries are plain files (no symlinks: vLLM would follow them out of the adapter directory)."""
        if not isinstance(name, str) or not _ADAPTER_NAME.match(name) or name in (".", ".."):
            raise RequestError(
                f"adapter name {name!r} must be a plain directory name (letters, digits, '.', '_', '-')."
            )
        path = self.adapter_dir / name
        if path.is_symlink() or path.resolve().parent != self.adapter_dir or not path.is_dir():
            raise RequestError(f"no adapter directory {name!r} in {self.adapter_dir}.")
        entries = []
        for entry in path.iterdir():
            entries.append(entry)
            if len(entries) > _ADAPTER_MAX_ENTRIES:
                raise RequestError(f"adapter {name!r} holds more than {_ADAPTER_MAX_ENTRIES} entries.")
            if entry.is_symlink() or entry.resolve().parent != path.resolve():
                raise RequestError(
                    f"adapter {name!r} holds {entry.name!r}, a symlink or a path leading outside {self.adapter_dir}; "
                    "write the adapter's files into the directory itself."
                )
        missing = [file for file in _ADAPTER_FILES if not (path / file).is_file()]
        if missing:
            raise RequestError(f"adapter {name!r} lacks {missing}.")
        return path

    def load_adapter(self, payload: dict[str, Any]) -> dict[str, Any]:
        _known_keys(payload, ("name",), "/adapter")
        path = self.adapter_path(payload.get("name"))
        with self.lock:
            self.engine.load_adapter(str(path))
        return {"adapter": path.name}

    def check_norms(self, values: dict[str, torch.Tensor]) -> None:
        """Refuse norm tensors that are not floating, finite, 1-D and named and shaped like the model's norms."""
        if not values:
            raise RequestError("the safetensors payload holds no tensors; send the norm weights to write.")
        if len(values) > _MAX_NORM_TENSORS:
            raise RequestError(f"{len(values)} tensors is more than the {_MAX_NORM_TENSORS} norms accepted.")
        for name, value in values.items():
            if self.norm_shapes is not None:
                if name not in self.norm_shapes:
                    known = sorted(self.norm_shapes)[:4]
                    raise RequestError(f"{name!r} is not a norm weight of the model (norms look like {known}).")
                expected = self.norm_shapes[name]
            else:
                if not _NORM_NAME.match(name) or "norm" not in name.rsplit(".", 2)[-2].lower():
                    raise RequestError(f"{name!r} is not a norm weight name (expected '<module>...norm.weight').")
                expected = None
            if value.dtype not in _NORM_DTYPES:
                raise RequestError(
                    f"{name}: dtype {value.dtype} is not accepted; send float32, bfloat16 or float16 norm weights."
                )
            if expected is not None and tuple(value.shape) != expected:
                raise RequestError(f"{name}: the model's norm has shape {expected}, got {tuple(value.shape)}.")
            if value.dim() != 1 or not 0 < value.numel() <= _MAX_NORM_SIZE:
                raise RequestError(f"{name}: a norm weight is a non-empty 1-D tensor, got shape {tuple(value.shape)}.")
            if not bool(torch.isfinite(value).all()):
                raise RequestError(f"{name}: holds NaN or infinite values; send finite norm weights.")

    def set_norms(self, body: bytes) -> dict[str, Any]:
        try:
            values = load_safetensors(body)
        except Exception as error:  # noqa: BLE001 - any parse failure is the client's
            raise RequestError(f"the body is not a safetensors payload: {error}") from error
        self.check_norms(values)
        with self.lock:
            self.engine.set_norms(values)
        return {"norms": len(values)}

    def check_token_ids(self, ids: Any, what: str) -> None:
        if not isinstance(ids, list):
            raise RequestError(f"{what} must be a list of token ids, got {type(ids).__name__}.")
        vocab = self.vocab_size
        for token in ids:
            if type(token) is not int:  # bool is an int subclass; floats and strings are not ids
                raise RequestError(f"{what} must hold integer token ids, got {token!r}.")
            if token < 0 or (vocab is not None and token >= vocab):
                bound = f"[0, {vocab})" if vocab is not None else "non-negative"
                raise RequestError(f"{what} holds token id {token}, outside the vocabulary: ids must be {bound}.")

    def check_sampling(self, sampling: Any) -> dict[str, Any]:
        if sampling is None:
            return {}
        if not isinstance(sampling, dict):
            raise RequestError(
                f"sampling must be a JSON object of SamplingParams options, got {type(sampling).__name__}."
            )
        unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
        if unknown:
            raise RequestError(f"unsupported sampling options {unknown}; supported: {list(SAMPLING_KEYS)}.")
        cap = self.max_tokens_cap
        top_k_max = self.vocab_size if self.vocab_size is not None else MAX_TOKENS_CAP
        ranges = {  # key: (kind, low, high, low inclusive)
            "temperature": ("float", 0.0, 100.0, True),
            "top_p": ("float", 0.0, 1.0, False),
            "min_p": ("float", 0.0, 1.0, True),
            "repetition_penalty": ("float", 0.0, 100.0, False),
            "presence_penalty": ("float", -2.0, 2.0, True),
            "frequency_penalty": ("float", -2.0, 2.0, True),
            "top_k": ("int", -1, top_k_max, True),
            "max_tokens": ("int", 1, cap, True),
            "min_tokens": ("int", 0, cap, True),
            "seed": ("int", -(2**63), 2**63 - 1, True),
        }
        for key, value in sampling.items():
            if key == "ignore_eos":
                if type(value) is not bool:
                    raise RequestError(f"sampling.ignore_eos must be true or false, got {value!r}.")
            elif key == "stop_token_ids":
                if value is None:
                    continue
                self.check_token_ids(value, "sampling.stop_token_ids")
                if len(value) > MAX_STOP_TOKEN_IDS:
                    raise RequestError(f"sampling.stop_token_ids holds more than {MAX_STOP_TOKEN_IDS} ids.")
            elif key == "seed" and value is None:
                continue
            else:
                kind, low, high, low_inclusive = ranges[key]
                if kind == "int" and type(value) is not int:
                    raise RequestError(f"sampling.{key} must be an integer, got {value!r}.")
                if kind == "float" and (type(value) not in (int, float) or not math.isfinite(value)):
                    raise RequestError(f"sampling.{key} must be a finite number, got {value!r}.")
                if not (low <= value if low_inclusive else low < value) or value > high:
                    interval = f"{'[' if low_inclusive else '('}{low}, {high}]"
                    hint = " (the model's max length)" if key in ("max_tokens", "min_tokens") else ""
                    raise RequestError(f"sampling.{key}={value!r} is outside {interval}{hint}.")
        if sampling.get("min_tokens", 0) > sampling.get("max_tokens", cap):
            raise RequestError("sampling.min_tokens must not exceed sampling.max_tokens.")
        return sampling

    def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        _known_keys(payload, ("prompt_ids", "sampling"), "/generate")
        prompt_ids = payload.get("prompt_ids")
        if (
            not isinstance(prompt_ids, list)
            or not prompt_ids
            or not all(isinstance(ids, list) and ids for ids in prompt_ids)
        ):
            raise RequestError("prompt_ids must be a non-empty list of non-empty lists of token ids.")
        if len(prompt_ids) > MAX_PROMPTS:
            raise RequestError(f"{len(prompt_ids)} prompts is more than {MAX_PROMPTS} per request; split the batch.")
        for index, ids in enumerate(prompt_ids):
            self.check_token_ids(ids, f"prompt_ids[{index}]")
            if self.max_model_len is not None and len(ids) >= self.max_model_len:
                raise RequestError(
                    f"prompt_ids[{index}] has {len(ids)} tokens; the model's max length is {self.max_model_len} "
                    "(prompt + completion): shorten the prompt."
                )
        sampling = self.check_sampling(payload.get("sampling"))
        with self.lock:
            completion_ids, logprobs = self.engine.generate(prompt_ids, sampling)
        return {"completion_ids": completion_ids, "logprobs": logprobs}


def _known_keys(payload: dict[str, Any], keys: tuple[str, ...], route: str) -> None:
    unknown = sorted(set(payload) - set(keys))
    if unknown:
        raise RequestError(f"{route} takes only {list(keys)}; remove {unknown}.")


def checkpoint_norm_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Checkpoint key -> shape of the 1-D norm weights in ``model_dir``'s safetensors files (headers only), or
    ``None`` when there are none to read."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                shape = tuple(handle.get_slice(key).get_shape())
                if len(shape) == 1 and _NORM_NAME.match(key) and "norm" in key.rsplit(".", 2)[-2].lower():
                    shapes[key] = shape
    return shapes or None


class HTTPError(Exception):
    """A request refused before it reaches the service (status, message)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _handler(
    service: RolloutService, max_body: int, request_timeout: float, api_key: str | None
) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # StreamRequestHandler.setup applies it to the socket: every read (request line, headers, body) and write
        # gives up after `timeout` seconds of silence, so an idle or short-body client only holds its own thread.
        timeout = request_timeout

        def do_GET(self):  # noqa: N802 - http.server's naming
            routes = {"/health": lambda: {"status": "ok"}, "/info": lambda: service.info}
            if self.path != "/health" and not self._authorised():
                return
            self._answer(routes.get(self.path))

        def do_POST(self):  # noqa: N802
            routes = {
                "/adapter": lambda: service.load_adapter(_json(body)),
                "/norms": lambda: service.set_norms(body),
                "/generate": lambda: service.generate(_json(body)),
            }
            if not self._authorised():
                return
            if self.path not in routes:
                self.close_connection = True
                return self._send(404, {"error": f"unknown path {self.path}"})
            try:
                body = self._read_body()
            except HTTPError as error:
                self.close_connection = True
                return self._send(error.status, {"error": str(error)})
            self._answer(routes[self.path])

        def _authorised(self) -> bool:
            if api_key is None:
                return True
            given = self.headers.get("Authorization", "")
            expected = f"Bearer {api_key}"
            if hmac.compare_digest(given.encode("utf-8", "replace"), expected.encode()):
                return True
            self.close_connection = True
            self._send(
                401, {"error": f"missing or wrong API key: send 'Authorization: Bearer <key>' ({API_KEY_ENV})."}
            )
            return False

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding"):
                raise HTTPError(411, "chunked bodies are not accepted; send a Content-Length.")
            lengths = self.headers.get_all("Content-Length") or []
            if not lengths:
                raise HTTPError(411, "a POST needs a Content-Length header.")
            if len(set(lengths)) != 1 or not lengths[0].strip().isdigit() or not lengths[0].strip().isascii():
                raise HTTPError(400, f"Content-Length {lengths} is not one non-negative integer.")
            length = int(lengths[0])
            if length > max_body:
                raise HTTPError(
                    413, f"the body has {length} bytes, more than the server's limit of {max_body} (--max-body-mb)."
                )
            chunks, left = [], length
            deadline = time.monotonic() + max(request_timeout, 1.0) * 6  # bounds a client that trickles bytes, too
            try:
                while left:
                    chunk = self.rfile.read1(min(left, 1 << 20))
                    if not chunk:
                        raise HTTPError(400, f"the body ended {left} bytes short of its Content-Length ({length}).")
                    chunks.append(chunk)
                    left -= len(chunk)
                    if left and time.monotonic() > deadline:
                        raise HTTPError(408, "the body arrived too slowly; send it in one go.")
            except TimeoutError:  # socket.timeout
                raise HTTPError(
                    408, f"no data for {request_timeout:g} s with {left} of {length} body bytes still to come."
                ) from None
            return b"".join(chunks)

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
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except OSError:  # the client left (or stopped reading past the timeout)
                self.close_connection = True

        def log_message(self, format, *args):  # noqa: A002 - http.server's signature
            logger.debug("%s " + format, self.address_string(), *args)

    return Handler


def _json(body: bytes) -> dict[str, Any]:
    try:
        text = body.decode("utf-8") if body else "{}"
    except UnicodeDecodeError as error:
        raise RequestError(f"the body is not UTF-8: {error}") from error

    def no_constants(name: str):
        raise RequestError(f"the body holds {name}, which is not JSON; send finite numbers.")

    try:
        payload = json.loads(text, parse_constant=no_constants)
    except json.JSONDecodeError as error:
        raise RequestError(f"the body is not JSON: {error}") from error
    except RecursionError:
        raise RequestError('the body is nested too deeply; send {"prompt_ids": [[...]], "sampling": {...}}.') from None
    if not isinstance(payload, dict):
        raise RequestError("the body must be a JSON object.")
    return payload


class RolloutHTTPServer(ThreadingHTTPServer):
    """One daemon thread per connection (engine calls are serialised by `RolloutService.lock`)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 64


def make_server(
    service: RolloutService,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_body: int = DEFAULT_MAX_BODY_MB << 20,
    timeout: float = DEFAULT_REQUEST_TIMEOUT,
    api_key: str | None = None,
) -> RolloutHTTPServer:
    """An HTTP server for ``service``: a thread per connection, ``timeout`` seconds of silence allowed per read,
    bodies up to ``max_body`` bytes, and (with ``api_key``) ``Authorization: Bearer <api_key>`` required on all
    but ``/health``."""
    return RolloutHTTPServer((host, port), _handler(service, max_body, timeout, api_key or None))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_warning(host: str, api_key: str | None) -> str | None:
    """The warning printed when the server is reachable beyond this machine without an API key (else None)."""
    if is_loopback(host) or api_key:
        return None
    bar = "!" * 100
    return (
        f"{bar}\nWARNING: trl-qerl vllm-serve is bound to {host!r}, beyond loopback, WITHOUT AUTHENTICATION: anyone "
        "who can reach this port can load adapters from the adapter directory, overwrite the model's norms and use "
        f"the GPU. Set {API_KEY_ENV} (or --api-key) on the server and the trainer, firewall the port, or bind "
        f"127.0.0.1.\n{bar}"
    )


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
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"Require 'Authorization: Bearer <key>' on every request but /health (default: ${API_KEY_ENV}; prefer "
        "the environment variable, which other users cannot read from the process list). The trainer's client "
        "sends the same variable.",
    )
    parser.add_argument(
        "--max-body-mb",
        type=_positive(float),
        default=DEFAULT_MAX_BODY_MB,
        help=f"Largest request body in MiB (default {DEFAULT_MAX_BODY_MB}: far above a model's norm weights).",
    )
    parser.add_argument(
        "--request-timeout",
        type=_positive(float),
        default=DEFAULT_REQUEST_TIMEOUT,
        help=f"Seconds of silence after which a connection that is still sending is dropped (default "
        f"{DEFAULT_REQUEST_TIMEOUT:g}).",
    )
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


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _norm_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    return () if names in ((), ("none",)) else names


def serve(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``trl-qerl vllm-serve``."""
    from transformers import AutoConfig

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
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    max_model_len = args.max_model_len or getattr(text_config, "max_position_embeddings", None)
    service = RolloutService(
        engine,
        adapter_dir,
        info,
        vocab_size=getattr(text_config, "vocab_size", None),
        max_model_len=max_model_len,
        norm_shapes=checkpoint_norm_shapes(args.model),
    )
    server = make_server(
        service, args.host, args.port, int(args.max_body_mb * (1 << 20)), args.request_timeout, args.api_key
    )
    warning = bind_warning(args.host, args.api_key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
        logger.warning("vllm-serve bound to %s without an API key", args.host)
    print(f"trl-qerl vllm-serve: {args.model} on http://{args.host}:{server.server_port}, adapters from {adapter_dir}",
          flush=True)  # fmt: skip
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
