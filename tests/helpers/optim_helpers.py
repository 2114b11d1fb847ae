"""Toy models, data and comparisons shared by the tests in tests/optim (imported in spawned ranks too)."""
import copy

import torch

from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

IN, HID1, HID2, OUT = 6, 13, 11, 5


def init_parallel(tp=1, pp=1, vpp=None):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp)


def make_config(tp=1, pp=1, **kw):
    kw.setdefault("pipeline_dtype", torch.float32 if pp > 1 else None)
    return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=tp,
                             pipeline_model_parallel_size=pp, **kw)


class ToyModel(torch.nn.Module):
    """Odd parameter sizes (78, 13, 143, 11, 11, 11, 55, 5 elements) so that shards and buckets cut
    through parameters and need padding."""

    def __init__(self, seed=1234, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.fc1 = torch.nn.Linear(IN, HID1)
        self.fc2 = torch.nn.Linear(HID1, HID2)
        self.norm = torch.nn.LayerNorm(HID2)
        self.head = torch.nn.Linear(HID2, OUT)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.to(dtype)

    def forward(self, x):
        return self.head(self.norm(torch.tanh(self.fc2(torch.tanh(self.fc1(x.to(self.fc1.weight.dtype)))))))


def toy_batch(global_batch, seed=7, step=0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(global_batch, IN, generator=g), torch.randn(global_batch, OUT, generator=g)


def toy_loss(model, x, y):
    return ((model(x).float() - y) ** 2).mean()


def dp_slice(t, dp_rank, dp_size):
    return t.chunk(dp_size, dim=0)[dp_rank]


def reference_grads(model, x, y):
    """Gradients of the mean loss over the whole (concatenated) batch, computed in one process."""
    ref = copy.deepcopy(model)
    ref.zero_grad()
    toy_loss(ref, x, y).backward()
    return {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def main_grads(ddp_model):
    return {n: p.main_grad.detach().clone() for n, p in ddp_model.module.named_parameters()}
