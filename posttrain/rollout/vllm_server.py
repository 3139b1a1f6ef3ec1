"""`posttrain vllm-serve`: vLLM in a process of its own, which a run samples from and pushes weights to.

    posttrain vllm-serve --model tiny --port 8000          # prints the URL, serves until stopped
    posttrain grpo --rollout.engine vllm --rollout.vllm.mode server --rollout.vllm.url http://127.0.0.1:8000

The server is vLLM's engine (`vllm.LLM`, as `rollout/vllm_engine.LocalBackend` runs it in-process)
behind a small HTTP API that speaks token ids, so a run's prompts and tool observations cross
exactly as ids (never re-rendered text):

    GET  /health    {"status": "ok", "model": spec, "vllm": version, "weight_pushes": n}
    POST /generate  {"prompts": [[ids]...], "params": [SamplingParams kwargs...]}
                    -> {"results": [[{"token_ids", "logprobs", "finish_reason"}...]...]}
    POST /weights   a safetensors body of Hugging Face-named tensors -> {"seconds": s}; the prefix cache is reset

Requests are served one at a time (the engine is not shared between threads). Weights cross as one
safetensors body (the policy's size per push: 0.5 GB for SmolLM2-135M in fp32); on GPUs on one node
that is the simple, portable path, not the fastest (NCCL broadcast is vLLM's weight-transfer engine).
The run's side is `vllm_backends.RemoteBackend`: bounded retries to connect, `EngineUnavailable` when
the server stops answering (the run then checkpoints and says how to resume).
"""

from __future__ import annotations

import json
import logging
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import torch

from posttrain.errors import UserError

logger = logging.getLogger(__name__)


def make_handler(backend, model_spec: str):
    """The request handler class serving `backend` (a `LocalBackend`)."""
    import vllm

    state = {"weight_pushes": 0}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args) -> None:  # through logging, not stderr
            logger.debug("vllm-serve: " + format, *args)

        def _send(self, code: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def do_GET(self) -> None:
            if self.path != "/health":
                return self._send(404, {"error": f"no such endpoint {self.path}"})
            self._send(200, {"status": "ok", "model": model_spec, "vllm": vllm.__version__,
                             "weight_pushes": state["weight_pushes"]})

        def do_POST(self) -> None:
            try:
                if self.path == "/generate":
                    request = json.loads(self._body())
                    prompts, params = request["prompts"], request["params"]
                    if len(prompts) != len(params):
                        return self._send(400, {"error": f"{len(prompts)} prompts and {len(params)} params"})
                    return self._send(200, {"results": backend.generate(prompts, params)})
                if self.path == "/weights":
                    from safetensors.torch import load

                    started = time.perf_counter()
                    weights = load(self._body())
                    backend.load_weights(iter(weights.items()))
                    state["weight_pushes"] += 1
                    return self._send(200, {"seconds": time.perf_counter() - started, "tensors": len(weights)})
                return self._send(404, {"error": f"no such endpoint {self.path}"})
            except UserError as error:  # a request vLLM refused, in one line
                return self._send(400, {"error": str(error)})
            except (KeyError, ValueError, TypeError) as error:
                return self._send(400, {"error": f"bad request: {type(error).__name__}: {error}"})
            except Exception as error:  # vLLM's own failure: the client gets its reason, the server goes on
                logger.exception("vllm-serve: %s failed", self.path)
                return self._send(500, {"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"})

    return Handler


def serve(model_spec: str, settings, host: str = "127.0.0.1", port: int = 8000, ready=None) -> None:
    """Load `model_spec` (any spec the loaders take: tiny, smollm2, a directory) into vLLM and serve it
    until interrupted. `settings` is a `VLLMSettings` (its memory, dtype and length settings); `ready`,
    if given, is called with the bound URL once the server accepts requests."""
    import tempfile

    from posttrain.models.loading import load_model
    from posttrain.rollout.vllm_backends import LocalBackend, export_for_vllm

    model, tokenizer = load_model(model_spec)
    with tempfile.TemporaryDirectory(prefix="posttrain-vllm-serve-") as directory:
        export_for_vllm(model, tokenizer, directory)
        del model
        backend = LocalBackend(directory, settings, cpu=not torch.cuda.is_available())
        server = HTTPServer((host, port), make_handler(backend, model_spec))
        url = f"http://{server.server_address[0]}:{server.server_address[1]}"
        logger.info("vllm-serve: %s at %s", model_spec, url)
        if ready is not None:
            ready(url)
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
