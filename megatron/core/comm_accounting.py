"""Count the bytes that cross each process group (megatron.core.comm_accounting).

``CommAccountant`` temporarily wraps the ``torch.distributed`` collectives and point-to-point calls this
library uses and records, per process group (named ``tp``, ``pp``, ``dp``, ``embedding``, ``mp``, ``ep``, ``expert_dp``,
``world`` ... by comparing with :mod:`parallel_state`'s groups) and per operation, the number of calls and the payload
bytes. Use it around the code to measure, e.g. one ``train_step``::

    accountant = CommAccountant()
    with accountant:
        train_step(...)
    print(accountant.table())

Conventions (docs/performance.md, "Scaling on paper"): the *payload* ``N`` of a call is the size of the whole
logical buffer — the tensor of an all-reduce or broadcast, the gathered output of an all-gather, the input of
a reduce-scatter, the tensor of a send or receive. ``ring_bytes`` is what one rank transmits for that
payload with a ring algorithm over ``t`` ranks: ``2 (t-1)/t N`` for an all-reduce, ``(t-1)/t N`` for an
all-gather, reduce-scatter or (pipelined) broadcast, ``N`` for a send, 0 for a receive.

Only calls made through the ``torch.distributed`` module attributes are seen (this library resolves them at
call time, see ``megatron.core.utils``); a call made from inside another wrapped call is counted once, as
the outer one. Counting is for measurement: the wrappers add a dictionary update per call.
"""
from __future__ import annotations

import threading
from collections import defaultdict
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "gather", "scatter",
                "all_to_all_single", "barrier")
_P2P = ("send", "recv", "isend", "irecv")
# Normalised names, so that the deprecated and the new spellings of one collective count together.
_KIND = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
         "isend": "send", "irecv": "recv"}


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _arg(args, kwargs, index, name):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _payload(op: str, args, kwargs) -> int:
    """The logical buffer size N of one call (see the module docstring)."""
    if op == "barrier":
        return 0
    if op in ("all_gather", "reduce_scatter"):  # list APIs: (output_list, input) / (output, input_list)
        first = _arg(args, kwargs, 0, "tensor_list" if op == "all_gather" else "output")
        second = _arg(args, kwargs, 1, "tensor" if op == "all_gather" else "input_list")
        return _nbytes(first) if op == "all_gather" else _nbytes(second)
    if op in ("all_gather_into_tensor", "all_gather_single"):
        return _nbytes(_arg(args, kwargs, 0, "output_tensor"))
    if op in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return _nbytes(_arg(args, kwargs, 1, "input"))
    if op == "gather":
        return _nbytes(_arg(args, kwargs, 0, "tensor"))  # this rank's contribution
    if op == "scatter":
        return _nbytes(_arg(args, kwargs, 0, "tensor"))
    if op == "all_to_all_single":
        return _nbytes(_arg(args, kwargs, 1, "input"))
    return _nbytes(_arg(args, kwargs, 0, "tensor"))


def ring_bytes(kind: str, payload: int, group_size: int) -> float:
    """Bytes one rank transmits for a payload of ``payload`` bytes over ``group_size`` ranks (ring algorithms)."""
    t = group_size
    if kind == "recv" or (t <= 1 and kind != "send"):
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (t - 1) / t * payload
    if kind == "send":
        return float(payload)
    return (t - 1) / t * payload


def group_names() -> Dict[int, str]:
    """``id(process group) -> name`` for the groups of :mod:`parallel_state` (first name wins)."""
    from megatron.core import parallel_state as ps

    names: Dict[int, str] = {}
    getters = (("tp", "get_tensor_model_parallel_group"), ("pp", "get_pipeline_model_parallel_group"),
               ("dp", "get_data_parallel_group"), ("dp_gloo", "get_data_parallel_group_gloo"),
               ("embedding", "get_embedding_group"), ("position_embedding", "get_position_embedding_group"),
               ("mp", "get_model_parallel_group"), ("cp", "get_context_parallel_group"),
               ("amax", "get_amax_reduction_group"), ("dp_cp", "get_data_parallel_group", True),
               ("dp_cp_gloo", "get_data_parallel_group_gloo", True), ("ep", "get_expert_model_parallel_group"),
               ("expert_tp", "get_expert_tensor_parallel_group"),
               ("expert_tp_ep", "get_expert_tensor_and_model_parallel_group"),
               ("expert_dp", "get_expert_data_parallel_group"), ("tp_dp", "get_tensor_and_data_parallel_group"),
               ("tp_cp", "get_tensor_and_context_parallel_group"),
               ("expert_tp_ep_pp", "get_expert_tensor_model_pipeline_parallel_group"))
    for name, getter, *with_cp in getters:
        try:
            group = getattr(ps, getter)(**({"with_context_parallel": True} if with_cp else {}))
        except (AssertionError, AttributeError, RuntimeError):
            continue
        if group is not None:
            names.setdefault(id(group), name)
    return names


