"""A scalar reward model: a causal LM's decoder with a linear score head, pooled at each row's last
attended token (the EOS appended to the response), and its export as a directory that transformers'
`AutoModelForSequenceClassification` loads with the same scores.

    model = RewardModel.from_policy(policy)                # (N,) rewards of (N, L) rows
    rewards = model(input_ids, attention_mask)
    export(model, tokenizer, "runs/rm/final", meta)        # config.json (num_labels 1), score.weight, reward_model.json
    model, tokenizer, meta = load_reward_model("runs/rm/final")

Pooling reads the attention mask (lengths), never token ids: SmolLM2's pad token is its EOS, and
transformers' own sequence-classification pooling (the last token that is not the pad id) would skip
the final EOS there. The export therefore sets a pad token that is not the EOS (adding `<|pad|>`
when the tokenizer has none apart), so transformers pools on the same token as this module.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch

from posttrain.data import position_ids_from_attention_mask
from posttrain.errors import UserError
from posttrain.models.adapters import is_lora
from posttrain.models.packing import PackedPairs, common_prefix_lengths, use_packed_attention

META_FILE = "reward_model.json"
"""The export's own facts beside config.json: pooling rule, EOS appended, chat template hash, the
stored reward mean and std, held-out accuracy, the pairs' provenance."""
POOLING = "last attended token (from the attention mask): the EOS appended to the response"
PAD_TOKEN = "<|pad|>"


def last_attended_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N,) position of each row's last attended token in (N, L) `attention_mask` (right or left
    padding alike; 0 for a row with none). Example: mask [1, 1, 1, 1, 1, 0, 0] -> 4, whatever ids
    the padding holds (a pad id equal to the EOS id included)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


