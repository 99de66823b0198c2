"""MoE token routing in a plan.

Under expert parallelism a rank learns how many tokens it sends to and
receives from each other rank by exchanging token counts, then reads them
as Python ints (``.tolist()``) to size the all-to-all. Fake tensors have no
values to read, so a plan routes each rank's tokens evenly: every rank
sends and receives its own routed-token count (tokens x top-k), split as
evenly as the counts allow. That is the balanced load MoE training aims for
(auxiliary losses, expert-bias balancing); an imbalanced step needs more on
the ranks that receive more. Used by the overlay's on-request records
``plan_routed_tokens`` and ``plan_even_splits``, applied only while a plan
is computed.

0.2.x's expert parallelism sizes its all-to-all the same way, inside its
dispatch: a plan's dispatch splits evenly (record ``plan_even_ep_splits``).
0.2.x's experts on CPU (and on every device but SM90 CUDA) run as a loop
over the experts that reads the tokens per expert the same way; a plan
spreads the routed tokens evenly over the experts (record
``plan_even_expert_tokens``). Where they run grouped (qwen3), the padded
token order is filled from those counts: a plan allocates it unfilled
(record ``plan_permute_indices``).
"""

import inspect
from collections.abc import Callable
from typing import Any

import torch

# The dispatcher attribute the routed-token count is kept in for one step.
ROUTED = "_titan_npu_planned_routed_tokens"


def counting_routed_tokens(dispatch: Callable[..., Any]) -> Callable[..., Any]:
    """``dispatch`` that first notes how many (token, expert) pairs it routes."""

    def planned_dispatch(
        self: Any,
        x_TD: torch.Tensor,
        topk_scores_TK: torch.Tensor,
        topk_expert_ids_TK: torch.Tensor,
        *args: Any,
    ) -> Any:
        setattr(self, ROUTED, topk_expert_ids_TK.numel())
        return dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, *args)

    return planned_dispatch


def even_splits(routed: int, ranks: int) -> list[int]:
    """``routed`` tokens over ``ranks``, as evenly as integers allow."""
    return [routed // ranks + (i < routed % ranks) for i in range(ranks)]


def even_token_count_exchange(
    self: Any,
    num_local_tokens_per_expert_E: torch.Tensor,
    num_global_tokens_per_local_expert_EP_e: torch.Tensor,
    ep_size: int,
) -> tuple[torch.Tensor, list[int], list[int]]:
    """Upstream's ``_sync_token_count_exchange`` with even splits: this rank
    sends its routed tokens evenly and receives as many."""
    splits = even_splits(getattr(self, ROUTED), ep_size)
    return num_global_tokens_per_local_expert_EP_e.reshape(-1), splits, list(splits)


class EvenCounts(list):
    """Tokens per expert as a plan routes them, read as upstream reads a
    count tensor (``.tolist()``)."""

    def tolist(self) -> list[int]:
        return list(self)


def evenly_routed_experts(run_experts: Callable[..., Any]) -> Callable[..., Any]:
    """0.2.x's ``_run_experts_for_loop`` (any model's: arguments by name) on
    its tokens ``x`` spread evenly over the experts it is given counts for."""
    signature = inspect.signature(run_experts)

    def planned_experts(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        experts = bound.arguments["num_tokens_per_expert"].shape[0]
        tokens = bound.arguments["x"].shape[0]
        bound.arguments["num_tokens_per_expert"] = EvenCounts(
            even_splits(tokens, experts)
        )
        return run_experts(*bound.args, **bound.kwargs)

    return planned_experts


def even_expert_parallel_dispatch(permute: Callable[..., Any]) -> Callable[..., Any]:
    """0.2.x's ``ExpertParallel._token_dispatch`` with even splits: this rank
    sends its routed tokens evenly over the EP ranks and receives as many
    (upstream exchanges the counts and reads them with ``.tolist()``); the
    received tokens are then ordered by expert as upstream orders them
    (``permute``: its ``_permute``)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    def planned_dispatch(
        self: Any, mod: Any, inputs: tuple, device_mesh: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        routed_input, num_tokens_per_expert = inputs
        ranks = device_mesh.shape[0]
        self.input_splits = even_splits(routed_input.shape[0], ranks)
        self.output_splits = list(self.input_splits)
        routed_input = all_to_all_single_autograd(
            routed_input, self.output_splits, self.input_splits, device_mesh.get_group()
        )
        received = torch.empty_like(num_tokens_per_expert)  # counts from every rank
        local_experts = num_tokens_per_expert.shape[0] // ranks
        self.input_shape, routed_input, self.permuted_indices, received = permute(
            routed_input, received, ranks, local_experts
        )
        return routed_input, received

    return planned_dispatch


def unfilled_permute_indices(
    tokens_per_expert_group: torch.Tensor,
    start_index_values: torch.Tensor,
    write_offsets: torch.Tensor,
    experts_per_rank: int,
    num_ranks: int,
    max_len: int,
) -> torch.Tensor:
    """0.2.x's ``fill_indices_cpu`` without the filling (upstream reads each
    count with ``.item()``): the same index vector, its values unset."""
    return torch.full((max_len,), -1, dtype=torch.int32)
