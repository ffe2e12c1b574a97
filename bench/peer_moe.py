"""One rank's routed experts on the peer (OpenAI's triton_kernels MXFP4 MoE), as vLLM runs them on sm_90.

Per call (vLLM's `OAITritonExperts.apply` -> `triton_kernel_fused_experts`): routing data from the ids and weights
(bench/peer_routing.py), then
  L1: matmul_ogs(z, w13, gather) with the fused activation -> act [M * K, I] BF16, rows sorted by expert;
  L2: matmul_ogs(act, w2, scatter, gammas = router weights) -> each sorted row times its weight, written BF16 to its
      (token, slot) row of a scratch [M * K, L], then triton_kernels' top-k reduce sums the K slots of each token
      (FP32 sum of the BF16 rows, skipped slots masked) into y [M, L] BF16.
Weights are converted once (bench/peer_layout.py). The opt-flag constraint split_k = 1 that vLLM sets on Hopper is
set here too: it is global to triton_kernels and changes nothing for MXFP4 weights (matmul_ogs never splits K when
the weights carry MX scales).
"""

from __future__ import annotations

import torch

from bench.peer_layout import PeerWeights, to_peer_layout
from bench.peer_routing import make_peer_routing
from bench.peer_situ import situ_activation


def apply_vllm_opt_flags() -> None:
    """vLLM's Hopper opt-flag constraint (a process-wide setting of triton_kernels)."""
    from triton_kernels.matmul_ogs_details.opt_flags import update_opt_flags_constraints

    update_opt_flags_constraints({"split_k": 1})


class PeerRoutedExperts:
    """y = routed experts of one rank on the peer, for the arguments of lmf::routed_experts that change per call.

    expected_tokens_per_expt: None as vLLM leaves it; an int makes matmul_ogs pick its tiles for that many rows per
    expert (the "peer+hint" variant)."""

    def __init__(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                 beta: float, lin_beta: float, expected_tokens_per_expt: int | None = None,
                 weights: PeerWeights | None = None) -> None:
        apply_vllm_opt_flags()
        self.weights = weights if weights is not None else to_peer_layout(w13, w13_scale, w2, w2_scale)
        self.activation = situ_activation(beta, lin_beta)
        self.expected_tokens_per_expt = expected_tokens_per_expt

    def with_hint(self, expected_tokens_per_expt: int | None) -> PeerRoutedExperts:
        """The same converted weights with another tile hint (no second copy of the weights)."""
        beta, lin_beta = self.activation.fn_args
        return PeerRoutedExperts(None, None, None, None, beta, lin_beta, expected_tokens_per_expt, self.weights)

    def __call__(self, z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from triton_kernels.matmul_ogs import matmul_ogs

        w = self.weights
        if z.dtype != torch.bfloat16 or z.shape[1] != w.latent:
            raise ValueError(f"peer routed experts: z must be bfloat16 [M, {w.latent}], got {z.dtype} {tuple(z.shape)}")
        routing, gather, scatter = make_peer_routing(topk_ids, topk_weights, w.num_experts,
                                                     self.expected_tokens_per_expt)
        act = matmul_ogs(z, w.w13, None, routing, gather_indx=gather, precision_config=w.w13_precision,
                         fused_activation=self.activation)
        return matmul_ogs(act, w.w2, None, routing, scatter_indx=scatter, precision_config=w.w2_precision,
                          gammas=routing.gate_scal)
