"""Models: one loader for every model spec, plus reference, critic, LoRA and checkpoints. Each
function's own docstring is its contract (shapes, what it returns); by module:

    loading.py       load_model(spec, dtype=, device=) for tiny | smollm2-135m | an HF directory | a hub id;
                     load_policy (load_model + lean MLPs + LoRA, on a placement); cache_dir
    tiny.py          the built-in tiny Llama and its character-level ChatML tokenizer
    adapters.py      LoRA (apply / merge), the frozen reference (or the LoRA base), the critic's value head
    checkpoint.py    HF-directory checkpoints of a policy (merged LoRA or adapters), critic files, describe_model
    memory.py        lean_mlp: SwiGLU MLPs that keep two intermediate tensors for backward, not four
    forward.py       THE model-forward layer: log-probs and values of given tokens, TrainingForward
    pair_forward.py  chosen + rejected summed log-probs of preference pairs, the reference cache

SmolLM2's pad is its EOS: masks come from lengths, never from token ids.
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
from posttrain.models.checkpoint import describe_model, load_critic, save_critic, save_model
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
    "save_critic",
    "save_model",
    "smollm2_cache_path",
]
