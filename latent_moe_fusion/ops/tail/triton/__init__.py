"""Triton backend of lmf::latent_tail (triton_tail_backend.py); its kernels live in common/tail_gemm."""
