"""Runs the REAL megatron-core (never our package) on CPU/gloo: build a tiny GPT with its local spec, save or load a
torch_dist checkpoint with ``megatron.core.dist_checkpointing`` and write the logits of a fixed batch.

Usage (``PYTHONPATH=<megatron-core install dir>``, cwd outside our repository):
    python mcore_oracle_child.py JOBS.json
JOBS.json lists jobs ``{"mode": "save"|"load", "style", "tp", "pp", "ckpt", "out"}``, run one after the other on
2 gloo ranks in one launch (the parallel state is rebuilt per job; ranks beyond TP x PP are data parallel). STYLE is ``gpt2`` (LayerNorm, GeLU, learned positions, biases, tied) or ``llama`` (RMSNorm, SwiGLU, RoPE, GQA,
untied, no biases). Only this subprocess stubs the few ``torch.cuda`` calls megatron-core makes on CPU.
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


def _config(style, tp, pp):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
              attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, params_dtype=torch.float32,
              bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
              persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
              init_method_std=0.05)
    if style == "llama":
        kw.update(num_attention_heads=8, num_query_groups=2, normalization="RMSNorm", gated_linear_unit=True,
                  activation_func=F.silu, add_bias_linear=False, ffn_hidden_size=96, layernorm_epsilon=1e-6)
    else:
        kw.update(ffn_hidden_size=4 * HIDDEN, activation_func=F.gelu)
    return TransformerConfig(**kw)


def _model(style, pre, post):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core import parallel_state as ps

    cfg = _config(style, ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization=cfg.normalization), VOCAB, SEQ,
                    pre_process=pre, post_process=post, parallel_output=False,
                    share_embeddings_and_output_weights=style == "gpt2",
                    position_embedding_type="rope" if style == "llama" else "learned_absolute")


def _batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 90, (2, SEQ), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(2, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return ids, pos, mask


def _job(mode, style, tp, pp, ckpt, out):
    from megatron.core import dist_checkpointing, parallel_state as ps, tensor_parallel

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp)
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
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    torch.distributed.barrier()


def _worker(rank, world, port, jobs):
    _stub_cuda()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    for job in jobs:
        _job(job["mode"], job["style"], job["tp"], job["pp"], job["ckpt"], job["out"])
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
