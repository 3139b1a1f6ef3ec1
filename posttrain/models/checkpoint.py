"""Checkpoints as standard Hugging Face directories, the critic's files, and a model's description.

A full model saves as `config.json` + `model.safetensors` + tokenizer files, which plain
`AutoModelForCausalLM.from_pretrained` loads. A LoRA policy saves its adapter
(`adapter_config.json` + `adapter_model.safetensors`, naming its base spec) or, with
`merge_lora_weights=True`, the merged full model. `save_model` is the export of a model; atomic
writes are the caller's (a run's step checkpoints: `runs.checkpoint.write_step_checkpoint`, a
temporary directory renamed when complete).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from posttrain.errors import UserError
from posttrain.models.adapters import Critic, is_lora, merge_lora

CRITIC_CONFIG = "critic.json"
VALUE_HEAD_FILE = "value_head.safetensors"


def save_model(model, tokenizer, directory: str | Path, *, merge_lora_weights: bool = False) -> Path:
    """Write `model` and `tokenizer` to `directory` (created if needed); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_lora(model) and merge_lora_weights:
        merge_lora(model).save_pretrained(directory)
    elif is_lora(model):
        # save_embedding_layers=False: peft would otherwise look the base up on the hub.
        model.save_pretrained(directory, save_embedding_layers=False)
    else:
        model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_critic(critic: Critic, directory: str | Path) -> Path:
    """`value_head.safetensors` + `critic.json`, plus the backbone as a model directory when the
    critic owns one (a shared backbone is saved with the policy)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in critic.value_head.state_dict().items()}, directory / VALUE_HEAD_FILE)
    config = {"shares_backbone": critic.shares_backbone, "hidden_size": critic.backbone.config.hidden_size}
    (directory / CRITIC_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    if not critic.shares_backbone:
        critic.backbone.save_pretrained(directory / "backbone")
    return directory


def load_critic(directory: str | Path, *, policy=None) -> Critic:
    """Rebuild a critic saved by `save_critic`; a shared-backbone critic needs the `policy`."""
    from posttrain.models.loading import load_model

    directory = Path(directory)
    if not (directory / CRITIC_CONFIG).is_file():
        raise UserError(f"critic {directory}: no {CRITIC_CONFIG}")
    config = json.loads((directory / CRITIC_CONFIG).read_text())
    if config["shares_backbone"]:
        if policy is None:
            raise UserError(f"critic {directory}: it shares the policy's backbone; pass the policy")
        critic = Critic(policy, shares_backbone=True)
    else:
        backbone_path = directory / "backbone"
        if (backbone_path / "adapter_config.json").is_file():
            backbone, _ = load_model(str(backbone_path))
        else:
            backbone = AutoModelForCausalLM.from_pretrained(backbone_path, local_files_only=True)
        critic = Critic(backbone.train(), shares_backbone=False)
    critic.value_head.load_state_dict(load_file(directory / VALUE_HEAD_FILE))
    return critic


def describe_model(spec: str, model, tokenizer) -> dict:
    """What `posttrain model info` prints: sizes, special tokens, chat template, weights location."""
    from posttrain.models.loading import SMOLLM2_SPEC, smollm2_cache_path

    if spec == "tiny":
        weights = "none on disk (built in code from a seed)"
    elif spec == SMOLLM2_SPEC:
        weights = str(smollm2_cache_path())
    elif Path(spec).expanduser().exists():
        weights = str(Path(spec).expanduser().resolve())
    else:
        weights = "Hugging Face cache (HF_HOME)"
    parameters = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    special = {
        name: getattr(tokenizer, name)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if getattr(tokenizer, name, None) is not None
    }
    return {
        "spec": spec,
        "architecture": type(model.get_base_model() if is_lora(model) else model).__name__,
        "lora": is_lora(model),
        "parameters": parameters,
        "trainable_parameters": trainable,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "vocab_size": len(tokenizer),
        "embedding_rows": model.get_input_embeddings().weight.shape[0],
        "special_tokens": {name: f"{token} (id {tokenizer.convert_tokens_to_ids(token)})" for name, token in special.items()},
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "max_positions": getattr(model.config, "max_position_embeddings", None),
        "weights": weights,
    }


