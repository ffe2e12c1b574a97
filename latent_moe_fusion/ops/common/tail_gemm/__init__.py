"""The tail's Triton GEMM (out = a @ w^T + the sum of R fragments, one rounding): its kernels, launch configurations
and launcher. lmf::latent_tail's Triton backend runs it, and so does the latent down-projection (R = 0)."""
