"""The C kernels of the fast decoder (posttrain/rollout/kernels.c) against its pure-torch path.

The torch path is itself checked against each architecture's own forward in
tests/test_rollout_decoders.py; here the kernel path must give the same logits (float32 rounding),
through left padding, prompts shared by G rows, 16-column tile edges, compaction and regrouping.
"""

import ctypes
import shutil

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import build_tiny_model, build_tiny_tokenizer
from posttrain.rollout import SamplingConfig, generate, kernels
from posttrain.rollout.engine import _left_pad
from posttrain.rollout.llama_decoder import LlamaDecoder
from tests.test_rollout_decoders import ARCHITECTURES, build

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler: the decoder runs its torch path only")


def test_kernels_build_here():
    """With a compiler present, a failed build is a bug, not a reason to fall back silently."""
    assert kernels.load() is not None


@pytest.mark.parametrize("rows, dim", [(1, 16), (5, 576), (16, 100)])
def test_rms_norm_equals_torch(rows, dim):
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, dim, generator=generator) * 3, torch.randn(dim, generator=generator)
    expected = F.rms_norm(x, (dim,), weight, 1e-5)
    assert torch.allclose(kernels.rms_norm(x, weight, 1e-5), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 9, 16, 17, 40])
@pytest.mark.parametrize("features", [16, 101])
def test_linear_equals_f_linear(rows, features):
    """Row counts below, at and past the 16-row tile; out features not a multiple of the 16-column
    block (the LM head of most vocabularies); with and without bias and the fused residual add."""
    generator = torch.Generator().manual_seed(rows * features)
    weight = torch.randn(features, 72, generator=generator)
    bias, x = torch.randn(features, generator=generator), torch.randn(rows, 72, generator=generator)
    residual = torch.randn(rows, features, generator=generator)
    blocked = kernels.pack_blocked(weight)
    assert blocked.shape == (-(-features // 16), 72, 16)
    expected = F.linear(x, weight)
    assert torch.allclose(kernels.linear(x, blocked, features), expected, atol=1e-5, rtol=1e-5)
    got = kernels.linear(x.view(1, rows, 72), blocked, features, bias, add=residual.view(1, rows, features))
    assert got.shape == (1, rows, features)
    assert torch.allclose(got[0], expected + bias + residual, atol=1e-5, rtol=1e-5)


def test_silu_mul_equals_torch():
    gate_up = torch.randn(7, 2 * 45, generator=torch.Generator().manual_seed(0)) * 6
    gate_up[0, :3] = torch.tensor([-200.0, 200.0, 0.0])  # exp overflow and underflow
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_sharing_groups_follow_selects():
    distinct = kernels.Sharing.distinct(3)
    assert (distinct.groups, distinct.shared) == (3, 0)
    repeated = distinct.select([0, 0, 0, 1, 1, 1, 2, 2, 2], column=7)  # G=3 rows per prompt
    assert (repeated.groups, repeated.shared) == (3, 7)
    assert repeated.group_start.tolist() == [0, 3, 6, 9]
    assert repeated.members.tolist() == list(range(9))
    compacted = repeated.select([0, 2, 3, 5, 6], column=12)  # rows 1, 4, 7, 8 finished
    assert compacted.shared == 7  # what they share was written before the repeat
    assert compacted.group_start.tolist() == [0, 2, 4, 5]
    assert compacted.members.tolist() == [0, 1, 2, 3, 4]
    shuffled = repeated.select([8, 0, 4, 1], column=12)  # groups 2, 0, 1, 0
    assert shuffled.members.tolist() == [1, 3, 2, 0]  # by group, then row
    assert shuffled.group_start.tolist() == [0, 2, 3, 4]


def _decode_both(model, prompts, group_size, steps, drop_at, keep):
    """Prefill, repeat each prompt to G rows, decode `steps` fixed tokens, compact to `keep` at step
    `drop_at`; the logits of every step from the torch path and from the kernel path."""
    longest = max(map(len, prompts))
    prompt_ids, prompt_mask = _left_pad(prompts, 0, longest)
    rows = len(prompts) * group_size
    tokens = torch.randint(3, model.config.vocab_size, (rows, steps), generator=torch.Generator().manual_seed(0))
    results = []
    for use_kernels in (False, True):
        decoder = LlamaDecoder(model, use_kernels=use_kernels)
        assert decoder.kernels is use_kernels
        out = [decoder.prefill(prompt_ids, prompt_mask, longest + steps, max_rows=rows)]
        decoder.select(torch.arange(len(prompts)).repeat_interleave(group_size))
        active = torch.arange(rows)
        for step in range(steps):
            if step == drop_at:
                decoder.select(keep)
                active = active[keep]
            out.append(decoder.decode(tokens[active, step]))
        results.append(out)
    return results


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_kernel_path_equals_torch_path(name):
    """Prompts of 37 and 21 tokens (the shared part spans whole and partial 16-column tiles), G=3
    (with 2 query heads per kv head, neither a multiple of the 4-query tile), 30 steps across the
    tile edges, rows 1 and 4 dropped half way."""
    model = build(name)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 101, (37,), generator=generator).tolist(),
               torch.randint(3, 101, (21,), generator=generator).tolist()]
    torch_path, kernel_path = _decode_both(model, prompts, group_size=3, steps=30, drop_at=13,
                                           keep=torch.tensor([0, 2, 3, 5]))
    for step, (expected, got) in enumerate(zip(torch_path, kernel_path)):
        assert torch.allclose(got, expected, atol=2e-5, rtol=1e-5), (step, (got - expected).abs().max())


