"""Per-(group, mode) state of the SM100 MegaMoE producer: created once, outside forward and capture.

`prepare_deepgemm_producer` allocates DeepGEMM's symmetric MegaMoE buffer
(`deep_gemm.get_symm_buffer_for_mega_moe`, which rendezvouses and synchronises the group) and,
for R > 1, the symmetric shared-expert publication workspace with its flag vector and peer
pointer table. Both synchronise the group and allocate, so they cannot run inside a CUDA graph
or inside the op; the op finds the state here and refuses (falls back) when there is none.

Expert mapping. MegaMoE is an expert-parallel kernel over the group of its symmetric buffer:
expert g lives on rank g // E_local and a token's top-k ids are global. Our op contract has no
expert parallelism (a rank computes the experts it is given, ids < 0 skipped). We map it
exactly by giving each rank its own E experts as its local block and offsetting its ids by
rank * E: every token then goes only to its own rank's experts, so the dispatch moves nothing
across ranks and the routed result is this rank's, as the contract says. The group is still
needed, because the shared-expert publication (hidden_scatter / token_publish) writes into the
peers' workspaces and DeepGEMM sizes that workspace by the symmetric buffer's rank count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ...common.fragment_layouts import MODES, resolve_group
from .agree import agree_deepgemm, agree_local
from .probe import SM100_MEGA, deep_gemm_module
from .weight_cache import capturing

PUBLISH_GENERATIONS = 3  # DeepGEMM's hidden-scatter publication asks for at least three
FLAG_WORDS = 9  # shared_rs_flags: [0] generation index, [2] bytes per generation, rest zero

# (shape, dtype, device, group_name) -> (tensor, peer base pointers by rank, handle with .barrier())
SymmetricAllocator = Callable[[tuple, torch.dtype, torch.device, str], tuple[torch.Tensor, list[int], Any]]


class _SingleRankGroup:
    """What DeepGEMM's SymmBuffer asks of a group, for R = 1 without torch.distributed."""

    group_name = "lmf-local"

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def barrier(self) -> None:
        return None


