"""torch_dist T5 checkpoints against the real megatron-core 0.16.1 (a subprocess, mcore_t5_oracle_child.py): its
T5Model (local specs + final norms) saves a checkpoint and the logits of a fixed batch; our megatron-core T5Model
loads that checkpoint (at TP=1 and, on 2 ranks, at TP=2 and at PP=2 with split rank 1) and gives its logits; the
keys and shapes our T5 writes are exactly the ones megatron-core wrote (so it reads ours)."""
import os

import pytest
import torch

from helpers.dist_harness import run_distributed
from helpers.mcore_oracle import run_oracle
from helpers.numerics import rel_err

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_t5_oracle_child.py")
VOCAB, SE, SD, LAYERS = 64, 10, 7, 2

# A megatron-core subprocess (~40 s of imports and setup on 2 busy cores) plus a 2-rank load at three layouts.
pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcore_t5")
    run_oracle([CHILD, tmp / "ckpt", tmp / "out.pt"], cwd=tmp)
    return str(tmp / "ckpt"), torch.load(tmp / "out.pt")


def _batch():  # the oracle's batch
    g = torch.Generator().manual_seed(3)
    enc = torch.randint(1, 60, (2, SE), generator=g)
    dec = torch.randint(1, 60, (2, SD), generator=g)
    enc[1, SE - 3:] = 0
    dec[1, SD - 2:] = 0
    return enc, dec


def load_body(directory):
    from helpers.models_helpers import tiny_config
    from helpers.t5_helpers import t5_masks
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.sharded_io import stored_shapes
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                                 get_t5_encoder_with_local_block_spec)
    from megatron.training.checkpointing import torch_dist as dc

    world = torch.distributed.get_world_size()
    out = {}
    for tp, pp, split in ((1, 1, None), (world, 1, None), (1, world, 1)):
        if (tp, pp) == (1, 1) and world > 1 and split is None and out:
            continue
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, pipeline_model_parallel_split_rank=split if pp > 1 else None)
        tensor_parallel.model_parallel_cuda_manual_seed(99)  # not the oracle's weights: they come from the file
        config = tiny_config(tp=tp, pp=pp, num_layers=LAYERS, ffn_hidden_size=64)
        encoder_stage = ps.is_pipeline_stage_before_split()
        stage = dict(pre_process=True, post_process=True) if pp == 1 else \
            dict(pre_process=True, post_process=True, add_encoder=encoder_stage, add_decoder=not encoder_stage)
        model = T5Model(config, config, get_t5_encoder_with_local_block_spec(LAYERS),
                        get_t5_decoder_with_local_block_spec(LAYERS), vocab_size=VOCAB, max_sequence_length=16,
                        share_embeddings_and_output_weights=True, parallel_output=False, **stage).eval()
        request = dc.model_sharded_state([model], for_load=True)
        if (tp, pp) == (1, 1):
            stored = {k: v for k, v in stored_shapes(directory).items() if "_extra_state" not in k}
            ours = {k: tuple(v[0].global_shape) for k, v in request.items() if "_extra_state" not in k}
            out["keys"] = (sorted(stored.items()), sorted(ours.items()))
        dc.load_sharded_checked(request, directory, "raise_all")
        dc.apply_loaded_model([model], request)
        enc, dec = _batch()
        masks = [m.unsqueeze(1) for m in t5_masks(enc, dec)]
        with torch.no_grad():
            if pp == 1:
                out[(tp, pp)] = model(enc, dec, *masks)
            elif encoder_stage:
                hidden = model(enc, dec, *masks)
                torch.distributed.send(hidden.contiguous(), ps.get_pipeline_model_parallel_next_rank())
            else:
                hidden = torch.empty(SE, 2, 32)
                torch.distributed.recv(hidden, ps.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor([hidden])
                out[(tp, pp)] = model(enc, dec, *masks)
    ps.destroy_model_parallel()
    return out


def test_megatron_core_t5_checkpoint_loads_here_and_keys_match(oracle_run):
    directory, oracle = oracle_run
    results = run_distributed(load_body, 2, directory, timeout=240)
    stored, ours = results[0]["keys"]
    assert ours == stored, set(ours) ^ set(stored)
    keep = torch.ones_like(oracle["logits"][..., 0], dtype=torch.bool)
    keep[1, SD - 2:] = False  # padded decoder positions are not compared (fully masked rows)
    errs = {}
    for rank, out in enumerate(results):
        for layout, logits in out.items():
            if layout != "keys":
                errs[(rank, layout)] = rel_err(logits[keep], oracle["logits"][keep])
    print(f"our T5 on megatron-core's T5 checkpoint, logits max relative error per (rank, (TP, PP)): {errs}")
    assert {layout for _, layout in errs} == {(1, 1), (2, 1), (1, 2)}
    assert max(errs.values()) <= 1e-5
