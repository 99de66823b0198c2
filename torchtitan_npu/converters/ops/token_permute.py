"""token_permute: MoE tokens grouped by expert, and back.

permute(tokens_TD, expert_ids_TK) -> (routed_ND, rows_N): the (token, k) routes
grouped by expert (stable), and for each route (flattened T*K order) its row in
routed_ND (int32). unpermute(routed_ND, rows_N, probs_TK) -> out_TD: each token's
routed rows weighted by its routing probabilities and summed. The native pair
reproduces upstream's dispatch/combine bit for bit (fp32 and bf16, CPU).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from torchtitan_npu.compat.era import Era
from torchtitan_npu.converters.kernels import Kernel, npu_kernel, torch_npu
from torchtitan_npu.converters.ops.common import MOE_MODELS
from torchtitan_npu.converters.registry import Converter, Replacement, register


class TokenPermute(NamedTuple):
    permute: Callable
    unpermute: Callable


def permute_native(
    tokens: torch.Tensor, expert_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = expert_ids.shape[-1] if expert_ids.dim() == 2 else 1
    order = torch.argsort(expert_ids.reshape(-1), stable=True)
    rows = torch.empty_like(order)
    rows[order] = torch.arange(order.numel(), device=order.device)
    # indexing, as upstream: its backward accumulates x's gradient the same way
    return tokens[order // top_k], rows.to(torch.int32)


def unpermute_native(
    routed: torch.Tensor, rows: torch.Tensor, probs: torch.Tensor
) -> torch.Tensor:
    num_tokens, top_k = probs.shape
    # each token's routes in row (= expert) order: upstream's summation order
    token_rows, order = rows.view(num_tokens, top_k).sort(dim=1)
    per_token = routed.index_select(0, token_rows.reshape(-1))
    per_token = per_token.view(num_tokens, top_k, -1)
    # upstream's arithmetic: weights applied in fp32, then back to the dtype
    weights = probs.gather(1, order).unsqueeze(-1)
    weighted = (per_token.float() * weights).to(routed.dtype).float()
    out = weighted[:, 0]
    for k in range(1, top_k):  # fp32 accumulation, as upstream's scatter_add
        out = out + weighted[:, k]
    return out.to(routed.dtype)


@npu_kernel(permute_native)
def permute_npu(
    tokens: torch.Tensor, expert_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_npu().npu_moe_token_permute(tokens, expert_ids)


@npu_kernel(unpermute_native)
def unpermute_npu(
    routed: torch.Tensor, rows: torch.Tensor, probs: torch.Tensor
) -> torch.Tensor:
    # the kernel weights in the tokens' dtype (bf16 on some CANN releases)
    return torch_npu().npu_moe_token_unpermute(routed, rows, probs.to(routed.dtype))


@dataclass(frozen=True)
class PermuteMetadata:
    """What ``combine`` needs from ``dispatch``: each route's row, its score."""

    rows_N: torch.Tensor  # noqa: N815
    topk_scores_TK: torch.Tensor  # noqa: N815


def _permuting_dispatch(kernel, original, *, expert_parallel: bool):
    """dispatch/combine that permute locally; ``original``'s own methods run
    when ``expert_parallel`` and the dispatcher has an expert-parallel mesh."""

    def dispatch(
        self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E
    ):
        if expert_parallel and self.ep_mesh is not None:
            return original.dispatch(
                self,
                x_TD,
                topk_scores_TK,
                topk_expert_ids_TK,
                num_local_tokens_per_expert_E,
            )
        routed_input_RD, rows_N = kernel.permute(x_TD, topk_expert_ids_TK)
        metadata = PermuteMetadata(rows_N=rows_N, topk_scores_TK=topk_scores_TK)
        return routed_input_RD, num_local_tokens_per_expert_E, metadata

    def combine(self, routed_output_RD, metadata, x_TD):
        if not isinstance(metadata, PermuteMetadata):
            return original.combine(self, routed_output_RD, metadata, x_TD)
        return kernel.unpermute(
            routed_output_RD, metadata.rows_N, metadata.topk_scores_TK
        )

    return {"dispatch": dispatch, "combine": combine}


def _local_dispatcher(kernel, original):
    """0.3.x LocalTokenDispatcher (no expert parallelism)."""
    return _permuting_dispatch(kernel, original, expert_parallel=False)


def _all_to_all_dispatcher(kernel, original):
    """0.3.x AllToAllTokenDispatcher, the default: without an EP mesh (EP=1)
    it dispatches locally; with one, upstream's all-to-all path runs."""
    return _permuting_dispatch(kernel, original, expert_parallel=True)


_DISPATCHER = "torchtitan.models.common.token_dispatcher"
CONVERTER = register(
    Converter(
        name="token_permute",
        description="MoE token dispatch/combine: grouping by expert and back",
        kernel=Kernel(
            TokenPermute(permute_native, unpermute_native),
            TokenPermute(permute_npu, unpermute_npu),
        ),
        npu_ops=("npu_moe_token_permute", "npu_moe_token_unpermute"),
        native="stable argsort + indexing; gather + weighted sum",
        replacements={
            Era.CONFIG_REGISTRY: (
                Replacement(
                    f"{_DISPATCHER}:LocalTokenDispatcher", MOE_MODELS, _local_dispatcher
                ),
                Replacement(
                    f"{_DISPATCHER}:AllToAllTokenDispatcher",
                    MOE_MODELS,
                    _all_to_all_dispatcher,
                    # ep_mesh is declared (None until wired) by the EP base class
                    depends=(f"{_DISPATCHER}:BaseEPTokenDispatcher",),
                ),
            ),
        },
        notes=(
            "0.3.x only: 0.2.x permutes inside MoE.forward, with no seam to swap.",
            "With expert parallelism, upstream's all-to-all dispatch runs unchanged.",
        ),
    )
)
