"""A GPT with Gated DeltaNet and attention layers (megatron-core's experimental-attention-variant block spec) split
over 2 tensor-parallel ranks with sequence parallelism equals the unsharded model, and its torch_dist checkpoint does
not depend on TP.

One gloo run of 2 ranks. Both ranks build the TP = 1 model (same seed) and run a forward / backward; its weights and
its gradients (copied into a second TP = 1 model's weights) are saved with ``dist_checkpointing.save``. The TP = 2 + SP
model loads the weights from that checkpoint (``in_proj.weight.{query,key,value,z,beta,alpha}`` and the conv's pieces
sliced per rank by the sharded state dict), runs the same batch, sums over TP the gradients of the replicated weights
(norms, which see a sequence shard or a head shard), saves its gradients the same way, and the TP = 1 model loads them
back: logits, loss and every gradient equal the reference within 1e-5 relative.
"""
import os

import torch
import torch.nn.functional as F

from helpers.dist_harness import run_distributed
from helpers.models_helpers import gpt_inputs
from helpers.numerics import rel_err

SEQ, BATCH, VOCAB = 8, 2, 64


def _model(tp, sp):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
        get_transformer_block_with_experimental_attention_variant_spec)
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, normalization="RMSNorm",
        layernorm_epsilon=1e-6, activation_func=F.silu, gated_linear_unit=True, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False, use_cpu_initialization=True,
        tensor_model_parallel_size=tp, sequence_parallel=sp, experimental_attention_variant="gated_delta_net",
        linear_attention_freq=2, linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=6,
        linear_num_key_heads=2, linear_num_value_heads=4)
    spec = get_transformer_block_with_experimental_attention_variant_spec(config)
    return GPTModel(config, spec, VOCAB, SEQ, position_embedding_type="rope")


def _run(model):
    ids, pos, _, labels = gpt_inputs(batch=BATCH, seq=SEQ, vocab=VOCAB - 4)
    logits = model(ids, pos, None)
    loss = model(ids, pos, None, labels=labels)
    loss.mean().backward()
    return logits.detach(), loss.detach()


def _save_grads(model, directory):
    """The gradients saved as if they were the weights (the model's own sharded state dict)."""
    from megatron.core import dist_checkpointing

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    dist_checkpointing.save(model.sharded_state_dict(), directory)


def body(root):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    rank = torch.distributed.get_rank()
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    torch.manual_seed(5)
    ref = _model(1, False)
    kinds = [type(layer.self_attention).__name__ for layer in ref.decoder.layers]
    ref_logits, ref_loss = _run(ref)
    dist_checkpointing.save(ref.sharded_state_dict(), os.path.join(root, "weights"))
    ref_grads = {k: p.grad.clone() for k, p in ref.named_parameters()}
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(2, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    model = _model(2, True)
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), os.path.join(root, "weights")))
    logits, loss = _run(model)
    for p in model.parameters():
        if getattr(p, "sequence_parallel", False):
            torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    gathered = [torch.empty_like(logits) for _ in range(2)]
    torch.distributed.all_gather(gathered, logits, group=ps.get_tensor_model_parallel_group())
    _save_grads(model, os.path.join(root, "grads"))
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(1, 1)
    back = _model(1, False)
    back.load_state_dict(dist_checkpointing.load(back.sharded_state_dict(), os.path.join(root, "grads")))
    grads = dict(back.named_parameters())
    ps.destroy_model_parallel()
    return {"kinds": kinds, "rank": rank, "logits": rel_err(torch.cat(gathered, -1), ref_logits),
            "loss": rel_err(loss, ref_loss), "grads": {k: rel_err(grads[k].detach(), g) for k, g in ref_grads.items()}}


def test_gated_delta_net_gpt_tp2_sp_equals_tp1_and_reshards(tmp_path):
    outs = run_distributed(body, 2, str(tmp_path), timeout=240)
    for out in outs:
        assert out["kinds"] == ["GatedDeltaNet", "SelfAttention"], out["kinds"]
        assert out["logits"] < 1e-5 and out["loss"] < 1e-5, out
        worst = max(out["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst
        assert any("in_proj" in k for k in out["grads"]) and any("conv1d" in k for k in out["grads"])
    print({k: v for k, v in outs[0].items() if k != "grads"}, max(outs[0]["grads"].values()))
