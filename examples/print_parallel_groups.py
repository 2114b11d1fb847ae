"""Print every process group and each rank's (tp, pp, dp) coordinates for a parallel layout.

    torchrun --nproc-per-node 8 examples/print_parallel_groups.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --distributed-backend gloo \
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \
        --max-position-embeddings 32 --micro-batch-size 1

Works on CPU (gloo) and on GPUs (nccl). Useful to check a launch script's layout before a long run.
"""
import torch

from megatron.core import parallel_state
from megatron.training.errors import exit_on_configuration_error
from megatron.training.global_vars import get_args
from megatron.training.initialize import initialize_megatron


def _format_groups(all_groups):
    width = max(len(kind) for kind in all_groups)
    lines = [f"{'group kind'.ljust(width)}  rank lists"]
    for kind, groups in all_groups.items():
        lines.append(f"{kind.ljust(width)}  " + " ".join(str(g) for g in groups))
    return lines


def _format_coordinates(coords):
    lines = ["rank  tp  pp  dp"]
    for rank, (tp, pp, dp) in enumerate(coords):
        lines.append(f"{rank:4d}  {tp:2d}  {pp:2d}  {dp:2d}")
    return lines


@exit_on_configuration_error()
def main():
    initialize_megatron()
    args = get_args()
    mine = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank())
    coords = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(coords, mine)

    if torch.distributed.get_rank() == 0:
        print(f"\nparallel layout: world size {args.world_size}, TP={args.tensor_model_parallel_size}, "
              f"PP={args.pipeline_model_parallel_size}, DP={args.data_parallel_size}, "
              f"backend {torch.distributed.get_backend()}")
        print("\n".join(_format_groups(parallel_state.get_all_group_ranks())))
        print()
        print("\n".join(_format_coordinates(coords)), flush=True)
    torch.distributed.barrier()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
