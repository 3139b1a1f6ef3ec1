"""`posttrain vllm-serve --model M`: vLLM in a process of its own for runs with `rollout.vllm.mode server`."""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "vllm-serve", help="serve a model with vLLM for runs to sample from (rollout.engine vllm, mode server)",
        description="Loads MODEL into vLLM and serves token-in, token-out generation and weight pushes over HTTP "
                    "(posttrain/rollout/vllm_server.py). A run points to it with --rollout.engine vllm "
                    "--rollout.vllm.mode server --rollout.vllm.url URL and pushes its weights before sampling.")
    parser.add_argument("--model", required=True, help="the starting weights: tiny, smollm2-135m, a local Hugging Face directory")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="the port (0: any free one; the URL is printed)")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="CPU build: the KV cache's size in GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU: the share of the device vLLM may take")
    parser.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion (default: the model's)")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on a CPU, bfloat16 on a GPU), float32, bfloat16, float16")
    parser.set_defaults(func=serve)


def serve(args) -> int:
    from posttrain.rollout.vllm_backends import VLLMSettings, require_vllm
    from posttrain.rollout.vllm_server import serve as run_server

    settings = VLLMSettings(kv_cache_gb=args.kv_cache_gb, gpu_memory_utilization=args.gpu_memory_utilization,
                            max_model_len=args.max_model_len, dtype=args.dtype)
    settings.validate(prefix="--")
    require_vllm()
    run_server(args.model, settings, host=args.host, port=args.port,
               ready=lambda url: print(f"vllm-serve: {args.model} at {url} (--rollout.vllm.url {url}); Ctrl-C stops it", flush=True))
    return 0
