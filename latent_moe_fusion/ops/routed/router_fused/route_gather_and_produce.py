"""lmf::route_gather_and_produce: lmf::route_and_produce for the sequence-parallel block, taking this rank's tokens x,
the SP group's size R and its name instead of the gathered x_s, and gathering x_s itself beside the router and the
down-projection (beyond the brief, docs/design.md, section 2; docs/design/tensor-parallel-schedule.md).

    x_s      = all_gather_into_tensor(x, R, group_name)          # [R*M, H], rank-major
    y_n, ws  = lmf::route_and_produce(x, <router args>, <routed args>, rms_weight, eps, x_s, w1_s, w3_s, w2_s,
                                      "token_publish", group_name)

Why: in the SP graph x_s = wait_tensor(all_gather_into_tensor(x, R, group)) is an input of lmf::route_and_produce,
so the op, and with it the router and the down-projection, which read only x, cannot start before every rank's
tokens have arrived (227.5 us of NCCL kernel at 2048 tokens a rank, R = 2, H200). Only the shared expert reads x_s.
Here the gather is issued on the shared expert's stream (NCCL runs it asynchronously; that stream alone waits for
its work), and the router, the grouping and the down-projection run on theirs (route_and_produce.py's schedules):

    shared stream:  all_gather(x) -> shared expert -> fragments        (shared first, from 5 to 128 tokens)
    caller / side:  router GEMM -> route -> grouping -> routed experts; down-projection
  or, in a row (elsewhere):
    shared stream:  all_gather(x)
    caller:         router GEMM -> route -> down-projection -> [waits for the gather] -> producer

The gather moves bytes: outputs are bitwise those of lmf::route_and_produce on the gathered x_s. On the CPU (gloo)
the reference gathers synchronously, then runs lmf::route_and_produce's reference.

Not built yet: the gather by symmetric-memory peer writes and its measured token threshold, which need several GPUs
(docs/design/tensor-parallel-schedule.md).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ...common.backends import ANY_DEVICE, Backend, register_backend, select_backend
from ...common.fragment_layouts import fragment_shape, resolve_group
from ...common.input_checks import ACTIVATION_DTYPES, LmfInputError, _fail, check_mode_and_group, check_tensor
from ...common.op_library import _define
from .route_and_produce import route_and_produce_cuda, route_and_produce_reference, validate_route_and_produce

OP = "route_gather_and_produce"
MODE = "token_publish"  # the SP layout: the only one whose shared expert reads gathered tokens
# Positions in the schema (below) of the arguments that differ from lmf::route_and_produce's.
GROUP_SIZE, W1_S, GROUP_NAME = 19, 20, 23
# torch.distributed's gather into one tensor (all_gather_single from torch 2.13 on, which deprecates the older name).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _produce_args(args: tuple, x_s: torch.Tensor) -> tuple:
    """lmf::route_and_produce's 25 arguments: x_s in group_size's place, then the layout and the group."""
    return (*args[:GROUP_SIZE], x_s, *args[W1_S:GROUP_NAME], MODE, args[GROUP_NAME])


def validate_route_gather_and_produce(*args) -> tuple[int, int, int, int]:
    """lmf::route_and_produce's checks on a stand-in for the gathered x_s, after the group's. Returns (M, H, R, L)."""
    x, group_size, group_name = args[0], args[GROUP_SIZE], args[GROUP_NAME]
    check_tensor(OP, "x", x, ndim=2, dtypes=ACTIVATION_DTYPES, device=getattr(x, "device", None))
    if not isinstance(group_name, str):
        _fail(OP, f"group_name must name the sequence-parallel group (group.group_name), got {group_name!r}")
    world = check_mode_and_group(OP, MODE, group_name)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size != world:
        _fail(OP, f"group_size = {group_size!r} but group {group_name!r} has {world} ranks: pass R, the size of the "
                  "group the tokens are gathered over (x_s is every rank's x, [R*M, H])")
    x_s = x.new_empty((world * x.shape[0], x.shape[1]))
    try:
        return validate_route_and_produce(*_produce_args(args, x_s), op=OP)
    except LmfInputError as exc:  # the producer's checks name x_s, which this op gathers from x
        if not re.search(r"\bx_s\b", str(exc)):
            raise
        raise LmfInputError(f"{exc} (here x_s is every rank's x gathered: [R*M = {world} * {x.shape[0]}, "
                            f"H = {x.shape[1]}])") from None


def start_token_gather(x_s: torch.Tensor, x: torch.Tensor, group_name: str) -> None:
    """x_s <- every rank's x, rank-major, and make the current stream wait for it. On CUDA (NCCL) the collective
    runs on NCCL's stream and only the current stream waits (the host does not); on the CPU (gloo) it is done when
    this returns."""
    all_gather_single(x_s, x, group=resolve_group(group_name), async_op=True).wait()


def route_gather_and_produce_reference(*args):
    """The gather, then lmf::route_and_produce's reference, any device: the op's definition."""
    x, group_name = args[0], args[GROUP_NAME]
    x_s = x.new_empty((args[GROUP_SIZE] * x.shape[0], x.shape[1]))
    start_token_gather(x_s, x, group_name)
    return route_and_produce_reference(*_produce_args(args, x_s))


def route_gather_and_produce_cuda(*args):
    """lmf::route_and_produce's CUDA schedules with the gather on the shared expert's stream."""
    x, group_name = args[0], args[GROUP_NAME]
    # Made on the caller's stream, which joins the shared stream before the op returns (route_and_produce_cuda).
    x_s = x.new_empty((args[GROUP_SIZE] * x.shape[0], x.shape[1]))
    return route_and_produce_cuda(*_produce_args(args, x_s), gather=lambda: start_token_gather(x_s, x, group_name))


def _route_gather_and_produce(*args):
    validate_route_gather_and_produce(*args)
    return select_backend(OP, args[0].device.type, *args).fn(*args)


def _route_gather_and_produce_fake(*args):
    m, hidden, world, latent = validate_route_gather_and_produce(*args)
    x = args[0]
    return x.new_empty((m, latent)), x.new_empty(fragment_shape(MODE, m, hidden, world))


route_gather_and_produce = _define(
    "route_gather_and_produce(Tensor x, Tensor gate_weight, Tensor correction_bias, Tensor w_down, str router_gemm, "
    "int top_k, float renorm_eps, float scaling_factor, int first_expert, int num_local, Tensor w13, Tensor w2, "
    "Tensor? w13_scale, Tensor? w2_scale, str weight_format, float beta, float lin_beta, Tensor rms_weight, "
    "float eps, int group_size, Tensor w1_s, Tensor w3_s, Tensor w2_s, str group_name) -> (Tensor, Tensor)",
    _route_gather_and_produce, _route_gather_and_produce_fake,
)

register_backend(Backend(OP, "shared_first", 10, ("cuda",), route_gather_and_produce_cuda))
register_backend(Backend(OP, "reference", 100, ANY_DEVICE, route_gather_and_produce_reference))
