"""Triton kernels of the routed experts (CUDA; they also run under TRITON_INTERPRET=1 on CPU): grouping, expert
GEMMs, combine, the routed GEMV's portable form, the FP8 activation split. Kernels compile on first use."""