def torch_symmetric_allocator(shape: tuple, dtype: torch.dtype, device: torch.device, group_name: str):
    """torch symmetric memory: every rank maps every peer's buffer; handle.barrier() is on-device."""
    import torch.distributed._symmetric_memory as symm_mem

    tensor = symm_mem.empty(*shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(tensor, group_name)
    # buffer_ptrs are the peers' allocation bases; our tensor may start some bytes into its own
    # allocation, and symmetric allocations put it at the same offset on every rank.
    bases = [int(p) for p in handle.buffer_ptrs]
    delta = tensor.data_ptr() - bases[int(handle.rank)]
    return tensor, [p + delta for p in bases], handle


@dataclass
class PublishWorkspace:
    """Symmetric [G, rows, R, cols] BF16 workspace the kernel writes peers' shared partials into."""

    tensor: torch.Tensor
    flags: torch.Tensor  # int32 [9] on the device
    peer_ptrs: torch.Tensor  # int64 [R] on the device
    handle: Any  # .barrier(channel=0): all ranks' stores into every workspace are visible

    @property
    def generations(self) -> int:
        return self.tensor.shape[0]

    @property
    def rows(self) -> int:
        return self.tensor.shape[1]

    def barrier(self) -> None:
        self.handle.barrier(channel=0)


@dataclass
class ProducerState:
    mode: str
    group_name: str | None
    world: int
    rank: int
    num_experts: int  # this rank's experts (w13.shape[0])
    max_tokens: int  # routed tokens per call (z.shape[0]) this state can take
    top_k: int
    latent: int
    inter: int
    hidden: int
    shared_inter: int
    sym_buffer: Any
    publish: PublishWorkspace | None = None
    calls: int = field(default=0)

    def capacity_reason(self, m: int) -> str | None:
        if m < 1:
            return "M = 0 tokens (nothing to launch)"
        if m > self.max_tokens:
            return (f"z has {m} tokens but the MegaMoE workspace was prepared for at most {self.max_tokens}; "
                    "call prepare_deepgemm_producer with a larger max_tokens")
        return None


_STATES: dict[tuple[str | None, str], ProducerState] = {}


def state_for(group_name: str | None, mode: str) -> ProducerState | None:
    return _STATES.get((group_name, mode))


def reset_states() -> None:
    _STATES.clear()


def _agree(group: Any):
    """Agree the probe over `group` (local answer for R = 1); tests monkeypatch this."""
    return agree_local() if group is None else agree_deepgemm(group)


def _group_info(group_name: str | None) -> tuple[Any, int, int]:
    """(process group or None, R, this rank's index) for `group_name` (tests monkeypatch this)."""
    group = resolve_group(group_name)
    if group is None:
        return None, 1, 0
    return group, dist.get_world_size(group), dist.get_rank(group)


def _check_sizes(mode: str, world: int, top_k: int, latent: int, inter: int, hidden: int, shared_inter: int) -> None:
    # Host asserts of DeepGEMM's MegaMoE (csrc/apis/mega.hpp and the kernel's static asserts).
    checks = [
        (latent % 128 == 0, f"latent = {latent} must be a multiple of 128 (UE8M0 scale packing, UTCCP tiles)"),
        (inter % 128 == 0, f"inter = {inter} must be a multiple of 128 (UE8M0 scale packing, UTCCP tiles)"),
        (hidden % 64 == 0, f"hidden = {hidden} must be a multiple of 64 (BF16 shared K block)"),
        (shared_inter % 64 == 0, f"shared_inter = {shared_inter} must be a multiple of 64 (BF16 shared K block)"),
        (1 <= top_k <= 32, f"top_k = {top_k} must be in 1..32 (tokens per dispatch warp = 32 / top_k)"),
    ]
    if mode == "hidden_scatter":
        checks.append((hidden % world == 0 and (hidden // world) % 8 == 0,
                       f"hidden = {hidden} must split into R = {world} slices of a multiple of 8 columns"))
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"prepare_deepgemm_producer: {msg}")


def prepare_deepgemm_producer(
    *,
    mode: str,
    group_name: str | None,
    num_experts: int,
    max_tokens: int,
    top_k: int,
    latent: int,
    inter: int,
    hidden: int,
    shared_inter: int,
    device: torch.device | str | None = None,
    weights: Sequence[torch.Tensor] | None = None,
    allocator: SymmetricAllocator | None = None,
) -> ProducerState | None:
    """Create the MegaMoE state for (group_name, mode); collective over the group: call on every rank.

    Returns None (and every rank keeps using the Triton/reference producer) when DeepGEMM's
    MegaMoE-with-BF16-shared API is not usable on every rank; `deepgemm_status()` says why.
    `weights` = (w13, w2, w13_scale, w2_scale, w1_s, w3_s, w2_s) converts them now (else on the
    first eager call). Sizes: num_experts = this rank's E, max_tokens = most tokens per call
    (z.shape[0]), latent L, inter I, hidden H, shared_inter = this rank's I_s.
    """
    if capturing():
        raise RuntimeError(
            "prepare_deepgemm_producer must run before CUDA-graph capture: it allocates symmetric memory "
            "and synchronises the group"
        )
    if mode not in MODES:
        raise ValueError(f"prepare_deepgemm_producer: mode must be one of {MODES}, got {mode!r}")
    group, world, rank = _group_info(group_name)
    if (mode == "local") != (world == 1):
        raise ValueError(f"prepare_deepgemm_producer: mode={mode!r} does not fit a group of {world} rank(s)")
    _check_sizes(mode, world, top_k, latent, inter, hidden, shared_inter)
    agreed = _agree(group)
    if not agreed.has(SM100_MEGA):
        return None
    dg = deep_gemm_module()
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    routed_capacity = max_tokens * (world if mode == "token_publish" else 1)  # shared tokens share the buffer
    sym_buffer = dg.get_symm_buffer_for_mega_moe(
        group=group if group is not None else _SingleRankGroup(),
        num_experts=world * num_experts,
        num_max_tokens_per_rank=routed_capacity,
        num_topk=top_k,
        hidden=latent,
        intermediate_hidden=inter,
        mma_type="fp8xfp4",
        activation="situ",
        bf16_shared_intermediate_hidden=shared_inter,
    )
    publish = None
    if mode != "local":
        cols = hidden // world if mode == "hidden_scatter" else hidden
        alloc = allocator or torch_symmetric_allocator
        shape = (PUBLISH_GENERATIONS, max_tokens, world, cols)
        tensor, peers, handle = alloc(shape, torch.bfloat16, device, group_name)
        flags = torch.zeros(FLAG_WORDS, dtype=torch.int32, device=device)
        flags[2] = tensor[0].nbytes
        peer_ptrs = torch.tensor(peers, dtype=torch.int64, device=device)
        publish = PublishWorkspace(tensor, flags, peer_ptrs, handle)
    state = ProducerState(mode, group_name, world, rank, num_experts, max_tokens, top_k, latent, inter, hidden,
                          shared_inter, sym_buffer, publish)
    _STATES[(group_name, mode)] = state
    if weights is not None:
        from .sm100_mega_moe import convert_weights

        convert_weights(*weights)
    return state
