"""Runs the REAL megatron-core (never our package) on CPU/gloo, one process: builds its T5Model with the local
T5 block specs (plus a final LayerNorm per stack, which its local helpers only get with Transformer Engine),
saves a torch_dist checkpoint with ``megatron.core.dist_checkpointing`` and writes the logits of a fixed batch.

Usage (``PYTHONPATH=<megatron-core install dir>``, cwd outside our repository):
    python mcore_t5_oracle_child.py CKPT_DIR OUT_LOGITS
"""
import os
import socket
import sys

import torch

from mcore_oracle_child import _stub_cuda  # the script's directory is sys.path[0]

VOCAB, SE, SD, HIDDEN, LAYERS = 64, 10, 7, 32, 2


def _batch():
    g = torch.Generator().manual_seed(3)
    enc = torch.randint(1, 60, (2, SE), generator=g)
    dec = torch.randint(1, 60, (2, SD), generator=g)
    enc[1, SE - 3:] = 0
    dec[1, SD - 2:] = 0
    ek, dk = enc >= 1, dec >= 1
    tril = torch.tril(torch.ones(SD, SD, dtype=torch.bool))
    masks = [~(ek[:, None, :] & ek[:, :, None]), ~(dk[:, None, :] & dk[:, :, None] & tril),
             ~(dk[:, :, None] & ek[:, None, :])]
    return enc, dec, [m.unsqueeze(1) for m in masks]


def main():
    ckpt, out = sys.argv[1], sys.argv[2]
    _stub_cuda()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import dist_checkpointing, parallel_state as ps, tensor_parallel
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                                 get_t5_encoder_with_local_block_spec)
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(1, 1)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
                            params_dtype=torch.float32, bias_activation_fusion=False, masked_softmax_fusion=False,
                            bias_dropout_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
                            init_method_std=0.2)
    enc_spec = get_t5_encoder_with_local_block_spec(LAYERS)
    dec_spec = get_t5_decoder_with_local_block_spec(LAYERS)
    enc_spec.layer_norm = WrappedTorchNorm
    dec_spec.layer_norm = WrappedTorchNorm
    model = T5Model(cfg, cfg, enc_spec, dec_spec, vocab_size=VOCAB, max_sequence_length=16,
                    share_embeddings_and_output_weights=True, parallel_output=False).eval()
    with torch.no_grad():  # random biases and norms (zeros / ones would hide misplaced tensors)
        g = torch.Generator().manual_seed(5)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    enc, dec, masks = _batch()
    with torch.no_grad():
        logits = model(enc, dec, *masks)
    torch.save({"logits": logits.float(), "keys": sorted(model.sharded_state_dict().keys())}, out)
    os.makedirs(ckpt, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
