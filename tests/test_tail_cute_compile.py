"""CuTe DSL tail without a GPU: the kernels compile for sm_90a to WGMMA + TMA PTX, and the
backend's selection rules (measured table, forcing, shape checks) hold."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch

from latent_moe_fusion.ops.common.backends import explain
from latent_moe_fusion.ops.tail.cute import tail_backend
from latent_moe_fusion.ops.tail.cute.tail_configs import PREFILL, TABLE, all_configs, bucket_bound, pick_config

HAS_CUTE_DSL = importlib.util.find_spec("cutlass") is not None
needs_cute_dsl = pytest.mark.skipif(
    not HAS_CUTE_DSL, reason="nvidia-cutlass-dsl is not installed (pip install -e '.[cute]')"
)


@needs_cute_dsl
@pytest.mark.parametrize(("cfg", "num_frags", "pdl"), [(TABLE[0][1], 8, False), (PREFILL, 1, False),
                                                       (TABLE[1][1], 1, True), (PREFILL, 8, True)],
                         ids=["decode-swap-R8", "prefill-R1", "decode-swap-R1-pdl", "prefill-R8-pdl"])
def test_compiles_to_wgmma_and_tma_ptx(cfg, num_frags, pdl, tmp_path, monkeypatch):
    from latent_moe_fusion.ops.tail.cute.tail_runtime import KernelKey, compile_kernel

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the PTX into the working directory
    compiled = compile_kernel(KernelKey("sm_90a", torch.bfloat16, num_frags, cfg, pdl), keep_ptx=True)
    ptx = compiled.artifacts.PTX
    # the programmatic dependent waits for the kernel before it (warp 0 after its weight loads, every thread)
    assert ("griddepcontrol.wait" in ptx) == pdl
    assert ptx and ".target sm_90a" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.mma_n}k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx  # TMA loads of both operands
    assert "mbarrier.try_wait" in ptx and "wgmma.wait_group" in ptx
    # Epilogue: every fragment and the output move in 16-byte accesses, rounded once.
    assert len(re.findall(r"ld\.global\.v4\.b32", ptx)) >= num_frags
    assert "st.global.v4.b32" in ptx and "cvt.rn.bf16x2.f32" in ptx
    assert f"{cfg.threads}, 1, 1" in ptx  # .reqntid


def test_configs_are_valid_and_bucketed():
    for cfg in all_configs():
        cfg.check()
    assert pick_config(1).swap_ab and pick_config(128).swap_ab and not pick_config(129).swap_ab
    assert pick_config(5).mma_n >= 5 and pick_config(33).mma_n >= 33
    assert bucket_bound(9) == 16 and bucket_bound(4096) == TABLE[-1][0]


def test_the_tokens_the_triton_gemv_serves_are_a_bucket_of_their_own():
    """The backend choice is per bucket; Triton's tail switches kernels above GEMV_MAX_M, so a bucket that
    straddled that bound would be decided by two different Triton kernels at once."""
    from latent_moe_fusion.ops.common.tail_gemm.tail_gemm_configs import GEMV_MAX_M

    assert bucket_bound(GEMV_MAX_M) == GEMV_MAX_M and bucket_bound(GEMV_MAX_M + 1) > GEMV_MAX_M


def _args(m=8, k=128, n=256, r=2, dtype=torch.bfloat16, mode="local"):
    y = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    ws = torch.randn(m, r, n, dtype=dtype) if mode == "token_publish" else torch.randn(r, m, n, dtype=dtype)
    return y, w, ws, mode, None


def test_triton_keeps_buckets_without_a_measured_win(tmp_path, monkeypatch, tuned):
    monkeypatch.delenv("LMF_BACKEND_LATENT_TAIL", raising=False)
    monkeypatch.delenv("LMF_BACKEND", raising=False)
    table = tmp_path / "choice.json"
    table.write_text(json.dumps({"choice": {"8": "cute", "128": "triton"}}))
    tuned(cute_tail_choice=table)
    assert tail_backend.supports(*_args(m=8)) is None
    assert "does not pick cute" in tail_backend.supports(*_args(m=100))
    with pytest.raises(ValueError, match=f"{tail_backend.CHOICE_OVERRIDE}=.*absent.json': no such file"):
        tuned(cute_tail_choice=tmp_path / "absent.json")  # a wrong path is refused ...
    tuned(cute_tail_choice=None)  # ... a missing shipped table leaves every bucket to Triton
    monkeypatch.setattr(tail_backend, "DEFAULT_CHOICE", tmp_path / "absent.json")
    assert "does not pick cute" in tail_backend.supports(*_args(m=8))
    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "cute")  # forcing skips the table, not the shape checks
    assert tail_backend.supports(*_args(m=8)) is None
    assert tail_backend.supports(*_args(m=3, mode="token_publish")) is None


def test_shape_and_dtype_reasons(monkeypatch):
    monkeypatch.setenv("LMF_BACKEND_LATENT_TAIL", "cute")
    assert "float32" in tail_backend.supports(*_args(dtype=torch.float32))
    assert "multiple of 64" in tail_backend.supports(*_args(k=96))
    assert "multiple of 128" in tail_backend.supports(*_args(n=192))
    y, w, ws, mode, group = _args()
    assert "row-major" in tail_backend.supports(y.t().contiguous().t(), w, ws, mode, group)
    assert "contiguous along H" in tail_backend.supports(y, w, ws.transpose(1, 2).contiguous().transpose(1, 2), mode)


def test_cpu_never_selects_cute():
    rows = dict(explain("latent_tail", "cpu", *_args()))
    assert rows["cute"] is not None and rows["reference"] is None


def test_importing_the_package_does_not_import_cutlass():
    code = "import sys, latent_moe_fusion; assert 'cutlass' not in sys.modules, 'cutlass imported eagerly'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_committed_choice_table_names_known_buckets_and_backends():
    bounds = {bound for bound, _ in TABLE}
    choice = tail_backend._load_choice(str(tail_backend.DEFAULT_CHOICE))
    assert set(choice) <= bounds and set(choice.values()) <= {"cute", "triton"}


def test_the_shipped_choice_is_the_measured_record():
    """The package ships its own copy of the choice (an installed wheel has no bench/results/); it must be the
    last measurement's (bench/tail_cute.py --install-choice writes both)."""
    import json
    from pathlib import Path

    record = Path(__file__).resolve().parent.parent / "bench" / "results" / "tail_cute_choice.json"
    assert tail_backend.DEFAULT_CHOICE.parent == Path(tail_backend.__file__).resolve().parent
    shipped = json.loads(tail_backend.DEFAULT_CHOICE.read_text())
    assert shipped == json.loads(record.read_text()), "run bench/tail_cute.py --install-choice, or copy the record"
