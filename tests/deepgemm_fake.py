"""A fake `deep_gemm` module for CPU tests of the DeepGEMM argument mapping.

Each function has the documented Python signature (see the backend modules' docstrings for the
repository and path) and checks what DeepGEMM's host code checks: shapes, dtypes, contiguity,
the packed UE8M0 scale layout (int32, 4 bytes per int along K, MN-major, MN padded to 4), that
weights went through `transform_weights_for_mega_moe`, the publication workspace contract. It then
computes what the kernel computes, in plain torch, from the bytes it was given (decoding FP4
codes, scales, interleaved rows), and writes the results where the kernel writes them, peer
pointers included (resolved through `memory`). Written from the API's documentation and host
checks; no DeepGEMM code is reproduced.
"""

from __future__ import annotations

import importlib.machinery
import math
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from latent_moe_fusion.ops.common.mxfp4 import e2m1_lut
from latent_moe_fusion.ops.common.reference_math import rms_norm_math, situ
from latent_moe_fusion.ops.routed.deepgemm.formats import dequantize_fp8_ue8m0, e8m0_as_float, pack_ue8m0, unpack_ue8m0

INTERLEAVE = 8  # gate/up rows interleaved in groups of 8
UTCCP_ROWS = 128


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(f"fake deep_gemm: {msg}")


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def mn_major_int32(packed: torch.Tensor) -> torch.Tensor:
    """[G, MN, KP] int32 -> same values in DeepGEMM's MN-major, TMA-aligned layout."""
    g, mn, kp = packed.shape
    storage = torch.zeros(g, kp, _align(mn, 4), dtype=torch.int32)
    out = storage.transpose(1, 2)[:, :mn]
    out.copy_(packed)
    return out


def check_sf_layout(sf: torch.Tensor, mn: int, k: int, groups: int, what: str) -> None:
    _require(sf.dtype == torch.int32, f"{what}: scales must be int32 packed UE8M0, got {sf.dtype}")
    _require(tuple(sf.shape) == (groups, mn, math.ceil(k / 128)), f"{what}: scale shape {tuple(sf.shape)}")
    _require(sf.stride(-2) == 1, f"{what}: scales must be MN-major (strides {sf.stride()})")
    _require(sf.stride(-1) == _align(mn, 4), f"{what}: MN stride must be TMA-aligned {_align(mn, 4)}")
    _require(sf.stride(-3) == sf.stride(-1) * sf.size(-1), f"{what}: group stride")


def interleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[.., N, ...] gate rows then up rows -> blocks of 8 gate rows, 8 up rows, alternating."""
    n = t.shape[-2]
    half = n // 2
    idx = torch.arange(n).view(2, half // INTERLEAVE, INTERLEAVE).transpose(0, 1).reshape(-1)
    return t.index_select(t.dim() - 2, idx)


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    n = t.shape[-2]
    half = n // 2
    idx = torch.arange(n).view(2, half // INTERLEAVE, INTERLEAVE).transpose(0, 1).reshape(-1)
    inv = torch.empty_like(idx)
    inv[idx] = torch.arange(n)
    return t.index_select(t.dim() - 2, inv)


def utccp_rows(mn: int) -> torch.Tensor:
    """Row permutation inside each 128 rows: new row 4*j + i holds old row 32*i + j."""
    new = torch.arange(mn)
    block, within = new // UTCCP_ROWS, new % UTCCP_ROWS
    return block * UTCCP_ROWS + (within % 4) * 32 + within // 4


def decode_fp4(w: torch.Tensor, sf_packed_rows: torch.Tensor) -> torch.Tensor:
    """int8 packed FP4 [N, K/2] + UE8M0 bytes [N, K/32] -> float32 [N, K]."""
    b = w.view(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(w.shape[0], -1).long()
    vals = e2m1_lut()[codes]
    scale = e8m0_as_float(sf_packed_rows)
    return (vals.view(w.shape[0], -1, 32) * scale.unsqueeze(-1)).reshape(w.shape[0], -1)


@dataclass
class FakeSymmBuffer:
    group: Any
    num_experts: int
    num_max_tokens_per_rank: int
    num_topk: int
    hidden: int
    intermediate_hidden: int
    bf16_shared_intermediate_hidden: int
    num_shared_experts: int = 0
    mma_type: str = "fp8xfp4"
    activation: str = "situ"
    x: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        t, h = self.num_max_tokens_per_rank, self.hidden
        self.x = torch.zeros(t, h, dtype=torch.float8_e4m3fn)
        self.x_sf = torch.zeros(t, h // 128, dtype=torch.int32)
        self.topk_idx = torch.full((t, self.num_topk), -7, dtype=torch.int64)
        self.topk_weights = torch.full((t, self.num_topk), float("nan"))
        self.shared_bf16_l2_acts = torch.empty(t, self.bf16_shared_intermediate_hidden, dtype=torch.bfloat16)
        self.buffer = torch.zeros(64, dtype=torch.int8)
        self.handle = types.SimpleNamespace(buffer_ptrs=[0] * self.group.size())


class FakeDeepGemm:
    """Holds the call log and the fake's state; `.module` is what goes into sys.modules."""

    def __init__(self, token_alignment: int = 16, mk_alignment: int = 32) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.memory: dict[int, torch.Tensor] = {}  # data_ptr -> tensor, for peer pointers
        self.transformed: list[torch.Tensor] = []
        self.token_alignment = token_alignment
        self.mk_alignment = mk_alignment
        self.module = self._build()

    # ---- bookkeeping -------------------------------------------------------------------------
    def _log(self, name: str, **kwargs) -> None:
        self.calls.append((name, kwargs))

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def _mark(self, t: torch.Tensor) -> torch.Tensor:
        self.transformed.append(t)
        return t

    def _is_transformed(self, t: torch.Tensor) -> bool:
        return any(t is u for u in self.transformed)

    # ---- the module --------------------------------------------------------------------------
    def _build(self) -> types.ModuleType:
        fake = self
        mod = types.ModuleType("deep_gemm")
        mod.__spec__ = importlib.machinery.ModuleSpec("deep_gemm", None)
        mod.__version__ = "fake-2.6.1"

        def transform_sf_into_required_layout(sf, mn, k, recipe, num_groups=None, is_sfa=None,
                                              disable_ue8m0_cast=False, psum_layout=None):
            fake._log("transform_sf_into_required_layout", mn=mn, k=k, recipe=recipe, num_groups=num_groups)
            _require(sf.dtype == torch.float32, f"sf must be float32 powers of two, got {sf.dtype}")
            _require(tuple(recipe) == (1, 32) and is_sfa is None, f"recipe {recipe} / is_sfa {is_sfa}")
            _require(sf.dim() == 3 and num_groups == sf.shape[0], "grouped sf needs num_groups = sf.shape[0]")
            _require(tuple(sf.shape[1:]) == (mn, math.ceil(k / 32)), f"sf shape {tuple(sf.shape)} vs mn={mn}, k={k}")
            bits = sf.contiguous().view(torch.int32)
            _require(bool(((bits & ~0x7F800000) == 0).all()), "sf holds values that are not UE8M0 (sign/mantissa set)")
            return mn_major_int32(pack_ue8m0((bits >> 23).to(torch.uint8)))

        def transform_weights_for_mega_moe(l1_weights, l2_weights, activation="swiglu"):
            fake._log("transform_weights_for_mega_moe", activation=activation, fp4=isinstance(l1_weights, tuple))
            _require(activation == "situ", f"activation must be 'situ' for Kimi K3, got {activation!r}")
            if isinstance(l1_weights, tuple):
                (w1, sf1), (w2, sf2) = l1_weights, l2_weights
                for name, w in (("l1", w1), ("l2", w2)):
                    _require(w.dtype == torch.int8 and w.dim() == 3 and w.is_contiguous(),
                             f"{name} weights must be contiguous int8 [E, N, K/2], got {w.dtype} {tuple(w.shape)}")
                e, n1, k1 = w1.shape[0], w1.shape[1], w1.shape[2] * 2
                n2, k2 = w2.shape[1], w2.shape[2] * 2
                _require(n1 % (2 * INTERLEAVE) == 0 and n1 % UTCCP_ROWS == 0 and n2 % UTCCP_ROWS == 0, "N alignment")
                check_sf_layout(sf1, n1, k1, e, "l1 sf")
                check_sf_layout(sf2, n2, k2, e, "l2 sf")
                l1_sf = mn_major_int32(interleave_rows(sf1.contiguous())[:, utccp_rows(n1)])
                l2_sf = mn_major_int32(sf2.contiguous()[:, utccp_rows(n2)])
                l1 = (fake._mark(interleave_rows(w1).contiguous()), fake._mark(l1_sf))
                return l1, (fake._mark(w2), fake._mark(l2_sf))
            _require(l1_weights.dtype == torch.bfloat16 and l1_weights.dim() == 2 and l1_weights.is_contiguous(),
                     "BF16 shared L1 must be contiguous bf16 [2 I_s, H]")
            _require(l2_weights.dtype == torch.bfloat16 and l2_weights.dim() == 2 and l2_weights.is_contiguous(),
                     "BF16 shared L2 must be contiguous bf16 [H, I_s]")
            return fake._mark(interleave_rows(l1_weights).contiguous()), fake._mark(l2_weights)

        def get_symm_buffer_for_mega_moe(group, num_experts, num_max_tokens_per_rank, num_topk, hidden,
                                         intermediate_hidden, num_shared_experts=0, use_fp8_dispatch=None,
                                         mma_type="fp8xfp4", activation="swiglu",
                                         bf16_shared_intermediate_hidden=0):
            fake._log("get_symm_buffer_for_mega_moe", num_experts=num_experts, tokens=num_max_tokens_per_rank,
                      topk=num_topk, hidden=hidden, inter=intermediate_hidden, ranks=group.size(),
                      shared_inter=bf16_shared_intermediate_hidden)
            _require(num_experts % group.size() == 0, "num_experts must divide over the ranks")
            _require(mma_type == "fp8xfp4" and activation == "situ", f"{mma_type}/{activation}")
            _require(num_shared_experts == 0 and bf16_shared_intermediate_hidden > 0, "BF16 shared mode")
            _require(hidden % 128 == 0 and intermediate_hidden % 128 == 0, "SF alignment of hidden/intermediate")
            group.barrier()
            tokens = _align(num_max_tokens_per_rank, fake.token_alignment)
            return FakeSymmBuffer(group, num_experts, tokens, num_topk, hidden, intermediate_hidden,
                                  bf16_shared_intermediate_hidden)

        def mega(name, y, shared_y, l1_weights, l2_weights, shared_x, shared_l1_weights, shared_l2_weights,
                 rms_weight, rms_epsilon, sym_buffer, shared_rs_workspace, shared_rs_flags, shared_rs_peer_ptrs,
                 sp, cumulative_local_expert_recv_stats, recipe, activation, fast_math, situ_beta,
                 situ_linear_beta):
            fake._log(name, num_tokens=y.shape[0], num_shared_tokens=shared_x.shape[0])
            buf = sym_buffer
            _require(isinstance(buf, FakeSymmBuffer) and buf.num_shared_experts == 0, "sym_buffer")
            _require(tuple(recipe) == (1, 1, 32) and activation == "situ", f"recipe {recipe}, activation {activation}")
            _require(math.isfinite(rms_epsilon) and rms_epsilon > 0, f"rms_epsilon {rms_epsilon}")
            for b in (situ_beta, situ_linear_beta):
                _require(b is not None and math.isfinite(b) and b > 0, f"SiTU beta {b}")
            (w1, sf1), (w2, sf2) = l1_weights, l2_weights
            for t in (w1, sf1, w2, sf2, shared_l1_weights, shared_l2_weights):
                _require(fake._is_transformed(t), "weights were not passed through transform_weights_for_mega_moe")
            e, two_i, latent = w1.shape[0], w1.shape[1], w1.shape[2] * 2
            inter = two_i // 2
            _require(w1.dtype == torch.int8 and w2.dtype == torch.int8, "packed FP4 weights are int8")
            _require(tuple(w2.shape) == (e, latent, inter // 2), f"l2 shape {tuple(w2.shape)}")
            check_sf_layout(sf1, two_i, latent, e, "l1 sf")
            check_sf_layout(sf2, latent, inter, e, "l2 sf")
            ranks, rank = buf.group.size(), buf.group.rank()
            _require(buf.num_experts == e * ranks and buf.hidden == latent and buf.intermediate_hidden == inter,
                     "weights do not match the symmetric buffer")
            n, n_s = y.shape[0], shared_x.shape[0]
            _require(y.dtype == torch.bfloat16 and y.is_contiguous() and tuple(y.shape) == (n, latent), "y")
            _require(n <= buf.num_max_tokens_per_rank and n_s <= buf.num_max_tokens_per_rank, "token capacity")
            _require(shared_x.dtype == torch.bfloat16 and shared_x.is_contiguous() and n_s >= n, "shared_x")
            hidden = shared_x.shape[1]
            acts = buf.shared_bf16_l2_acts
            _require(acts.dtype == torch.bfloat16 and acts.shape[0] >= n_s, "shared intermediate capacity")
            i_s = acts.shape[1]
            _require(shared_l1_weights.dtype == torch.bfloat16 and tuple(shared_l1_weights.shape) == (2 * i_s, hidden),
                     "shared L1 [2 I_s, H] bf16")
            _require(shared_l2_weights.dtype == torch.bfloat16 and tuple(shared_l2_weights.shape) == (hidden, i_s),
                     "shared L2 [H, I_s] bf16")
            _require(rms_weight.dtype == torch.bfloat16 and rms_weight.is_contiguous()
                     and tuple(rms_weight.shape) == (latent,), "rms_weight [L] bf16")
            publish = shared_rs_workspace is not None
            _require(publish == (shared_rs_flags is not None) == (shared_rs_peer_ptrs is not None), "publish args")
            _require(publish != (shared_y is not None), "exactly one of shared_y / publication workspace")
            if publish:
                ws, flags, peers = shared_rs_workspace, shared_rs_flags, shared_rs_peer_ptrs
                _require(ws.dtype == torch.bfloat16 and ws.is_contiguous() and ws.dim() == 4, "workspace 4-D bf16")
                _require(ws.shape[0] >= (1 if sp else 3), "workspace generations")
                _require(ws.shape[1] >= (n_s // ranks if sp else n_s), "workspace rows")
                _require(ws.shape[2] == ranks, "workspace rank dim")
                _require(ws.shape[3] == hidden if sp else ws.shape[3] * ranks == hidden, "workspace columns")
                _require(not sp or n_s % ranks == 0, "SP shared tokens must split over ranks")
                _require(flags.dtype == torch.int32 and flags.is_contiguous() and flags.numel() >= 9, "flags")
                _require(peers.dtype == torch.int64 and peers.dim() == 1 and peers.numel() == ranks, "peer ptrs")
            else:
                _require(shared_y.dtype == torch.bfloat16 and shared_y.is_contiguous()
                         and tuple(shared_y.shape) == (n_s, hidden), "shared_y [num_shared_tokens, H] bf16")

            # ---- what the kernel computes, from the bytes it was handed -----------------------------
            x = dequantize_fp8_ue8m0(buf.x[:n], buf.x_sf[:n])
            ids, wts = buf.topk_idx[:n], buf.topk_weights[:n]
            first = rank * e
            _require(bool(((ids < 0) | ((ids >= first) & (ids < first + e))).all()),
                     "a token is routed to another rank's expert (the mapping must keep tokens local)")
            inv = torch.argsort(utccp_rows(two_i))
            sf1_bytes = deinterleave_rows(unpack_ue8m0(sf1.contiguous()[:, inv]))
            sf2_bytes = unpack_ue8m0(sf2.contiguous()[:, torch.argsort(utccp_rows(latent))])
            w1_plain = deinterleave_rows(w1)
            acc = torch.zeros(n, latent)
            for g in torch.unique(ids[ids >= 0]).tolist():
                rows, slots = torch.nonzero(ids == g, as_tuple=True)
                le = g - first
                w13 = decode_fp4(w1_plain[le], sf1_bytes[le][:, : latent // 32])
                w2d = decode_fp4(w2[le], sf2_bytes[le][:, : inter // 32])
                h = x[rows] @ w13.t()
                act = situ(h[:, :inter], h[:, inter:], situ_beta, situ_linear_beta).to(torch.bfloat16).float()
                acc.index_add_(0, rows, (act @ w2d.t()) * wts[rows, slots].unsqueeze(1))
            y.copy_(rms_norm_math(acc.to(torch.bfloat16), rms_weight, rms_epsilon))
            l1s = deinterleave_rows(shared_l1_weights).float()
            xs = shared_x.float()
            g_ = (xs @ l1s[:i_s].t()).to(torch.bfloat16)
            u_ = (xs @ l1s[i_s:].t()).to(torch.bfloat16)
            act_s = situ(g_, u_, situ_beta, situ_linear_beta).to(torch.bfloat16)
            s = (act_s.float() @ shared_l2_weights.float().t()).to(torch.bfloat16)
            if not publish:
                shared_y.copy_(s)
                return
            gen, stride = int(flags[0]), int(flags[2])
            _require(stride % 2 == 0 and stride >= ws[0].nbytes, "flags[2] must be the bytes of one generation")
            base = gen * stride // 2
            if sp:
                local = n_s // ranks
                for t in range(n_s):
                    dest = fake.memory[int(peers[t // local])].view(-1)
                    start = base + (t % local) * ranks * hidden + rank * hidden
                    dest[start:start + hidden] = s[t]
            else:
                shard = hidden // ranks
                for d in range(ranks):
                    dest = fake.memory[int(peers[d])].view(-1)
                    for t in range(n_s):
                        start = base + t * hidden + rank * shard
                        dest[start:start + shard] = s[t, d * shard:(d + 1) * shard]

        def fp8_fp4_mega_moe_bf16_shared(y, shared_y, l1_weights, l2_weights, shared_x, shared_l1_weights,
                                         shared_l2_weights, rms_weight, rms_epsilon, sym_buffer,
                                         cumulative_local_expert_recv_stats=None, recipe=(1, 1, 32),
                                         activation="situ", fast_math=True, situ_beta=None, situ_linear_beta=None):
            mega("fp8_fp4_mega_moe_bf16_shared", y, shared_y, l1_weights, l2_weights, shared_x, shared_l1_weights,
                 shared_l2_weights, rms_weight, rms_epsilon, sym_buffer, None, None, None, False,
                 cumulative_local_expert_recv_stats, recipe, activation, fast_math, situ_beta, situ_linear_beta)

        def _publish(name, sp):
            def fn(y, l1_weights, l2_weights, shared_x, shared_l1_weights, shared_l2_weights, rms_weight,
                   rms_epsilon, shared_rs_workspace, shared_rs_flags, shared_rs_peer_ptrs, sym_buffer,
                   cumulative_local_expert_recv_stats=None, recipe=(1, 1, 32), activation="situ", fast_math=True,
                   situ_beta=None, situ_linear_beta=None):
                mega(name, y, None, l1_weights, l2_weights, shared_x, shared_l1_weights, shared_l2_weights,
                     rms_weight, rms_epsilon, sym_buffer, shared_rs_workspace, shared_rs_flags, shared_rs_peer_ptrs,
                     sp, cumulative_local_expert_recv_stats, recipe, activation, fast_math, situ_beta,
                     situ_linear_beta)

            fn.__name__ = name
            return fn

        def m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m, compiled_dims="nk"):
            fake._log("m_grouped_bf16_gemm_nt_masked", masked_m=masked_m.clone(), expected_m=expected_m)
            g, m, k = a.shape
            _require(b.dim() == 3 and b.shape[0] == g and b.shape[2] == k, f"b {tuple(b.shape)} vs a {tuple(a.shape)}")
            _require(tuple(d.shape) == (g, m, b.shape[1]), "d [G, M, N]")
            for name, t in (("a", a), ("b", b), ("d", d)):
                _require(t.dtype == torch.bfloat16 and t.stride(-1) == 1, f"{name} must be K-major bf16")
            _require(masked_m.dtype == torch.int32 and masked_m.is_contiguous() and masked_m.numel() == g, "masked_m")
            _require(isinstance(expected_m, int) and expected_m > 0 and k % 64 == 0, "expected_m > 0, K % 64 == 0")
            _require(bool((masked_m <= m).all()), "masked_m exceeds the M capacity")
            # The real sm_90 kernel does not check this: its 64/128-row TMA tiles over [G * M, K] spill
            # into the next group when M is not a multiple of them (seen on the H200, see sm90_grouped).
            _require(m % 128 == 0, f"M per group ({m}) must be a multiple of 128 (the kernel's largest M tile)")
            for gi in range(g):
                rows = int(masked_m[gi])
                if rows:
                    d[gi, :rows] = (a[gi, :rows].float() @ b[gi].float().t()).to(torch.bfloat16)

        def m_grouped_bf16_gemm_nt_contiguous(a, b, d, grouped_layout, compiled_dims="nk", use_psum_layout=False,
                                              ensure_zero_padding=True, expected_m_for_psum_layout=None):
            fake._log("m_grouped_bf16_gemm_nt_contiguous", layout=grouped_layout.clone())
            m, k = a.shape
            _require(b.dim() == 3 and b.shape[2] == k and tuple(d.shape) == (m, b.shape[1]), "shapes")
            for name, t in (("a", a), ("b", b), ("d", d)):
                _require(t.dtype == torch.bfloat16 and t.stride(-1) == 1, f"{name} must be K-major bf16")
            _require(grouped_layout.dtype == torch.int32 and grouped_layout.is_contiguous()
                     and grouped_layout.numel() == m, "grouped_layout int32 [M]")
            _require(not use_psum_layout and k % 64 == 0 and m % fake.mk_alignment == 0, "layout / alignment")
            blocks = grouped_layout.view(-1, fake.mk_alignment)
            for blk in blocks:
                valid = blk[blk >= 0]
                _require(valid.numel() == 0 or bool((valid == valid[0]).all()), "a block mixes experts")
                _require(bool((blk[: valid.numel()] >= 0).all()), "padding rows must follow a group's rows")
            for gi in torch.unique(grouped_layout[grouped_layout >= 0]).tolist():
                rows = torch.nonzero(grouped_layout == gi).flatten()
                d[rows] = (a[rows].float() @ b[gi].float().t()).to(torch.bfloat16)

        mod.transform_sf_into_required_layout = transform_sf_into_required_layout
        mod.transform_weights_for_mega_moe = transform_weights_for_mega_moe
        mod.get_symm_buffer_for_mega_moe = get_symm_buffer_for_mega_moe
        mod.fp8_fp4_mega_moe_bf16_shared = fp8_fp4_mega_moe_bf16_shared
        mod.fp8_fp4_mega_moe_bf16_shared_rs = _publish("fp8_fp4_mega_moe_bf16_shared_rs", False)
        mod.fp8_fp4_mega_moe_bf16_shared_sp_rs = _publish("fp8_fp4_mega_moe_bf16_shared_sp_rs", True)
        mod.m_grouped_bf16_gemm_nt_masked = m_grouped_bf16_gemm_nt_masked
        mod.m_grouped_bf16_gemm_nt_contiguous = m_grouped_bf16_gemm_nt_contiguous
        mod.get_mk_alignment_for_contiguous_layout = lambda: fake.mk_alignment
        return mod


def install(monkeypatch, fake: FakeDeepGemm, arch: tuple[int, int]) -> None:
    """Put `fake` in sys.modules as deep_gemm, pretend a GPU of `arch`, forget cached probes."""
    import sys

    from latent_moe_fusion.ops.routed import deepgemm
    from latent_moe_fusion.ops.routed.deepgemm import probe

    monkeypatch.setitem(sys.modules, "deep_gemm", fake.module)
    monkeypatch.setattr(probe, "_device_capability", lambda: arch)
    deepgemm.reset_deepgemm_state()