class RewardModel(torch.nn.Module):
    """r(x, y): the decoder's final hidden state at the last attended token through `score`, a
    Linear(H, 1) without bias. `decoder` is the transformer body (a LlamaModel; with LoRA, the
    adapted one inside a PEFT model: `backbone` then holds the PEFT model so that adapters can be
    saved and merged)."""

    def __init__(self, backbone: torch.nn.Module, score: torch.nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.score = score

    @property
    def decoder(self) -> torch.nn.Module:
        backbone = self.backbone
        if hasattr(backbone, "get_decoder"):
            return backbone.get_decoder()
        return getattr(backbone, backbone.base_model_prefix)

    @property
    def config(self):
        return self.backbone.config

    @classmethod
    def from_policy(cls, policy: torch.nn.Module, seed: int = 0) -> "RewardModel":
        """A reward model on `policy`'s decoder (a causal LM, maybe LoRA-wrapped: its LM head is not
        used) with a fresh head drawn from N(0, 1/sqrt(H + 1)) by `seed`. Not zero: a zero head
        gives every pair loss ln 2, accuracy 0 (ties are wrong) and no gradient into the backbone on
        the first step."""
        hidden = policy.config.hidden_size
        parameter = next(policy.parameters())
        score = torch.nn.Linear(hidden, 1, bias=False)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            score.weight.copy_(torch.randn(1, hidden, generator=generator) / math.sqrt(hidden + 1))
        return cls(policy, score.to(device=parameter.device, dtype=torch.float32))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(N, L) ids and attention mask -> (N,) float32 rewards. Position ids count real tokens, so a
        row scores the same right-padded, left-padded or alone."""
        hidden = self.decoder(input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids_from_attention_mask(attention_mask)).last_hidden_state  # (N, L, H)
        pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_attended_index(attention_mask)]  # (N, H)
        return self.score(pooled.to(self.score.weight.dtype)).squeeze(-1).float()


def batch_rewards(model: RewardModel, batch, rows=slice(None), shared_prompt: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) chosen and (n,) rejected rewards of `rows` of a `PreferenceBatch` (tokenised pairs):
    the trainer's function of `posttrain rm`. Each pair's common prefix (its prompt, and the
    response tokens both answers begin with) is computed once for both rows where the model allows:
    one row a pair (`packed_pair_rewards`), else a shared KV cache (`shared_prompt_rewards`), else
    (or with `shared_prompt` False) one forward of the 2n right-padded rows."""
    chosen, rejected = batch.chosen, batch.rejected
    if shared_prompt:
        packed = packed_pair_rewards(model, chosen.input_ids[rows], chosen.attention_mask[rows], rejected.input_ids[rows],
                                     rejected.attention_mask[rows])
        if packed is not None:
            return packed
    width = max(chosen.input_ids.shape[1], rejected.input_ids.shape[1])

    def pad(tensor: torch.Tensor) -> torch.Tensor:  # right-pad to a common width (pooling reads the mask)
        return torch.nn.functional.pad(tensor[rows], (0, width - tensor.shape[1]))

    input_ids = torch.cat([pad(chosen.input_ids), pad(rejected.input_ids)])
    attention = torch.cat([pad(chosen.attention_mask), pad(rejected.attention_mask)])
    rewards = None
    if shared_prompt:
        n = input_ids.shape[0] // 2
        shared = common_prefix_lengths(input_ids[:n], attention[:n], input_ids[n:], attention[n:]).repeat(2)  # (2n,)
        own = attention.bool() & (attention.long().cumsum(-1) > shared[:, None])  # (2n, L): each row's tokens after the shared ones
        rewards = shared_prompt_rewards(model, input_ids, attention, own)
    if rewards is None:
        rewards = model(input_ids, attention)
    n = rewards.shape[0] // 2
    return rewards[:n], rewards[n:]


def packed_pair_rewards(model: RewardModel, chosen_ids: torch.Tensor, chosen_mask: torch.Tensor, rejected_ids: torch.Tensor,
                        rejected_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(n,) chosen and (n,) rejected rewards of n pairs ((n, L) ids and attention masks a side,
    either padding side) in one decoder pass, each pair's common prefix (`common_prefix_lengths`,
    c tokens) computed once. Pair i is laid as

        [common prefix (c) | chosen's own tokens | rejected's own tokens]

    with position ids as in the separate rows (the rejected tokens' count on from c), and the n
    pairs are packed one after another in a single row without padding (`models.packing`): every
    matmul runs on real tokens only, and attention runs per pair under a mask in which each token
    sees the prefix and the earlier tokens of its own answer, never the other answer's. No KV
    cache: as many weight-gradient products as layers. Equal to `model(...)` on the 2n rows in
    value and gradient (tested). None (the caller takes another path) unless the model is a
    Llama-type decoder under SDPA attention (`models.packing.use_packed_attention`)."""
    from posttrain.models.forward import SUPPORTED_MODEL_TYPES  # here: forward.py imports the data package's batches

    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES or not use_packed_attention(model.decoder):
        return None
    pairs = PackedPairs.of(chosen_ids, chosen_mask, rejected_ids, rejected_mask)
    hidden = model.decoder(input_ids=pairs.ids[None], attention_mask=pairs.layout.masks, position_ids=pairs.positions[None],
                           packed_layout=pairs.layout).last_hidden_state[0]  # (R, H)
    n = pairs.starts.shape[0]
    rows = torch.arange(n, device=hidden.device)
    pooled = hidden[torch.cat([pairs.at(0, rows, pairs.chosen_lengths - 1), pairs.at(1, rows, pairs.rejected_lengths - 1)])]  # (2n, H): each answer's EOS
    rewards = model.score(pooled.to(model.score.weight.dtype)).squeeze(-1).float()
    return rewards[:n], rewards[n:]


def shared_prompt_rewards(model: RewardModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          mask: torch.Tensor) -> torch.Tensor | None:
    """(N,) rewards of (N, L) rows (prompt then response; `mask` True on response tokens) with each
    distinct prompt computed once: a pair's chosen and rejected rows share theirs, and with short
    answers the prompt is most of each row. "Prompt" is whatever leads `mask`: `batch_rewards` gives
    a pair's whole common prefix, the response tokens both answers begin with included. The rows
    are re-laid as [left-padded prompt | right-padded response | one pad column] (width P + T + 1) and run through
    `forward.shared_prefix_logits` for T + 1 positions, whose hidden state t is the state after the
    prompt's last token plus t response tokens: t = the response's length pools its EOS. None (the
    caller runs the plain forward) for a model that path does not support, or a row without a prompt
    or a response token. Equal to `model(input_ids, attention_mask)` in value and gradient (tested)."""
    from posttrain.models.forward import shared_prefix_logits  # here: forward.py imports the data package's batches

    real = attention_mask.bool()
    prompt_lengths, response_lengths = (real & ~mask.bool()).sum(-1), mask.bool().sum(-1)  # (N,)
    if int(prompt_lengths.min()) < 1 or int(response_lengths.min()) < 1:
        return None
    P, T = int(prompt_lengths.max()), int(response_lengths.max())
    rows, columns = real.nonzero(as_tuple=True)
    targets = P - prompt_lengths[rows] + (real.long().cumsum(-1) - 1)[rows, columns]  # the prompt ends at column P - 1
    laid_ids = input_ids.new_zeros(input_ids.shape[0], P + T + 1)
    laid_ids[rows, targets] = input_ids[rows, columns]
    laid_mask = torch.zeros_like(laid_ids)
    laid_mask[rows, targets] = 1
    inputs = {"input_ids": laid_ids, "attention_mask": laid_mask, "position_ids": position_ids_from_attention_mask(laid_mask)}
    hidden = shared_prefix_logits(model.backbone, inputs, slice(None), P, T + 1, hidden_states=True)  # (N, T + 1, H)
    if hidden is None:
        return None
    pooled = hidden[torch.arange(hidden.shape[0], device=hidden.device), response_lengths]  # (N, H): the state after the EOS
    return model.score(pooled.to(model.score.weight.dtype)).squeeze(-1).float()


def weights_hash(model: torch.nn.Module) -> str:
    """sha256 of every tensor of `model`'s state dict, in name order: a reward model's identity for
    independence (the same weights as reward and checker are not independent)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def chat_template_hash(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    return hashlib.sha256(template.encode()).hexdigest()[:16] if isinstance(template, str) else None


def export(model: RewardModel, tokenizer, directory: str | Path, meta: dict[str, Any]) -> Path:
    """Write `model` as a transformers sequence-classification directory (`num_labels` 1, the
    decoder's weights, `score.weight`; LoRA merged), its tokenizer with a pad token that is not the
    EOS, and `reward_model.json` (`meta` plus the pooling rule, the pad and EOS ids and the chat
    template's hash). Returns the directory."""
    from transformers import AutoModelForSequenceClassification

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    backbone = model.backbone
    if is_lora(backbone):
        backbone = copy.deepcopy(backbone).merge_and_unload()
    tokenizer = copy.deepcopy(tokenizer)
    decoder_state = {key: value.detach().cpu() for key, value in (backbone.get_decoder() if hasattr(backbone, "get_decoder")
                                                                  else getattr(backbone, backbone.base_model_prefix)).state_dict().items()}
    added = tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id
    if added:  # transformers pools on the last token that is not the pad id: the pad must not be the EOS
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    config = copy.deepcopy(backbone.config)
    config.num_labels, config.pad_token_id, config.architectures = 1, tokenizer.pad_token_id, None
    if added:  # one more embedding row, for the pad (never read: padding is masked)
        embeddings = decoder_state["embed_tokens.weight"]
        decoder_state["embed_tokens.weight"] = torch.cat([embeddings, embeddings.mean(0, keepdim=True)])
        config.vocab_size = embeddings.shape[0] + 1
    classifier = AutoModelForSequenceClassification.from_config(config).to(next(iter(decoder_state.values())).dtype)
    getattr(classifier, classifier.base_model_prefix).load_state_dict(decoder_state)
    with torch.no_grad():
        classifier.score.weight.copy_(model.score.weight.detach().cpu().to(classifier.score.weight.dtype))
    classifier.config.architectures = [type(classifier).__name__]
    classifier.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    full = {**meta, "pooling": POOLING, "eos_appended": True, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id, "pad_token_added": added, "chat_template_sha256": chat_template_hash(tokenizer),
            "loads_with": "transformers.AutoModelForSequenceClassification (num_labels=1): the same scores on right-padded rows"}
    (directory / META_FILE).write_text(json.dumps(full, indent=1, default=str) + "\n")
    return directory


def load_reward_model(directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(RewardModel, tokenizer, meta) from an `export` directory, in eval mode without gradients.
    A directory without reward_model.json is one UserError line naming the command that makes one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    directory = Path(directory)
    if not (directory / META_FILE).is_file():
        raise UserError(f"rm:{directory}: not a reward model directory (no {META_FILE}); train one with "
                        f"posttrain rm --model M --data.pairs PAIRS.jsonl, then give its final/ directory")
    meta = json.loads((directory / META_FILE).read_text())
    classifier = AutoModelForSequenceClassification.from_pretrained(directory, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    model = RewardModel(classifier, classifier.score).to(device).eval().requires_grad_(False)
    return model, tokenizer, meta
