"""The wgmma kernels' MXFP4 dequantiser (ops/routed/gluon/lut_dequant.py) on the H200 itself: every code at every
position of a word, under every E8M0 byte, against the exact value (the CPU test runs the same PTX through an
emulator; this one checks the hardware's bf16x2 multiply on subnormal operands). pytest -m gpu; sm_90 only."""

from __future__ import annotations

import pytest
import torch
import triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="the Gluon dequantiser is sm_90 only"),
]


def _kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from latent_moe_fusion.ops.routed.gluon.lut_dequant import codes_to_bf16, scale_factors

    @gluon.jit
    def dequant_words(words_ptr, scales_ptr, out_ptr, n, BLOCK: gl.constexpr):
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        i = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
        live = i < n
        w = gl.load(words_ptr + i, mask=live, other=0)
        s = gl.load(scales_ptr + i, mask=live, other=0).to(gl.int32)
        outs = codes_to_bf16(w, scale_factors(s))  # as dequant_kappa and the staged kernels compute them
        for c in gl.static_range(8):
            gl.store(out_ptr + i * 8 + c, outs[c], mask=live)

    return dequant_words


def test_every_code_position_and_scale_byte_on_the_gpu(rng_seed):
    from latent_moe_fusion.ops.common.mxfp4 import e2m1_lut
    from latent_moe_fusion.ops.routed.gluon.lut_dequant import SCALE_BYTES_EXACT, WINDOW

    gen = torch.Generator().manual_seed(rng_seed)
    structured = [c * 0x11111111 for c in range(16)] + [
        sum(((k + s) % 16) << (4 * k) for k in range(8)) for s in range(16)]
    words = torch.tensor(structured + torch.randint(0, 2**32, (96,), generator=gen).tolist(), dtype=torch.int64)
    words = words.repeat(256)  # every word under every scale byte
    scales = torch.arange(256).repeat_interleave(len(words) // 256)
    w32 = words.where(words < 2**31, words - 2**32).to(torch.int32)
    out = torch.full((len(words), 8), float("nan"), dtype=torch.bfloat16, device="cuda")
    _kernel()[(triton.cdiv(len(words), 128),)](w32.cuda(), scales.to(torch.uint8).cuda(), out, len(words), BLOCK=128,
                                               num_warps=4)
    got = out.float().cpu().double() * 2.0**WINDOW
    codes = (words[:, None] >> (4 * torch.arange(8))) & 0xF
    exact = e2m1_lut().double()[codes] * torch.exp2(scales.double() - 127)[:, None]
    lo, hi = SCALE_BYTES_EXACT
    inside = (scales >= lo) & (scales <= hi)
    assert torch.equal(got[inside], exact[inside])  # bit for bit (subnormal operands included)
    below = scales < lo
    assert (got[below] - exact[below]).abs().max() <= 2.0 ** (-133 + WINDOW - 1)  # rounded towards 0
    assert not torch.isfinite(got[scales > hi]).any()  # never a finite wrong value

