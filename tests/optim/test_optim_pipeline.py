"""A 2-stage pipeline whose word embedding is tied to the output layer, against the unsharded model.

Stage 0 embeds the tokens and runs one layer; stage 1 holds a copy of the embedding (``shared = True``) to
compute the logits. After backward, finalize_model_grads must give both copies the sum of the two uses'
gradients (embedding-group all-reduce), the global grad norm must count the embedding once, and after
clipped Adam steps both stages must hold the unsharded model's parameters. Run with plain DDP (PP=2,
DP=1) and with the distributed optimizer, overlapped reduce-scatter and small buckets (PP=2, DP=2), where
the tied embedding needs the same sharding on both stages.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.optim_helpers import init_parallel, make_config

V, H, S, B_PER_DP = 10, 6, 5, 2


class FullModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(21)
        self.word_embeddings = torch.nn.Embedding(V, H)
        self.fc = torch.nn.Linear(H, H)
        self.norm = torch.nn.LayerNorm(H)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.7)

    def first(self, ids):
        return torch.tanh(self.fc(self.word_embeddings(ids)))

    def last(self, hidden, weight):
        return self.norm(hidden) @ weight.t()

    def forward(self, ids):
        return self.last(self.first(ids), self.word_embeddings.weight)


class FirstStage(torch.nn.Module):
    share_embeddings_and_output_weights = True
    pre_process, post_process = True, False

    def __init__(self, full):
        super().__init__()
        self.word_embeddings = copy.deepcopy(full.word_embeddings)
        self.fc = copy.deepcopy(full.fc)

    def shared_embedding_or_output_weight(self):
        return self.word_embeddings.weight

    def forward(self, ids):
        return torch.tanh(self.fc(self.word_embeddings(ids)))


class LastStage(torch.nn.Module):
    share_embeddings_and_output_weights = True
    pre_process, post_process = False, True

    def __init__(self, full):
        super().__init__()
        self.norm = copy.deepcopy(full.norm)
        self.word_embeddings = copy.deepcopy(full.word_embeddings)
        self.word_embeddings.weight.shared = True  # Megatron marks the last stage's copy

    def shared_embedding_or_output_weight(self):
        return self.word_embeddings.weight

    def forward(self, hidden):
        return self.norm(hidden) @ self.word_embeddings.weight.t()


def _batch(step, dp):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, V, (B_PER_DP * dp, S), generator=g), torch.randint(0, V, (B_PER_DP * dp, S), generator=g)


def pipeline_body(dp, distributed_optimizer):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    init_parallel(pp=2)
    assert ps.get_data_parallel_world_size() == dp
    stage, r = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
    full = FullModel()
    module = FirstStage(full) if stage == 0 else LastStage(full)
    # bucket_size=50 puts the embedding in a bucket with fc on stage 0 but alone on stage 1: without its own
    # bucket the two stages would shard it differently and the embedding all-reduce would mix shards.
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer,
                                               overlap_grad_reduce=distributed_optimizer, bucket_size=50)
    model = DistributedDataParallel(make_config(pp=2), ddp_config, module)
    opt = get_megatron_optimizer(OptimizerConfig(lr=0.02, weight_decay=0.1, clip_grad=0.5,
                                                 use_distributed_optimizer=distributed_optimizer), [model])

    ref = copy.deepcopy(full)
    ref_opt = torch.optim.AdamW([{"params": [ref.word_embeddings.weight, ref.fc.weight], "weight_decay": 0.1},
                                 {"params": [ref.fc.bias, ref.norm.weight, ref.norm.bias], "weight_decay": 0.0}],
                                lr=0.02, foreach=False)
    norms, emb_grad_errs = [], []
    for step in range(3):
        ids, labels = _batch(step, dp)
        my_ids, my_labels = ids.chunk(dp)[r], labels.chunk(dp)[r]
        model.zero_grad_buffer()
        opt.zero_grad()
        if stage == 0:
            hidden = model(my_ids)
            torch.distributed.send(hidden.detach(), ps.get_pipeline_model_parallel_next_rank())
            grad = torch.empty_like(hidden)
            torch.distributed.recv(grad, ps.get_pipeline_model_parallel_prev_rank())
            hidden.backward(grad)
        else:
            hidden = torch.empty(B_PER_DP, S, H)
            torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            hidden.requires_grad_(True)
            loss = F.cross_entropy(model(hidden).reshape(-1, V), my_labels.reshape(-1))
            loss.backward()
            torch.distributed.send(hidden.grad, ps.get_pipeline_model_parallel_next_rank())
        finalize_model_grads([model])

        ref_opt.zero_grad()
        F.cross_entropy(ref(ids).reshape(-1, V), labels.reshape(-1)).backward()
        # The embedding gradient after finalize: full on plain DDP, this rank's shard with the distributed
        # optimizer (the rest of the buffer holds partial sums that nobody reads).
        ours = module.word_embeddings.weight.main_grad.view(-1)
        theirs = ref.word_embeddings.weight.grad.view(-1)
        if distributed_optimizer:
            piece = opt.param_ranges[module.word_embeddings.weight]
            ours = ours[piece.param_start:piece.param_end]
            theirs = theirs[piece.param_start:piece.param_end]
        emb_grad_errs.append(rel_err(ours, theirs))
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()
        ref_opt.step()
        ok, norm, _ = opt.step()
        norms.append(abs(norm - ref_norm) / ref_norm)

    if stage == 0:
        pairs = [(module.word_embeddings.weight, ref.word_embeddings.weight), (module.fc.weight, ref.fc.weight),
                 (module.fc.bias, ref.fc.bias)]
    else:
        pairs = [(module.word_embeddings.weight, ref.word_embeddings.weight), (module.norm.weight, ref.norm.weight),
                 (module.norm.bias, ref.norm.bias)]
    return {"norm": max(norms), "clip_active": ref_norm > 0.5, "emb_grad": max(emb_grad_errs),
            "params": max(rel_err(a, b) for a, b in pairs)}


@pytest.mark.parametrize("dp,distributed_optimizer", [(1, False), (2, True)], ids=["pp2", "pp2_dp2_distopt"])
def test_pipeline_tied_embedding_grads_norm_and_updates(dp, distributed_optimizer):
    results = run_distributed(pipeline_body, 2 * dp, dp, distributed_optimizer, timeout=120)
    for rank, out in enumerate(results):
        assert out["emb_grad"] < 1e-6, (rank, out)
        assert out["norm"] < 1e-6 and out["clip_active"], (rank, out)
        assert out["params"] < 1e-6, (rank, out)