class CommAccountant:
    """Context manager that counts calls and payload bytes per (group name, operation)."""

    def __init__(self, names: Optional[Dict[int, str]] = None):
        self._names = names
        self._originals: Dict[str, tuple] = {}  # op -> (original, whether torch.distributed.<op> was patched)
        self._local = threading.local()
        # (group, kind) -> [calls, payload bytes, ring bytes sent by this rank]
        self.stats: Dict[Tuple[str, str], list] = defaultdict(lambda: [0, 0, 0.0])

    # ------------------------------------------------------------------------------ results
    def reset(self):
        self.stats.clear()

    def summary(self) -> Dict[str, Dict[str, dict]]:
        """``{group: {kind: {"calls", "bytes", "ring_bytes"}}}``."""
        out: Dict[str, Dict[str, dict]] = {}
        for (group, kind), (calls, nbytes, ring) in sorted(self.stats.items()):
            out.setdefault(group, {})[kind] = {"calls": calls, "bytes": nbytes, "ring_bytes": ring}
        return out

    def table(self) -> str:
        rows = ["group               op              calls        payload bytes     ring bytes sent"]
        for (group, kind), (calls, nbytes, ring) in sorted(self.stats.items()):
            rows.append(f"{group:<19} {kind:<15} {calls:5d} {nbytes:20d} {ring:19.0f}")
        return "\n".join(rows)

    # ------------------------------------------------------------------------------ recording
    def _group_name(self, group) -> Tuple[str, int]:
        if group is None or group is getattr(c10d.GroupMember, "WORLD", None):
            return "world", dist.get_world_size()
        if self._names is None:
            self._names = group_names()
        name = self._names.get(id(group))
        if name is None:
            ranks = dist.get_process_group_ranks(group)
            name = "ranks" + "-".join(str(r) for r in ranks) if len(ranks) <= 8 else \
                f"ranks{ranks[0]}-{ranks[1]}-...-{ranks[-1]} ({len(ranks)})"
        return name, dist.get_world_size(group=group)

    def _record(self, op: str, args, kwargs):
        group = kwargs.get("group")
        if group is None and op in _P2P and len(args) > 2:
            group = args[2]
        name, size = self._group_name(group)
        kind = _KIND.get(op, op)
        payload = _payload(op, args, kwargs)
        entry = self.stats[(name, kind)]
        entry[0] += 1
        entry[1] += payload
        entry[2] += ring_bytes(kind, payload, size)

    def _wrap(self, op: str, original):
        accountant = self

        def counted(*args, **kwargs):
            depth = getattr(accountant._local, "depth", 0)
            if depth == 0:
                accountant._record(op, args, kwargs)
            accountant._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                accountant._local.depth = depth

        counted.__name__ = getattr(original, "__name__", op)
        counted.__wrapped__ = original
        return counted

    def __enter__(self):
        if self._originals:
            raise RuntimeError("this CommAccountant is already active")
        for op in _COLLECTIVES + _P2P:
            original = getattr(c10d, op, None)
            if original is None:
                continue
            wrapped = self._wrap(op, original)
            # Both the package attribute (what callers use) and the c10d global (what P2POp and
            # batch_isend_irecv compare against and call) must be the wrapper.
            setattr(c10d, op, wrapped)
            in_package = getattr(dist, op, None) is original
            if in_package:
                setattr(dist, op, wrapped)
            self._originals[op] = (original, in_package)
        return self

    def __exit__(self, *exc):
        for op, (original, in_package) in self._originals.items():
            setattr(c10d, op, original)
            if in_package:
                setattr(dist, op, original)
        self._originals.clear()
        return False
