"""Pipeline communication of a model made of several modules, each on its own grid (megatron-core's
``multimodule_communicator``): e.g. image and audio encoders feeding a language model feeding a generator.

``topology`` maps each module to the modules it feeds (a DAG). Inside a module, stages talk through that module's
:class:`~megatron.core.pipeline_parallel.p2p_communication.P2PCommunicator` over its grid's ``pp`` group; across
an edge ``a -> b``, the last stage of ``a`` and the first stage of ``b`` talk through a
:class:`~megatron.core.pipeline_parallel.bridge_communicator.BridgeCommunicator`. Tensors travel in dicts keyed by
module name: what a module's first stage receives over a bridge is keyed by the *source* module's name, what moves
inside a module by its own name.

The pipeline depth is the longest path of the DAG with each module weighted by its number of stages; a rank at
stage ``r`` of module ``m`` sits at depth ``longest path to m`` with ``m`` weighted ``r + 1``; it runs
``depth_total - depth_rank`` warm-up micro-batches (the 1F1B rule ``P - r - 1``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Union

import torch
import torch.distributed as dist

from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.pipeline_parallel.bridge_communicator import BridgeCommunicator
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

Shape = Union[List[int], torch.Size]


@dataclass
class RankModuleInfo:
    """This rank's place in one module: its stage ``pp_rank`` of ``pp_size``, the module's point-to-point
    communicator, the bridges it sends over (last stage, outgoing edges) and receives over (first stage, incoming
    edges)."""

    pp_rank: int
    pp_size: int
    p2p_communicator: Optional[P2PCommunicator]
    bridge_comms_as_src_module: Optional[List[BridgeCommunicator]]
    bridge_comms_as_dest_module: Optional[List[BridgeCommunicator]]
    is_source_stage: Optional[bool] = True
    is_terminal_stage: Optional[bool] = True


class MultiModulePipelineCommunicator:
    """The send / receive calls of the pipeline schedules for a multi-module model (module docstring).

    ``module_to_grid_map``: module name -> its grid (whose ``pp`` group must already be created);
    ``topology``: module name -> the modules it feeds; ``config.pipeline_dtype`` is the bridges' dtype;
    ``dim_mapping``: the bridges' axes of ``s``, ``b``, ``h``. Constructing it is collective (the bridges)."""

    def __init__(self, module_to_grid_map: Dict[str, HyperCommGrid], topology: Dict[str, List[str]],
                 config: ModelParallelConfig, dim_mapping: Dict[str, List[int]] = None):
        self.module_to_grid_map = module_to_grid_map
        self.topology = topology
        self.config = config
        self.dim_mapping = dim_mapping
        self.current_rank = dist.get_rank()
        self.bridge_comms = []
        self._build_bridge_comms()
        self.rank_module_map = {}
        self._build_rank_module_info_map()

    def _build_bridge_comms(self):
        """One bridge per edge of the topology, in the order of ``module_to_grid_map`` then of each module's
        outgoing list."""
        for src_name, src_grid in self.module_to_grid_map.items():
            for dest_name in self.topology[src_name]:
                self.bridge_comms.append(BridgeCommunicator(
                    src_grid=src_grid, dest_grid=self.module_to_grid_map[dest_name], dim_mapping=self.dim_mapping,
                    comm_dtype=self.config.pipeline_dtype, src_module_name=src_name, dest_module_name=dest_name))

    def _is_source_module(self, module_name: str) -> bool:
        """No module feeds ``module_name``."""
        return not any(module_name in outs for outs in self.topology.values())

    def _is_sink_module(self, module_name: str) -> bool:
        """``module_name`` feeds no module."""
        return len(self.topology.get(module_name, [])) == 0

    @property
    def is_pp_first_stage(self):
        """This rank is the first stage of a module that no module feeds."""
        return any(info.pp_rank == 0 and self._is_source_module(name) for name, info in self.rank_module_map.items())

    @property
    def is_pp_last_stage(self):
        """This rank is the last stage of a module that feeds no module."""
        return any(info.pp_rank == info.pp_size - 1 and self._is_sink_module(name)
                   for name, info in self.rank_module_map.items())

    def is_current_rank_in_grid(self, grid: HyperCommGrid) -> bool:
        return grid.rank_offset <= self.current_rank < grid.rank_offset + grid.size

    @property
    def num_warmup_microbatches(self):
        """``total depth - this rank's depth`` (module docstring), this rank's depth taken in the first module it
        belongs to (0-based depth 0 when it belongs to none)."""
        total = self.compute_total_pipeline_stages(self.topology, self.module_to_grid_map)
        current = 0
        if self.rank_module_map:
            first = next(iter(self.rank_module_map))
            current = self.compute_total_pipeline_stages(self.topology, self.module_to_grid_map,
                                                         rank=self.current_rank, module_name=first) - 1
        if current > total:
            raise AssertionError(f"current_stage: {current} is greater than total_stages: {total}")
        return total - current - 1

    def _build_rank_module_info_map(self):
        """A :class:`RankModuleInfo` for every module whose grid holds this rank."""
        for name, grid in self.module_to_grid_map.items():
            if not self.is_current_rank_in_grid(grid):
                continue
            pp_group = grid.get_pg("pp")
            pp_size = dist.get_world_size(pp_group)
            pp_rank = dist.get_group_rank(pp_group, self.current_rank) % pp_size
            incoming = [b for b in self.bridge_comms if b.dest_module_name == name
                        and b.is_current_rank_in_grid(b.dest_grid)] if pp_rank == 0 else []
            outgoing = [b for b in self.bridge_comms if b.src_module_name == name
                        and b.is_current_rank_in_grid(b.src_grid)] if pp_rank == pp_size - 1 else []
            self.rank_module_map[name] = RankModuleInfo(
                pp_rank=pp_rank, pp_size=pp_size, p2p_communicator=P2PCommunicator(pp_group, self.config),
                bridge_comms_as_dest_module=incoming, bridge_comms_as_src_module=outgoing)

    # ------------------------------------------------------------------------------------- schedule calls
    def recv_forward(self, tensor_shape: Optional[Shape] = None, is_first_stage: bool = False
                     ) -> Dict[str, torch.Tensor]:
        """Activations in: over each incoming bridge at a module's first stage (keyed by the source module),
        else from the previous stage (keyed by the module)."""
        inputs = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == 0:
                for bridge in info.bridge_comms_as_dest_module:
                    inputs[bridge.src_module_name] = bridge.recv_forward()
            else:
                inputs[name] = info.p2p_communicator.recv_forward(tensor_shapes=tensor_shape, is_first_stage=False)
        return inputs

    def send_forward(self, output_dict: Dict[str, torch.Tensor], is_last_stage: bool = False):
        """Activations out: ``output_dict[module]`` over each outgoing bridge at a module's last stage, else to
        the next stage."""
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    bridge.send_forward(output_dict[name])
            else:
                info.p2p_communicator.send_forward(output_dict[name], is_last_stage=False)

    def send_forward_recv_backward(self, output_dict: Dict[str, torch.Tensor], tensor_shape: Optional[Shape] = None,
                                   is_last_stage: bool = False) -> Dict[str, torch.Tensor]:
        """:meth:`send_forward` and the gradients coming back, in one exchange per bridge / stage (a bridge's
        gradient keyed by this module, the source of that bridge)."""
        grads = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    grads[bridge.src_module_name] = bridge.send_forward_recv_backward(output_dict[name])
            else:
                grads[name] = info.p2p_communicator.send_forward_recv_backward(
                    output_dict[name], tensor_shapes=tensor_shape, is_last_stage=False)
        return grads

    def send_backward_recv_forward(self, grad_dict: Dict[str, torch.Tensor], tensor_shape: Optional[Shape] = None,
                                   is_first_stage: bool = False) -> Dict[str, torch.Tensor]:
        """Gradients back (``grad_dict`` keyed as :meth:`recv_forward`'s result) and the next activations in."""
        inputs = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == 0:
                for bridge in info.bridge_comms_as_dest_module:
                    inputs[bridge.src_module_name] = bridge.send_backward_recv_forward(
                        grad_dict[bridge.src_module_name])
            else:
                inputs[name] = info.p2p_communicator.send_backward_recv_forward(
                    grad_dict[name], tensor_shapes=tensor_shape, is_first_stage=False)
        return inputs

    def recv_backward(self, tensor_shape: Optional[Shape] = None, is_last_stage: bool = False
                      ) -> Dict[str, torch.Tensor]:
        """Gradients in: over each outgoing bridge at a module's last stage, else from the next stage."""
        grads = {}
        for name, info in self.rank_module_map.items():
            if info.pp_rank == info.pp_size - 1:
                for bridge in info.bridge_comms_as_src_module:
                    grads[bridge.src_module_name] = bridge.recv_backward()
            else:
                grads[name] = info.p2p_communicator.recv_backward(tensor_shapes=tensor_shape, is_last_stage=False)
        return grads

    def send_backward(self, grad_dict: Dict[str, torch.Tensor], is_first_stage: bool = False):
        """Gradients out: over each incoming bridge at a module's first stage, else to the previous stage."""
        for name, info in self.rank_module_map.items():
            if info.pp_rank == 0:
                for bridge in info.bridge_comms_as_dest_module:
                    bridge.send_backward(grad_dict[bridge.src_module_name])
            else:
                info.p2p_communicator.send_backward(grad_dict[name], is_first_stage=False)

    @staticmethod
    def compute_total_pipeline_stages(topology: Dict[str, List[str]], module_to_grid_map: Dict[str, HyperCommGrid],
                                      rank: Optional[int] = None, module_name: Optional[str] = None) -> int:
        """The longest path of the topology DAG, each module weighted by its number of pipeline stages; with
        ``rank``, the path ends at that rank's stage ``r`` of ``module_name`` (weighted ``r + 1``; without
        ``module_name``, the largest over the modules holding ``rank``). Raises ``ValueError`` on a cycle, or
        (without ``rank``) when no module is terminal."""
        nodes = list(module_to_grid_map)
        preds = {node: [] for node in nodes}
        for src in nodes:
            for dst in topology.get(src, []):
                preds[dst].append(src)
        sinks = [node for node in nodes if not topology.get(node, [])]
        if rank is None and not sinks:
            raise ValueError("Topology must be a DAG with at least one terminal (no outgoing) module.")

        def stages(name):
            grid = module_to_grid_map[name]
            return grid.shape[grid.dim_names.index("pp")]

        def depth(target, target_weight):
            visiting = set()

            def walk(node):
                if node in visiting:
                    raise ValueError("Topology contains cycles; expected a DAG.")
                visiting.add(node)
                best = max((walk(p) for p in preds[node]), default=0)
                visiting.remove(node)
                return (target_weight if node == target else stages(node)) + best

            return walk(target)

        if rank is None:
            return max(depth(sink, stages(sink)) for sink in sinks)

        def stage_of(name):
            for group in module_to_grid_map[name]._gen_rank_enum(["pp"]):
                if rank in group:
                    return group.index(rank)
            return None

        candidates = [module_name] if module_name is not None else [n for n in nodes if stage_of(n) is not None]
        results = []
        for name in candidates:
            stage = stage_of(name)
            if stage is None:
                raise ValueError(f"rank {rank} is not in the grid of module {name!r}")
            results.append(depth(name, stage + 1))
        if not results:
            raise ValueError(f"rank {rank} is in no module's grid")
        return max(results)
