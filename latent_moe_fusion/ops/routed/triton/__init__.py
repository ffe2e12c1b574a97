"""Triton backends of the lmf ops (CUDA; the kernels also run under TRITON_INTERPRET=1 on CPU).

Importing this package registers every backend module present; kernels compile on first use.
"""

import importlib
import importlib.util

BACKEND_MODULES = ("tail", "routed", "producer", "route_topk")

for _name in BACKEND_MODULES:
    if importlib.util.find_spec(f"{__name__}.{_name}") is not None:
        importlib.import_module(f"{__name__}.{_name}")
