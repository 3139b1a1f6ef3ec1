"""Fused CPU kernels for the fast decoder's decode step (``kernels.c``), built on first use.

The C file is compiled once per machine (``cc -O3 -march=native -fopenmp -shared``, about a second;
no torch headers) into ``$POSTTRAIN_KERNEL_CACHE`` or ``~/.cache/posttrain/kernels``, named by a
hash of the source, the flags, the compiler and the CPU, and loaded with ctypes. If there is no C
compiler, the build fails, or ``POSTTRAIN_KERNELS=0``, ``load()`` returns None (one warning says
why) and the decoder keeps its pure-torch path, which is also the reference the kernels are tested
against (tests/test_rollout_kernels.py).

Five kernels:

* ``linear(x, blocked, n, bias, add)``: the decoder's matmuls, with weights from ``pack_blocked``.
  At 16 rows it runs near the FMA peak, which oneDNN's prepacked kernel does not reach
  (timings in docs/rollout.md).
* ``rms_norm(x, weight, eps)``: one pass over (n, d) rows.
* ``silu_mul(gate_up)``: SwiGLU's ``silu(gate) * up`` of the fused gate|up projection.
* ``sample_cdf(probs, uniforms, block)``: the sampler's two-level inverse CDF
  (``sampling.sample_from_probs``), which in torch spends most of its time converting the whole
  (n, V) to float64.
* ``pt_decode_attention`` (filled ``AttentionArgs``; the decoder calls it directly): for one layer,
  rope q and k, write k and v into the KV cache, and attend over the cache. Rows that share a
  prompt (``Sharing``) read the shared columns once per group instead of once per row: with G
  samples per prompt, the prompt's keys and values are read 1/G times.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
MAX_HEAD_DIM = 512  # MAX_D in kernels.c; the attention kernel also needs head_dim % 16 == 0
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]


class AttentionArgs(ctypes.Structure):
    """Mirror of ``pt_attention_args`` in kernels.c (same field order and types)."""

    _fields_ = [
        ("qkv", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
        ("row_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64), ("S", ctypes.c_int64),
        ("key_bias", ctypes.c_void_p), ("bias_stride", ctypes.c_int64),
        ("group_start", ctypes.c_void_p), ("members", ctypes.c_void_p),
        ("groups", ctypes.c_int32), ("shared", ctypes.c_int32), ("column", ctypes.c_int32),
        ("H", ctypes.c_int32), ("K", ctypes.c_int32), ("D", ctypes.c_int32),
        ("q", ctypes.c_void_p), ("scores", ctypes.c_void_p), ("scores_stride", ctypes.c_int64),
        ("out", ctypes.c_void_p),
    ]


def _cpu_signature() -> str:
    try:
        flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else platform.processor()
    except OSError:
        return platform.processor()


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_signature(),
                                    platform.machine()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("POSTTRAIN_KERNEL_CACHE") or Path.home() / ".cache" / "posttrain" / "kernels")
    target = cache / f"decode-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:  # build beside the target, then rename:
        built = Path(scratch) / target.name                  # concurrent builders never see half a file
        libraries = ["-lmvec", "-lm"] if platform.machine() in ("x86_64", "AMD64") else ["-lm"]  # vector expf
        result = subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE), *libraries],
                                capture_output=True, text=True)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "error" in line] or [result.stderr.strip()]
            raise RuntimeError(f"{compiler} failed: {errors[0].strip()[:300]}")
        os.replace(built, target)
    logger.info("rollout kernels built: %s", target)
    return target


@functools.lru_cache(maxsize=None)
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None when they cannot be used here (the reason is logged once)."""
    if os.environ.get("POSTTRAIN_KERNELS", "1") == "0":
        logger.info("rollout kernels disabled by POSTTRAIN_KERNELS=0")
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("rollout kernels: no C compiler found; the fast decoder uses its torch path (slower)")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        logger.warning("rollout kernels unavailable (%s); the fast decoder uses its torch path (slower)", error)
        return None
    library.pt_rms_norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    library.pt_rms_norm.restype = None
    library.pt_linear.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    library.pt_linear.restype = ctypes.c_int
    library.pt_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
    library.pt_silu_mul.restype = None
    library.pt_sample_cdf.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    library.pt_sample_cdf.restype = None
    library.pt_decode_attention.argtypes = [ctypes.POINTER(AttentionArgs)]
    library.pt_decode_attention.restype = None
    library.pt_attention_args_size.restype = ctypes.c_int64
    return library


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels apply: every tensor float32 on the CPU, and the kernels built here. The
    tensors are checked first, so a CUDA or bf16 run never compiles them."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and load() is not None