def test_kernel_path_with_many_rows_per_prompt_and_regrouping():
    """G=8 on the tiny model (4 heads, no GQA): 8 queries per group tile; then a select that
    repeats rows again mid-decode (a regroup: the new groups share every column written so far)."""
    model = build_tiny_model(seed=0)[0].eval()
    prompts = [[5, 6, 7, 8, 9] * 7, [10, 11, 12] * 4]
    longest = max(map(len, prompts))
    prompt_ids, prompt_mask = _left_pad(prompts, 0, longest)
    tokens = torch.randint(3, model.config.vocab_size, (16, 12), generator=torch.Generator().manual_seed(2))
    results = []
    for use_kernels in (False, True):
        decoder = LlamaDecoder(model, use_kernels=use_kernels)
        out = [decoder.prefill(prompt_ids, prompt_mask, longest + 12, max_rows=16)]
        decoder.select(torch.arange(2).repeat_interleave(8))
        for step in range(12):
            if step == 6:
                decoder.select(torch.tensor([0, 0, 9, 9, 9]))
            out.append(decoder.decode(tokens[:decoder.kv.shape[2], step]))
        results.append(out)
    for expected, got in zip(*results):
        assert torch.allclose(got, expected, atol=2e-5, rtol=1e-5), (got - expected).abs().max()


def test_generate_is_the_same_with_and_without_kernels(monkeypatch):
    """Whole rollouts: the same tokens and log-probs (to float32 rounding) from both paths."""
    model = build_tiny_model(seed=0)[0].eval()
    tokenizer = build_tiny_tokenizer()
    sampling = SamplingConfig(temperature=0.9, top_p=0.95, max_new_tokens=24)
    prompts = ["Q: 12+30=?", "Q: 7*6=?", "abc"]
    with_kernels = generate(model, tokenizer, prompts, group_size=4, sampling=sampling, seed=3, backend="fast")
    monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    without = generate(model, tokenizer, prompts, group_size=4, sampling=sampling, seed=3, backend="fast")
    assert torch.equal(with_kernels.completion_ids, without.completion_ids)
    assert torch.allclose(with_kernels.logprobs, without.logprobs, atol=1e-4)
    assert torch.allclose(with_kernels.sampler_logprobs, without.sampler_logprobs, atol=1e-4)


def test_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path, caplog):
    compiler = tmp_path / "broken-cc"  # knows its version, fails to compile
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "broken-cc 1.0" && exit 0\n'
                        'echo "kernels.c:1: error: this compiler is broken" >&2; exit 1\n')
    compiler.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("POSTTRAIN_KERNEL_CACHE", str(cache))
    monkeypatch.setenv("CC", str(compiler))
    kernels.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="posttrain.rollout.kernels"):
            assert kernels.load() is None
        assert "rollout kernels unavailable" in caplog.text and "broken-cc failed: kernels.c:1: error: this compiler is broken" in caplog.text
        assert not kernels.usable(torch.zeros(1))
        assert LlamaDecoder(build("qwen2")).kernels is False  # the torch path
        with pytest.raises(ValueError, match="kernels cannot run"):
            LlamaDecoder(build("qwen2"), use_kernels=True)
        monkeypatch.delenv("CC")
        monkeypatch.setenv("POSTTRAIN_KERNELS", "0")
        kernels.load.cache_clear()
        assert kernels.load() is None
        assert list(cache.iterdir()) == []  # nothing half-built left behind
    finally:
        kernels.load.cache_clear()


def test_tensors_not_cpu_float32_never_build_the_kernels(monkeypatch, tmp_path):
    """A CUDA or bf16 run asks `usable` about its tensors: the answer is no, without compiling (the
    build takes about a second and writes a cache file)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("POSTTRAIN_KERNEL_CACHE", str(cache))
    kernels.load.cache_clear()
    try:
        assert not kernels.usable(torch.zeros(2, dtype=torch.bfloat16))
        assert not kernels.usable(torch.zeros(2, device="meta"))  # stands in for a CUDA tensor
        assert not kernels.usable(torch.zeros(2), torch.zeros(2, dtype=torch.float16))
        assert kernels.load.cache_info().misses == 0, "load() was called"
        assert not cache.exists()
        assert kernels.usable(torch.zeros(2)) and cache.exists()  # CPU float32 builds them, once
    finally:
        kernels.load.cache_clear()


def test_attention_args_mirror_the_c_struct():
    """ctypes lays AttentionArgs out as the C compiler lays out pt_attention_args."""
    library = kernels.load()
    assert ctypes.sizeof(kernels.AttentionArgs) == library.pt_attention_args_size()


def test_sample_cdf_equals_the_torch_sampler(monkeypatch):
    """The C inverse CDF draws the same tokens and totals as the torch one: V = 1000 (not a multiple
    of the 128-token block), a third of the tokens at 0, u up to the edge (rounding past the total)."""
    from posttrain.rollout import sampling

    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(400, 1000, generator=generator)
    probs[torch.rand(400, 1000, generator=generator) < 0.33] = 0.0
    probs[7, 900:] = 0.0  # the last block has no mass: an overflow must fall back to an earlier one
    uniforms = torch.rand(400, generator=generator, dtype=torch.float64)
    uniforms[:8] = torch.tensor([0.0, 1e-12, 0.5, 1 - 1e-16, 1 - 1e-12, 0.999999, 0.25, 1 - 1e-16],
                                dtype=torch.float64)
    tokens, totals = sampling.sample_from_probs(probs, uniforms)
    monkeypatch.setattr(kernels, "usable", lambda *tensors: False)
    expected_tokens, expected_totals = sampling.sample_from_probs(probs, uniforms)
    assert torch.equal(tokens, expected_tokens)
    assert torch.allclose(totals, expected_totals, rtol=1e-12)
    assert (probs.gather(-1, tokens.unsqueeze(-1)) > 0).all()
