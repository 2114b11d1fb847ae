"""The rank grid of megatron.core.parallel_state: which global ranks form each process group (pure
arithmetic, no process group is created here; ``parallel_state`` re-exports these names).

The rank grid
-------------
Every rank of a world of size ``W = tp * cp * ep * dp * pp`` has one coordinate per named dimension.
With Megatron's default order ``"tp-cp-ep-dp-pp"`` the first dimension varies fastest::

    rank = tp_rank + tp * (cp_rank + cp * (ep_rank + ep * (dp_rank + dp * pp_rank)))

so tensor-parallel groups are contiguous blocks of ranks (they share the fastest links of a node) and
pipeline groups are strided by ``W / pp``. A *group kind* is a set of dimensions, e.g. ``"tp-pp"`` for the
model-parallel group: ranks that agree on every *other* coordinate form one group. ``RankGenerator``
enumerates them; all groups of every kind are created on every rank (``new_group`` is collective) and each
rank keeps the one it belongs to.

Worked example, W=8, TP=2, PP=2 (so DP=2):

    tensor     [0,1] [2,3] [4,5] [6,7]
    data       [0,2] [1,3] [4,6] [5,7]
    pipeline   [0,4] [1,5] [2,6] [3,7]
    model      [0,1,4,5] [2,3,6,7]
    embedding  [0,4] [1,5] [2,6] [3,7]   (first and last stage of each pipeline)

Expert layout (mixture of experts)
----------------------------------
Expert layers use a *second* grid over the same world and the same order string, with the context dimension
folded away: ``(tp=ETP, cp=1, ep=EP, dp=EDP, pp=PP)`` where ``ETP = expert_tensor_parallel_size`` (default
TP) and ``EDP = W / (ETP * EP * PP)``. The pipeline groups of both grids must coincide. Groups of the
expert grid: ``ep`` (expert model parallel: ranks holding different experts), expert ``tp`` (one expert's
weights split across ranks), ``tp-ep`` (the token dispatcher's group), ``tp-ep-pp`` (the experts' model
parallel group: optimizer and grad norm) and expert ``dp`` (replicas of the same expert shard: expert grads
are reduced here).

Worked example, W=8, TP=2, EP=2, PP=1 (so DP=4, ETP=2, EDP=2)::

    dense tensor    [0,1] [2,3] [4,5] [6,7]        dense data  [0,2,4,6] [1,3,5,7]
    expert tensor   [0,1] [2,3] [4,5] [6,7]        expert model (ep)  [0,2] [1,3] [4,6] [5,7]
    tp-ep           [0,1,2,3] [4,5,6,7]            expert data  [0,4] [1,5] [2,6] [3,7]

so rank r has etp = r % 2, ep = (r // 2) % 2, edp = r // 4; with 4 experts ranks {0,1,4,5} hold experts 0-1
and {2,3,6,7} hold experts 2-3. Worked example, W=8, TP=2, ETP=1, EP=4, PP=2 (DP=2, EDP=1)::

    expert tensor   [0] [1] ... [7]                expert model (ep)  [0,1,2,3] [4,5,6,7]
    tp-ep-pp        [0,1,2,3,4,5,6,7]              expert data  [0] [1] ... [7]
    pipeline        [0,4] [1,5] [2,6] [3,7]        (the same in both grids)

Context parallelism (CP) is the second-fastest axis. The ranks of a CP group each hold ``1/CP`` of every
sequence of the same micro-batch, so for everything that reduces gradients or losses they are data-parallel
replicas: the *data-parallel group with context parallel* ("dp-cp", ``get_data_parallel_group(
with_context_parallel=True)``) reduces gradients and runs the distributed optimizer, while the pure DP group
("dp") still decides which samples a rank reads (all CP ranks of a replica read the same micro-batch).
Worked example, W=8, TP=2, CP=2 (so DP=2, PP=1), rank = tp + 2 cp + 4 dp:

    tensor                   [0,1] [2,3] [4,5] [6,7]
    context                  [0,2] [1,3] [4,6] [5,7]
    data                     [0,4] [1,5] [2,6] [3,7]
    data with CP  (dp-cp)    [0,2,4,6] [1,3,5,7]       dp_cp_rank = cp_rank + CP * dp_rank
    tensor and context       [0,1,2,3] [4,5,6,7]
    tensor, data and context [0,1,2,3,4,5,6,7]
    model (tp-pp)            [0,1] [2,3] [4,5] [6,7]   (CP is not model parallel: weights are replicated)
"""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Sequence


