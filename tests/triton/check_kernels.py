"""The project's Triton kernels, checked on a machine without a GPU, in a subprocess whose ``PYTHONPATH``
holds a Triton of the GPU image's version (tests/triton/test_kernels.py installs it in ``.venv/triton``;
the product's venv has none beside a CPU torch, Makefile).

    python tests/triton/check_kernels.py compile     every kernel through Triton's whole compiler (its
                                                     front end to the cubin, ptxas included) for sm_90,
                                                     the H100's and H200's architecture, with the dtypes
                                                     and constants the decode graphs use
    TRITON_INTERPRET=1 python tests/triton/check_kernels.py interpret
                                                     every kernel run by Triton's interpreter on CPU
                                                     tensors in float32 against the PyTorch operations it
                                                     replaces (the interpreter does not round bf16 as the
                                                     GPU does: tests/gpu/ checks bf16 there). The
                                                     paged attention kernel is not among them: its loop
                                                     bound is a loaded scalar, which the interpreter
                                                     cannot index with (tests/gpu/test_decode_kernels.py)

The compile check is what a kernel's first call does on the GPU, so a kernel that cannot compile fails
here rather than in the worker, where the decode graphs fall back to slower steps. Prints one line per
check and exits non-zero if any failed.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from workers import fused_kernels  # noqa: E402
from workers.attention import triton_decode  # noqa: E402
from workers.fused_decode import rotate_half  # noqa: E402

SM_90 = ("cuda", 90, 32)
# Qwen2.5-VL-7B's decode layer: 28 query heads, 4 K/V heads of 128, a 3,584-wide hidden state
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 28, 4, 128, 3584


def compile_checks() -> dict[str, Callable[[], None]]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fused = fused_kernels._compile()

    def build(
        kernel: object,
        types: list[str],
        constants: dict[str, object],
        options: dict[str, object] | None = None,
    ) -> Callable[[], None]:
        def check() -> None:
            names = kernel.arg_names  # type: ignore[attr-defined]
            signature = dict(zip(names, types + ["constexpr"] * len(constants), strict=True))
            source = ASTSource(kernel, signature, constants)
            compiled = triton.compile(source, target=GPUTarget(*SM_90), options=options)
            assert compiled.asm.get("cubin"), "no cubin"
            if options is fused_kernels.LAUNCH_OPTIONS:
                # each product rounded before its sum, as PyTorch rounds it: no fused multiply-add
                assert "fma." not in compiled.asm["ptx"], "the PTX contracts a multiply and an add"

        return check

    bf16, i64, i32, f32 = "*bf16", "*i64", "i32", "fp32"
    return {
        "add_rms_norm": build(
            fused["add_rms_norm"],
            [bf16] * 5 + [f32, i32],
            {"HAS_RESIDUAL": True, "WIDTH_PAD": fused_kernels._pad(HIDDEN)},
            fused_kernels.LAUNCH_OPTIONS,
        ),
        "add_rms_norm without a residual": build(
            fused["add_rms_norm"],
            [bf16] * 5 + [f32, i32],
            {"HAS_RESIDUAL": False, "WIDTH_PAD": fused_kernels._pad(HIDDEN)},
            fused_kernels.LAUNCH_OPTIONS,
        ),
        "rope_write": build(
            fused["rope_write"],
            [bf16] * 8 + [i64] + [i32] * 5,
            {"NUM_HEADS": HEADS, "HALF": 64, "HALF_PAD": 64},
            fused_kernels.LAUNCH_OPTIONS,
        ),
        "silu_mul": build(
            fused["silu_mul"], [bf16] * 3 + [i32] * 3, {"BLOCK": 1024}, fused_kernels.LAUNCH_OPTIONS
        ),
        "paged_decode": build(
            triton_decode._compile(),
            [bf16] * 3 + [i64] * 2 + [bf16, f32] + [i32] * 10,
            {
                "GROUP": HEADS // KV_HEADS,
                "GROUP_PAD": 16,
                "HEAD_DIM": HEAD_DIM,
                "HEAD_DIM_PAD": HEAD_DIM,
                "BLOCK_SIZE": 16,
                "KEYS": triton_decode.KEYS_PER_ITERATION,
            },
        ),
    }


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def check_add_rms_norm() -> None:
    x, residual, weight = torch.randn(5, 300), torch.randn(5, 300), torch.randn(300)

    def norm(t: torch.Tensor) -> torch.Tensor:
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6))

    out, summed = fused_kernels.add_rms_norm(x, residual, weight, 1e-6)
    close(summed, residual + x)
    close(out, norm(residual + x))
    alone, same = fused_kernels.add_rms_norm(x, None, weight, 1e-6)
    assert same is x
    close(alone, norm(x))


def check_rope_write() -> None:
    rows, heads, kv_heads, head_dim, slots_total = 6, 6, 2, 16, 40
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    q, k, v = (
        t.view(rows, -1, head_dim) for t in qkv.split([heads * head_dim, *2 * [kv_heads * head_dim]], -1)
    )
    angles = torch.rand(rows, head_dim // 2) * 100
    cos, sin = (f(torch.cat((angles, angles), -1)) for f in (torch.cos, torch.sin))
    k_pool, v_pool = (torch.full((slots_total, kv_heads, head_dim), float("nan")) for _ in range(2))
    slots = torch.randperm(slots_total)[:rows]
    rotated = fused_kernels.rope_write(q, k, v, cos, sin, k_pool, v_pool, slots)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    close(rotated, q * c + rotate_half(q) * s)
    close(k_pool[slots], k * c + rotate_half(k) * s)
    assert torch.equal(v_pool[slots], v)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert k_pool[untouched].isnan().all() and v_pool[untouched].isnan().all()


def check_silu_mul() -> None:
    gate_up = torch.randn(4, 2 * 1500) * 4
    gate, up = gate_up.split([1500, 1500], -1)  # halves of a merged projection, read in place
    close(fused_kernels.silu_mul(gate, up), torch.nn.functional.silu(gate) * up)


INTERPRET_CHECKS = {
    "add_rms_norm": check_add_rms_norm,
    "rope_write": check_rope_write,
    "silu_mul": check_silu_mul,
}


def main() -> None:
    mode = sys.argv[1]
    checks = compile_checks() if mode == "compile" else INTERPRET_CHECKS
    failed = []
    for name, check in checks.items():
        torch.manual_seed(0)
        try:
            check()
            print(f"{mode} {name}: ok", flush=True)
        except Exception:  # every check runs; each failure is printed whole
            failed.append(name)
            print(f"{mode} {name}: FAILED\n{traceback.format_exc()}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
