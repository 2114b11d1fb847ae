"""Runs the REAL megatron-core (never our package) on CPU/gloo: build a tiny GPT with its local spec, save or load a
torch_dist checkpoint with ``megatron.core.dist_checkpointing`` and write the logits of a fixed batch.

Usage (``PYTHONPATH=<megatron-core install dir>``, cwd outside our repository):
    python mcore_oracle_child.py JOBS.json
JOBS.json lists jobs ``{"mode": "save"|"load", "style", "tp", "pp", "ckpt", "out"[, "ep"]}``, run one after the
other on 2 gloo ranks in one launch (the parallel state is rebuilt per job; ranks beyond TP x PP are data parallel).
STYLE is ``gpt2`` (LayerNorm, GeLU, learned positions, biases, tied), ``llama`` (RMSNorm, SwiGLU, RoPE, GQA,
untied, no biases) or ``mixtral`` (llama with MoE MLPs: 4 experts of width 48, top-2, SequentialMLP, ``ep`` expert
parallel ranks). Only this subprocess stubs the few ``torch.cuda`` calls megatron-core makes on CPU.
"""
import os
import socket
import sys

import torch
import torch.multiprocessing as mp

VOCAB, SEQ, HIDDEN, LAYERS = 100, 8, 64, 4


def _stub_cuda():
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.device_count = lambda: 0
    torch.cuda.is_available = lambda: False
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.manual_seed = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.random.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.random.set_rng_state = lambda *a, **k: None
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._process_memory = lambda: 0  # needs psutil, which the oracle's environment may lack
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # defined only when Transformer Engine imports
        moe_utils.te_general_gemm = None


def describe_sharded(sharded_state_dict):
    """Sorted ``(state-dict path, kind, key, global shape, global offset, local shape, fragments, replica id,
    prepended axes, allow_shape_mismatch)`` of every leaf of a sharded state dict, factories built; objects give
    their unique key. Duck-typed, so it describes megatron-core's sharded state dicts and ours alike (the test
    compares the two)."""
    out = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (str(k),))
        elif isinstance(x, (list, tuple)) and not hasattr(x, "key"):
            for i, v in enumerate(x):
                walk(v, path + (str(i),))
        elif type(x).__name__ == "ShardedTensorFactory":
            walk(x.build(), path)
        elif type(x).__name__ == "ShardedTensor":
            out.append((".".join(path), "tensor", x.key, tuple(x.global_shape), tuple(x.global_offset),
                        tuple(x.local_shape), tuple(x.axis_fragmentations or ()), tuple(x.replica_id),
                        x.prepend_axis_num, bool(x.allow_shape_mismatch)))
        elif type(x).__name__ == "ShardedObject":
            out.append((".".join(path), "object", x.unique_key, (), (), (), (), tuple(x.replica_id), 0, False))
        else:
            out.append((".".join(path), "plain", type(x).__name__, (), (), (), (), (), 0, False))

    walk(sharded_state_dict, ())
    return sorted(out)


def _config(style, tp, pp, ep=1):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
              attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, params_dtype=torch.float32,
              bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
              persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
              init_method_std=0.05)
    if style == "mixtral":
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, expert_model_parallel_size=ep,
                  moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0)
    if style in ("llama", "mixtral"):
        kw.update(num_attention_heads=8, num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, ffn_hidden_size=96, layernorm_epsilon=1e-6)
    else:
        kw.update(ffn_hidden_size=4 * HIDDEN, activation_func=F.gelu)
    return TransformerConfig(**kw)


def _model(style, pre, post):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core import parallel_state as ps

    cfg = _config(style, ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                  ps.get_expert_model_parallel_world_size())
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts, normalization=cfg.normalization)
    return GPTModel(cfg, spec, VOCAB, SEQ,
                    pre_process=pre, post_process=post, parallel_output=False,
                    share_embeddings_and_output_weights=style == "gpt2",
                    position_embedding_type="learned_absolute" if style == "gpt2" else "rope")


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 90, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, pos, mask


def _job(mode, style, tp, pp, ckpt, out, ep=1):
    from megatron.core import dist_checkpointing, parallel_state as ps, tensor_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = _model(style, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    if mode == "load":
        sd = model.sharded_state_dict()
        loaded = dist_checkpointing.load(sd, ckpt)
        model.load_state_dict(loaded, strict=False)
    ids, pos, mask = _batch()
    # Run the pipeline by hand: stage outputs go to the next stage.
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(SEQ, 2, HIDDEN)
            torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
            model.set_input_tensor(hidden)
        y = model(ids, pos, mask)
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(y.contiguous(), ps.get_pipeline_model_parallel_next_rank())
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
            and ps.get_data_parallel_rank() == 0 and out != "-":
        torch.save(y.float(), out)
    if mode == "save":
        os.makedirs(ckpt, exist_ok=True)
        if out != "-":  # what megatron-core declares for this model, per rank (the test compares ours)
            torch.save(describe_sharded(model.sharded_state_dict()), f"{out}.sharded{torch.distributed.get_rank()}")
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    torch.distributed.barrier()


def _worker(rank, world, port, jobs):
    _stub_cuda()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    for job in jobs:
        _job(job["mode"], job["style"], job["tp"], job["pp"], job["ckpt"], job["out"], job.get("ep", 1))
    torch.distributed.destroy_process_group()


def main():
    import json

    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, port, jobs), nprocs=2, join=True)


if __name__ == "__main__":
    main()
