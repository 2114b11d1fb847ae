"""A checkpoint as Megatron-LM's training loop writes it, made with the REAL megatron-core 0.16.1 (never our package)
on CPU/gloo: a tied GPT-2-shaped GPT with Megatron-LM's default fused bias-GeLU (the tanh form) (8 layers, hidden 32, vocab 256, seq 32) wrapped in megatron-core's DDP, its
non-distributed Adam (``get_megatron_optimizer``) and ``OptimizerParamScheduler``, two real optimizer steps, the
scheduler advanced to iteration 7, then ``dist_checkpointing.save`` of the state dict Megatron-LM's
``generate_state_dict`` builds (args Namespace, checkpoint_version 3.0, iteration, model, optimizer,
opt_param_scheduler, rng_state ShardedObject, num_floating_point_operations_so_far) and the tracker file last.

Usage (``PYTHONPATH=<megatron-core install dir>``, cwd outside our repository):
    python mcore_oracle_train_child.py TP WORLD CKPT_DIR OUT
OUT (rank 0): logits of a fixed batch, the lr, the scheduler state and rank 0's Adam moments by parameter name.
"""
import argparse
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

from mcore_oracle_child import _stub_cuda  # the script's directory is sys.path[0]

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GBS, ITER, TRAIN_ITERS = 256, 32, 32, 8, 4, 4, 7, 9


def _cuda_to_cpu():
    """megatron-core's optimizer allocates a few scalars with device='cuda': make them CPU tensors here."""
    for name in ("tensor", "zeros", "ones", "empty", "full"):
        original = getattr(torch, name)

        def factory(*a, _original=original, **k):
            if str(k.get("device", "")).startswith("cuda"):
                k["device"] = "cpu"
            return _original(*a, **k)
        setattr(torch, name, factory)


def _worker(rank, world, port, tp, ckpt, out):
    _stub_cuda()
    _cuda_to_cpu()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing, parallel_state as ps, tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, 1)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
                            activation_func=F.gelu, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True, tensor_model_parallel_size=tp, params_dtype=torch.float32,
                            bias_activation_fusion=True, masked_softmax_fusion=False, bias_dropout_fusion=False,
                            persist_layer_norm=False, gradient_accumulation_fusion=False, init_method_std=0.05)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, SEQ, parallel_output=True,
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.01,
                                                 clip_grad=0.0, bf16=False, fp16=False), [ddp])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2 * GBS,
                                    lr_decay_steps=20 * GBS, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=TRAIN_ITERS * GBS, wd_incr_style="constant")
    g = torch.Generator().manual_seed(11)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    for _ in range(2):  # two optimizer steps so that Adam's moments are not trivial
        ids = torch.randint(0, 99, (2, SEQ + 1), generator=g)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(ids[:, :-1], pos, mask, labels=ids[:, 1:]).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        sched.step(increment=GBS)
    for _ in range(ITER - 2):
        sched.step(increment=GBS)
    ids = torch.randint(0, 99, (2, SEQ), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(model(ids, pos, mask))
    model_sd = model.sharded_state_dict()
    args = argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, ffn_hidden_size=4 * HIDDEN,
                              seq_length=SEQ, max_position_embeddings=SEQ, padded_vocab_size=VOCAB,
                              make_vocab_size_divisible_by=128, tokenizer_type="NullTokenizer", vocab_size=99,
                              add_position_embedding=True, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                              data_parallel_size=world // tp, global_batch_size=GBS, micro_batch_size=1,
                              consumed_train_samples=ITER * GBS, skipped_train_samples=0, consumed_valid_samples=0,
                              iteration=ITER, train_iters=TRAIN_ITERS, lr_decay_iters=20, ckpt_format="torch_dist", no_save_rng=False,
                              no_save_optim=False, use_distributed_optimizer=False, fp16=False, bf16=False, seed=1234)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    rng = [{"random_rng_state": __import__("random").getstate(), "np_rng_state": __import__("numpy").random.get_state(),
            "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
            "rng_tracker_states": tracker.get_states()}]
    tp_rank = ps.get_tensor_model_parallel_rank()
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITER, "model": model_sd,
             "optimizer": opt.sharded_state_dict(model_sd), "opt_param_scheduler": sched.state_dict(),
             "rng_state": ShardedObject("rng_state", rng, (1, tp), (0, tp_rank), replica_id=ps.get_data_parallel_rank()),
             "num_floating_point_operations_so_far": 12345.0}
    iter_dir = os.path.join(ckpt, f"iter_{ITER:07d}")
    os.makedirs(iter_dir, exist_ok=True)
    dist_checkpointing.save(state, iter_dir, content_metadata={"singleton_local_shards": False,
                                                               "chained_optim_avoid_prefix": True})
    torch.distributed.barrier()
    if rank == 0:
        with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITER))
        names = {id(p): n for n, p in model.named_parameters()}
        moments = {names[id(p)]: {k: opt.optimizer.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                   for group in opt.optimizer.param_groups for p in group["params"]}
        torch.save({"logits": logits.float(), "lr": opt.param_groups[0]["lr"], "moments": moments,
                    "sched": sched.state_dict()}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main():
    tp, world, ckpt, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.makedirs(ckpt, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(world, port, tp, ckpt, out), nprocs=world, join=True)


if __name__ == "__main__":
    main()
