"""T5 with pipeline parallelism PP=2 and --pipeline-model-parallel-split-rank 1 (encoder on stage 0, decoder on
stage 1, embedding on both, synchronised over the embedding and position-embedding groups) through the 1F1B
schedule, our DDP, finalize_model_grads and Adam with gradient clipping, against the same T5 trained at PP=1 in
plain PyTorch (torch.optim.Adam, torch's clip_grad_norm_): losses per iteration and the first step's gradients,
for the legacy and the megatron-core T5Model. Stage 1 receives [encoder output] and the last-stage backward returns
the cross-attention gradient of the encoder output to stage 0."""
import torch

from helpers.dist_harness import run_distributed
from helpers.models_helpers import tiny_config
from helpers.numerics import rel_err
from helpers.t5_helpers import VOCAB, randomize_, t5_inputs, t5_masks

STEPS, MICRO, MBS, SE, SD = 3, 2, 2, 10, 7


def _build(kind, config, **stage):
    from megatron.core.models.T5 import T5Model as CoreT5Model
    from megatron.core.models.T5.t5_spec import (get_t5_decoder_with_local_block_spec,
                                                 get_t5_encoder_with_local_block_spec)
    from megatron.model import T5Model

    if kind == "core":
        return CoreT5Model(config, config, get_t5_encoder_with_local_block_spec(2),
                           get_t5_decoder_with_local_block_spec(2), vocab_size=VOCAB, max_sequence_length=16,
                           share_embeddings_and_output_weights=True, **stage)
    return T5Model(config, **stage)


def _micro_batches(step):
    return [t5_inputs(batch=MBS, se=SE, sd=SD, seed=100 * step + k) for k in range(MICRO)]


def _masks(kind, enc, dec):
    masks = t5_masks(enc, dec)
    return [m.unsqueeze(1) for m in masks] if kind == "core" else list(masks)


def pipeline_body():
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    rank = torch.distributed.get_rank()
    out = {}
    for kind in ("legacy", "core"):
        # Reference: PP=1, plain PyTorch (each rank computes it alone).
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(11)
        ref = _build(kind, tiny_config(init_method_std=0.2))
        randomize_(ref)
        ref_sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        ref_losses, ref_grads = [], None
        for step in range(STEPS):
            opt.zero_grad()
            total = 0.0
            for enc, dec, labels, loss_mask in _micro_batches(step):
                loss = ref(enc, dec, *_masks(kind, enc, dec), lm_labels=labels)
                loss = (loss * loss_mask).sum() / loss_mask.sum() / MICRO
                loss.backward()
                total += loss.item()
            if step == 0:
                ref_grads = {k: p.grad.clone() for k, p in ref.state_dict(keep_vars=True).items()}
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            ref_losses.append(total)
        ps.destroy_model_parallel()

        # PP=2, split rank 1.
        ps.initialize_model_parallel(1, 2, pipeline_model_parallel_split_rank=1)
        tensor_parallel.model_parallel_cuda_manual_seed(100 + rank)
        config = tiny_config(pp=2, init_method_std=0.2)
        encoder_stage = ps.is_pipeline_stage_before_split()
        model = _build(kind, config, pre_process=True, post_process=True, add_encoder=encoder_stage,
                       add_decoder=not encoder_stage)
        model.model_type = ModelType.encoder_and_decoder
        assert model.add_encoder == encoder_stage and model.add_decoder == (not encoder_stage)
        # The split stage's embedding (words and positions) arrived from stage 0 by the all-reduce at construction.
        emb = model.language_model.embedding if kind == "legacy" else model.embedding
        init = torch.cat([emb.word_embeddings.weight.detach().flatten(), emb.position_embeddings.weight.detach().flatten()])
        stage_sd = model.state_dict()
        model.load_state_dict({k: ref_sd[k] for k in stage_sd})
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0), [ddp])
        config.grad_scale_func = optimizer.scale_loss
        config.no_sync_func = ddp.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        losses, grad_err = [], None
        for step in range(STEPS):
            data = iter(_micro_batches(step))

            def forward_step(data_iterator, m):
                enc, dec, labels, loss_mask = next(data_iterator)
                output = m(enc, dec, *_masks(kind, enc, dec), lm_labels=labels)

                def loss_func(o):
                    loss_sum = (o.float() * loss_mask).sum()
                    count = loss_mask.sum().to(torch.int)
                    return loss_sum, count, {"lm loss": torch.stack([loss_sum.detach(), count.float()])}

                return output, loss_func

            ddp.zero_grad_buffer()
            optimizer.zero_grad()
            reported = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=data, model=[ddp], num_microbatches=MICRO,
                seq_length=SE, micro_batch_size=MBS, decoder_seq_length=SD, forward_only=False)
            if step == 0:
                params = model.state_dict(keep_vars=True)
                grad_err = max(rel_err(params[k].main_grad, ref_grads[k]) for k in params
                               if isinstance(params[k], torch.nn.Parameter))
            ok, _, _ = optimizer.step()
            assert ok
            if reported:
                losses.append(sum((d["lm loss"][0] / d["lm loss"][1]).item() for d in reported) / MICRO)
        out[kind] = {"ref": ref_losses, "pp": losses, "grad_err": grad_err, "last": not encoder_stage,
                     "init_embedding": init}
        ps.destroy_model_parallel()
    return out


def test_t5_pipeline_split_rank_equals_pp1():
    results = run_distributed(pipeline_body, 2, timeout=180)
    for kind in ("legacy", "core"):
        for rank, out in enumerate(results):
            res = out[kind]
            print(f"{kind} T5 PP=2 split 1, stage {rank}: first-step gradients max relative error {res['grad_err']:.2e}")
            assert res["grad_err"] <= 1e-5
        last = results[1][kind]
        assert last["last"] and len(last["pp"]) == STEPS
        errors = [abs(a - b) / abs(b) for a, b in zip(last["pp"], last["ref"])]
        print(f"{kind} T5 losses PP=1 {last['ref']} vs PP=2 split 1 {last['pp']}: max relative error {max(errors):.2e}")
        assert max(errors) <= 1e-5
        assert torch.equal(results[0][kind]["init_embedding"], last["init_embedding"])