class RankGenerator:
    """Enumerates the rank groups of a grid of named parallel dimensions.

    ``order`` lists the dimensions from fastest- to slowest-varying, e.g. ``"tp-cp-ep-dp-pp"``. Dimensions of
    size 1 may be present in the order and are simply trivial.
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str = "tp-cp-ep-dp-pp"):
        self.sizes = {"tp": tp, "ep": ep, "dp": dp, "pp": pp, "cp": cp}
        self.order = [d.strip() for d in order.lower().split("-")]
        unknown = [d for d in self.order if d not in self.sizes]
        if unknown or len(set(self.order)) != len(self.order):
            raise RuntimeError(f"invalid parallel order {order!r}: use each of {sorted(self.sizes)} at most once")
        for name, size in self.sizes.items():
            if size > 1 and name not in self.order:
                raise RuntimeError(f"the order {order!r} must name '{name}' because its size is {size}")
            if size < 1:
                raise RuntimeError(f"parallel size of '{name}' must be >= 1, got {size}")
        self.world_size = 1
        for d in self.order:
            self.world_size *= self.sizes[d]

    def rank_of(self, coords: Dict[str, int]) -> int:
        rank, stride = 0, 1
        for d in self.order:
            rank += coords.get(d, 0) * stride
            stride *= self.sizes[d]
        return rank

    def coords_of(self, rank: int) -> Dict[str, int]:
        coords = {}
        for d in self.order:
            coords[d] = rank % self.sizes[d]
            rank //= self.sizes[d]
        return coords

    def get_ranks(self, token: str) -> List[List[int]]:
        """All groups of the kind named by ``token`` (e.g. ``"dp"``, ``"tp-pp"``).

        Within a group ranks are ordered with the first dimension of ``order`` varying fastest; groups are
        ordered the same way over the remaining dimensions.
        """
        inside = set(d.strip() for d in token.lower().split("-"))
        if not inside <= set(self.order):
            raise RuntimeError(f"unknown dimension in group token {token!r}")
        return generate_masked_orthogonal_rank_groups(self.world_size, [self.sizes[d] for d in self.order],
                                                      [d in inside for d in self.order])


def generate_masked_orthogonal_rank_groups(world_size: int, parallel_size: List[int],
                                           mask: List[bool]) -> List[List[int]]:
    """The groups spanned by the dimensions where ``mask`` is True of a grid whose sizes are ``parallel_size``
    (first dimension fastest: ``rank = sum_i c_i * prod_{j<i} size_j``).

    Ranks whose coordinates agree on every unmasked dimension form one group; inside a group the masked
    coordinates run first-fastest, and groups are listed with the unmasked coordinates first-fastest. E.g.
    sizes ``[2, 3, 4]`` (tp, dp, pp) with mask ``[False, True, False]`` gives the 8 dp groups
    ``[0, 2, 4], [1, 3, 5], [6, 8, 10], ...``.
    """
    total = 1
    for size in parallel_size:
        total *= size
    if total != world_size:
        raise RuntimeError(f"world_size ({world_size}) is not the product of the parallel sizes {list(parallel_size)}")
    strides, stride = [], 1
    for size in parallel_size:
        strides.append(stride)
        stride *= size
    dims_in = [i for i, m in enumerate(mask) if m]
    dims_out = [i for i, m in enumerate(mask) if not m]

    def offsets(dims):
        # itertools.product varies the *last* element fastest; reverse so the first dimension is fastest.
        for combo in itertools.product(*[range(parallel_size[i]) for i in reversed(dims)]):
            yield sum(c * strides[i] for i, c in zip(reversed(dims), combo))

    inner = list(offsets(dims_in))
    return [[base + off for off in inner] for base in offsets(dims_out)]


def expert_rank_generator(world_size: int, tp: int, pp: int, expert_model_parallel_size: int = 1,
                          expert_tensor_parallel_size: Optional[int] = None,
                          order: str = "tp-cp-ep-dp-pp") -> RankGenerator:
    """The expert grid ``(tp=ETP, cp=1, ep=EP, dp=EDP, pp=PP)`` with ``EDP = W / (ETP * EP * PP)``."""
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    if ep < 1 or etp < 1:
        raise RuntimeError(f"expert model ({ep}) and expert tensor ({etp}) parallel sizes must be >= 1")
    if world_size % (etp * ep * pp) != 0:
        raise RuntimeError(f"world_size ({world_size}) is not divisible by expert_tensor_parallel_size ({etp}) x "
                           f"expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp})")
    return RankGenerator(tp=etp, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, cp=1, order=order)


def default_embedding_ranks(pp_ranks: Sequence[int]) -> List[int]:
    """The stages holding the word embedding of one pipeline group: the first and the last (one rank: itself)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: Sequence[int]) -> List[int]:
    """The stage holding the position embedding of one pipeline group: the first."""
    return [pp_ranks[0]]


def embedding_ranks_of(pipeline_ranks: Sequence[int], split_rank: Optional[int] = None):
    """(embedding ranks, position-embedding ranks) of one pipeline group.

    The word embedding lives on the first stage and is tied to the output layer on the last stage (and the
    decoder's first stage at ``split_rank`` for encoder-decoder models); the position embedding lives on
    the first stage (and the split stage).
    """
    ranks = list(pipeline_ranks)
    if len(ranks) == 1:
        return ranks, ranks
    emb = default_embedding_ranks(ranks)
    pos = default_position_embedding_ranks(ranks)
    if split_rank is not None:
        if ranks[split_rank] not in emb:
            emb = [ranks[0], ranks[split_rank], ranks[-1]]
        if ranks[split_rank] not in pos:
            pos = [ranks[0], ranks[split_rank]]
    return emb, pos
