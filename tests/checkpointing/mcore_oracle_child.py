"""Runs the REAL megatron-core (never our package) on CPU/gloo: build a tiny GPT with its local spec, save or load a
torch_dist checkpoint with ``megatron.core.dist_checkpointing`` and write the logits of a fixed batch.

Usage (``PYTHONPATH=<megatron-core install dir>``, cwd outside our repository):
    python mcore_oracle_child.py JOBS.json
JOBS.json lists jobs ``{"mode": "save"|"load", "style", "tp", "pp", "ckpt", "out"[, "ep"]}``, run one after the
other on 2 gloo ranks in one launch (the parallel state is rebuilt per job; ranks beyond TP x PP are data parallel).
STYLE is ``gpt2`` (LayerNorm, GeLU, learned positions, biases, tied), ``llama`` (RMSNorm, SwiGLU, RoPE, GQA,
untied, no biases), ``mixtral`` (llama with MoE MLPs: 4 experts of width 48, top-2, SequentialMLP, ``ep`` expert
parallel ranks) or ``deepseek`` (see below). Only this subprocess stubs the few ``torch.cuda`` calls megatron-core makes
on CPU.

``deepseek``: multi-latent attention (query compression, latent norms, YaRN), a dense first layer then an MoE layer
(sigmoid routing with expert bias, a shared expert; allgather dispatcher: alltoall needs CUDA streams) and one MTP
depth, with megatron-core's local spec, which cannot build MLA on CPU as it is: its DotProductAttention refuses the
``k_channels`` / ``v_channels`` MLA passes (only Transformer Engine's accepts them), and MLASelfAttention tests
``isinstance(linear_proj, TELinear)`` with TELinear None. This child therefore gives the spec a core attention written
here from the definition (causal softmax(q k^T * scale) v, the scale MLA passes) and a stand-in TELinear class. In
"load" mode the local spec's norm keys are relabelled with Transformer Engine's fused names, as megatron-core's TE spec
keys them (``q_layernorm`` -> ``linear_q_up_proj.layer_norm_weight``, ``kv_layernorm`` ->
``linear_kv_up_proj.layer_norm_weight``, a dense layer's ``pre_mlp_layernorm`` -> ``mlp.linear_fc1.layer_norm_weight``).
"save" mode also writes each MTP depth's logged loss (training-mode forward with labels) next to the logits.
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


DEEPSEEK = dict(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_head_dim=8,
                qk_pos_emb_head_dim=4, v_head_dim=8, rotary_scaling_factor=4.0, original_max_position_embeddings=4,
                mscale=1.0, mscale_all_dim=0.5, qk_layernorm=True, normalization="RMSNorm", layernorm_epsilon=1e-6,
                add_bias_linear=False, ffn_hidden_size=96, num_moe_experts=4, moe_layer_freq=[0, 1],
                moe_ffn_hidden_size=24, moe_router_topk=2, moe_shared_expert_intermediate_size=24,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=2.5, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
                mtp_num_layers=1, mtp_loss_scaling_factor=0.3)
TE_NORM_NAMES = ((".self_attention.q_layernorm.", ".self_attention.linear_q_up_proj.layer_norm_"),
                 (".self_attention.kv_layernorm.", ".self_attention.linear_kv_up_proj.layer_norm_"))


def _deepseek_spec(cfg):
    """megatron-core's local block and MTP specs with the core attention and TELinear stand-ins (module docstring)."""
    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    class MathAttention(torch.nn.Module):
        def __init__(self, config, layer_number, attn_mask_type, attention_type=None, softmax_scale=None,
                     k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
            super().__init__()
            self.scale = softmax_scale

        def forward(self, q, k, v, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
            scores = torch.einsum("sbhd,tbhd->bhst", q, k) * self.scale
            scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
            out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)
            return out.reshape(out.shape[0], out.shape[1], -1)

    if not isinstance(mla.TELinear, type):
        mla.TELinear = type("TELinearStandIn", (), {})
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    for layer_spec in spec.layer_specs:
        layer_spec.submodules.self_attention.submodules.core_attention = MathAttention
    return spec, get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False)


def _te_names(sharded, cfg):
    """The sharded state dict of the local spec keyed as megatron-core's TE spec keys it (module docstring)."""
    for name, item in sharded.items():
        key = getattr(item, "key", None)
        if key is None or "._extra_state" in key:
            continue
        for local, te in TE_NORM_NAMES:
            key = key.replace(local, te)
        dense = key.startswith("decoder.layers.") and not cfg.moe_layer_freq[int(key.split(".")[2])]
        if dense and key.endswith("pre_mlp_layernorm.weight"):
            key = key.replace("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight")
        item.key = key
    return sharded


def _deepseek_outputs(model, ids, pos, mask):
    """{'logits': the main logits, 'mtp': each MTP depth's logged loss} of a training-mode forward with labels (0.16.1's
    GPTModel with MTP needs labels; the main logits are the output layer's last call, after the MTP depths')."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    calls = []
    hook = model.output_layer.register_forward_hook(  # (cloned: the loss works on the logits in place)
        lambda module, inputs, output: calls.append(output[0].detach().clone()))
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = torch.ones(2, SEQ)
    loss_mask[:, -1] = 0
    model.train()
    model(ids, pos, mask, labels=labels, loss_mask=loss_mask)
    hook.remove()
    return {"logits": calls[-1].transpose(0, 1).float(), "mtp": MTPLossLoggingHelper.tracker["values"].clone()}


def _config(style, tp, pp, ep=1):
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, hidden_dropout=0.0,
              attention_dropout=0.0, use_cpu_initialization=True, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, params_dtype=torch.float32,
              bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
              persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
              init_method_std=0.05)
    if style == "deepseek":
        # (TP = 1 only: megatron-core's torch norms refuse sequence parallelism, which MoE training at TP > 1 needs)
        kw.update(DEEPSEEK, gated_linear_unit=True, activation_func=F.silu, expert_model_parallel_size=ep)
        return MLATransformerConfig(**kw)
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
    if style == "deepseek":
        spec, mtp_spec = _deepseek_spec(cfg)
        return GPTModel(cfg, spec, VOCAB, SEQ, pre_process=pre, post_process=post, parallel_output=False,
                        position_embedding_type="rope", mtp_block_spec=mtp_spec)
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
        if style == "deepseek":
            sd = _te_names(sd, model.config)
        loaded = dist_checkpointing.load(sd, ckpt)
        model.load_state_dict(loaded, strict=False)
    ids, pos, mask = _batch()
    if style == "deepseek":
        result = _deepseek_outputs(model, ids, pos, mask)
    else:
        # Run the pipeline by hand: stage outputs go to the next stage.
        with torch.no_grad():
            if not ps.is_pipeline_first_stage():
                hidden = torch.empty(SEQ, 2, HIDDEN)
                torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(hidden)
            y = model(ids, pos, mask)
            if not ps.is_pipeline_last_stage():
                torch.distributed.send(y.contiguous(), ps.get_pipeline_model_parallel_next_rank())
        result = y.float()
    if ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0 \
            and ps.get_data_parallel_rank() == 0 and out != "-":
        torch.save(result, out)
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