def pack_blocked(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) weight -> (ceil(N/16), K, 16), the layout ``linear`` reads (rows past N are zeros)."""
    rows, inputs = weight.shape
    padded = F.pad(weight, (0, 0, 0, (-rows) % 16)) if rows % 16 else weight
    return padded.reshape(-1, 16, inputs).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
           add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias + add`` with W from ``pack_blocked``. x: (..., K) float32 -> (..., out_features);
    bias: (out_features,); add: same shape as the output."""
    x = x.contiguous()
    add = None if add is None else add.contiguous()  # held here: the C call reads it
    out = x.new_empty(*x.shape[:-1], out_features)
    rows = out.numel() // out_features
    if load().pt_linear(x.data_ptr(), rows, x.shape[-1], blocked.data_ptr(), out_features,
                        None if bias is None else bias.data_ptr(), None if add is None else add.data_ptr(),
                        out.data_ptr()) != 0:
        raise MemoryError("rollout kernels: no memory for the linear layer's scratch")
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension. x: (n, d) float32 contiguous, weight: (d,) -> (n, d)."""
    out = torch.empty_like(x)
    load().pt_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused gate|up projection. gate_up: (n, 2m) float32 contiguous -> (n, m)."""
    rows, width = gate_up.shape
    out = gate_up.new_empty(rows, width // 2)
    load().pt_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def sample_cdf(probs: torch.Tensor, uniforms: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample_from_probs`` in one pass per row (no float64 copy of the whole vocabulary).

    probs: (n, V) float32 contiguous, non-negative; uniforms: (n,) in [0, 1).
    Returns tokens (n,) long and each row's total mass (n,) float64."""
    n, vocab = probs.shape
    uniforms = uniforms.to(torch.float64).contiguous()
    tokens, totals = torch.empty(n, dtype=torch.long), torch.empty(n, dtype=torch.float64)
    load().pt_sample_cdf(probs.data_ptr(), n, vocab, block, uniforms.data_ptr(), tokens.data_ptr(), totals.data_ptr())
    return tokens, totals


class Sharing:
    """Which cache rows hold the same keys and values in columns ``[0, shared)``.

    ``group_start`` (groups + 1,) and ``members`` (n,) are int32 tensors: the rows of group g are
    ``members[group_start[g]:group_start[g + 1]]``. ``group_of`` is each row's group id.
    """

    def __init__(self, group_of: list[int], shared: int):
        self.group_of = group_of
        self.shared = shared
        order = sorted(range(len(group_of)), key=lambda row: (group_of[row], row))
        starts, previous = [], None
        for index, row in enumerate(order):
            if group_of[row] != previous:
                starts.append(index)
                previous = group_of[row]
        self.members = torch.tensor(order, dtype=torch.int32)
        self.group_start = torch.tensor(starts + [len(order)], dtype=torch.int32)
        self.groups = len(starts)

    @classmethod
    def distinct(cls, rows: int) -> "Sharing":
        return cls(list(range(rows)), 0)

    def select(self, rows: list[int], column: int) -> "Sharing":
        """The sharing after the cache keeps rows ``rows`` (new row i = old row rows[i]).

        Repeated rows share every column written so far; otherwise rows keep their old groups."""
        if len(set(rows)) < len(rows):
            return Sharing(list(rows), column)
        return Sharing([self.group_of[row] for row in rows], self.shared)
