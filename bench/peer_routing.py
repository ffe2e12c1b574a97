"""The peer's routing data, built per call from our ids and weights as vLLM's EP path builds it.

vLLM (`gpt_oss_triton_kernels_moe.make_routing_data`, after `expert_map[topk_ids]` has turned the global ids of
other ranks' experts into -1): ids to int16, weights to BF16 (-1 where the id is -1), one bit per (token, expert) in a
bitmatrix [M, 32 * ceil(E / 32)], then triton_kernels' own metadata: `SparseMatrix` (per-expert counts, the
(token, slot) pairs sorted by expert and the inverse map) and `make_ragged_tensor_metadata` (per-expert offsets and the
tile schedule of every block size), `RoutingData`, and the gather / scatter indices of L1 and L2.

Our ids are already local (0..E-1, the rank's experts) or negative (an expert of another rank, which our op skips);
here every id outside [0, E) becomes -1, which their bitmatrix leaves without a bit and their metadata sorts after
every expert (no row of any GEMM, masked out of the top-k reduce). Our op rejects ids >= E, so in a comparison only
the negative ids are mapped. `pack_routing` does the casts, the -1 weights and the bits in one kernel where vLLM
launches about six (two casts, a memset, its pack kernel, a compare and a `torch.where`; plus its `expert_map`
lookup, which our local ids need not): if anything this understates the peer's per-call overhead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BITS_PER_WORD = 32
PACK_BLOCK_M = 64


@triton.jit
def _pack_routing(Ids, Weights, Ids16, Weights16, Bits, n_rows, n_experts,
                  TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, N_WORDS: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.arange(0, TOP_K_POW2)
    row_in = rows < n_rows
    inside = row_in[:, None] & (slots < TOP_K)[None, :]
    offs = rows[:, None] * TOP_K + slots[None, :]
    ids = tl.load(Ids + offs, mask=inside, other=-1)
    weights = tl.load(Weights + offs, mask=inside, other=0.0)
    local = (ids >= 0) & (ids < n_experts)
    ids = tl.where(local, ids, -1)
    tl.store(Ids16 + offs, ids.to(tl.int16), mask=inside)
    tl.store(Weights16 + offs, tl.where(local, weights, -1.0).to(tl.bfloat16), mask=inside)
    # a bit only for local ids: the shift never sees a negative amount
    word = tl.where(local, ids // 32, -1)
    bit = tl.full(ids.shape, 1, tl.uint32) << tl.where(local, ids % 32, 0).to(tl.uint32)
    for w in tl.static_range(N_WORDS):
        packed = tl.reduce_or(tl.where(word == w, bit, 0), axis=1)
        tl.store(Bits + rows * N_WORDS + w, packed, mask=row_in)


def pack_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids int16 [M, K] with -1 for every id outside [0, E), weights BF16 [M, K] with -1 there, bitmatrix words
    uint32 [M, ceil(E / 32)]: bit e % 32 of word e // 32 set for each local expert e of the row)."""
    m, top_k = topk_ids.shape
    if topk_ids.dtype != torch.int32 or topk_weights.dtype != torch.float32:
        raise ValueError(f"pack_routing: ids int32 and weights float32 expected, got {topk_ids.dtype}, {topk_weights.dtype}")
    words = triton.cdiv(num_experts, BITS_PER_WORD)
    ids16 = torch.empty(m, top_k, dtype=torch.int16, device=topk_ids.device)
    weights16 = torch.empty(m, top_k, dtype=torch.bfloat16, device=topk_ids.device)
    bits = torch.empty(m, words, dtype=torch.uint32, device=topk_ids.device)
    if m:
        _pack_routing[(triton.cdiv(m, PACK_BLOCK_M),)](
            topk_ids.contiguous(), topk_weights.contiguous(), ids16, weights16, bits, m, num_experts,
            TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k), N_WORDS=words, BLOCK_M=PACK_BLOCK_M)
    return ids16, weights16, bits


def make_peer_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                      expected_tokens_per_expt: int | None = None):
    """(RoutingData, GatherIndx, ScatterIndx) for matmul_ogs, from ids [M, K] int32 and weights [M, K] FP32.

    As in triton_kernels' own tests and vLLM: the gather of L1 reads sorted row p from token col_sorted[p] // K and the
    scatter of L2 writes it to (token, slot) row col_sorted[p]; the router weights of the sorted rows (BF16) are
    L2's gammas. expected_tokens_per_expt: RoutingData's hint for the tile choice (vLLM leaves it None: matmul_ogs then
    assumes M * K / E rows per expert, counting the -1 slots). Needs bench/peer_layout.use_triton_kernels first."""
    from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
    from triton_kernels.tensor import BIT, Bitmatrix, SparseMatrix, make_ragged_tensor_metadata

    m, top_k = topk_ids.shape
    ids16, weights16, bits = pack_routing(topk_ids, topk_weights, num_experts)
    mask = Bitmatrix(bits, dtype=BIT, shape=[m, bits.shape[1] * BITS_PER_WORD], shape_max=[m, None])
    sparse = SparseMatrix(indx=ids16, vals=weights16, mask=mask)
    by_expert = sparse.mask_metadata.col_sorted_indx  # sorted row -> (token, slot); -1 after the last valid one
    by_slot = sparse.mask_metadata.row_sorted_indx  # (token, slot) -> sorted row; -1 for a skipped slot
    expert_rows = make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, by_expert.shape[0])
    gammas = weights16.flatten()[by_expert]  # a -1 index (no row) reads the last weight, as in vLLM: never used
    routing = RoutingData(gammas, expert_rows.slice_sizes, num_experts, top_k, expert_rows,
                          expected_tokens_per_expt=expected_tokens_per_expt)
    return routing, GatherIndx(src_indx=by_expert, dst_indx=by_slot), ScatterIndx(src_indx=by_slot, dst_indx=by_expert)
