"""Word embeddings shared between the first and last stage of a 2-stage pipeline.

The pipeline scheduler is not part of this area, so the two stages are driven by hand: stage 0 runs the
embedding and the first half of the layers and sends its activation with torch.distributed.send; stage 1 runs the
rest and the tied output layer, and sends the activation gradient back. Checked: the last stage's copy equals the
first stage's table after initialisation and after an optimizer step (with the embedding-group gradient
all-reduce the optimizer performs), and loss and gradients equal an unsplit (PP=1) model.
"""
import torch

from helpers.numerics import rel_err
from helpers.dist_harness import run_distributed
from helpers.models_helpers import gpt_inputs, tiny_config

from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.gpt import GPTModel as CoreGPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.model import GPTModel

LAYERS = 4


def _exchange_equal(tensor):
    """True when both ranks hold the same tensor."""
    gathered = [torch.empty_like(tensor) for _ in range(2)]
    torch.distributed.all_gather(gathered, tensor.contiguous())
    return torch.equal(gathered[0], gathered[1])


def _two_stage_step(model, first, ids, pos, mask, labels, hidden_shape):
    """One forward/backward through two stages with explicit send/recv; returns the loss on stage 1."""
    if first:
        out = model(ids, pos, mask)
        torch.distributed.send(out.detach().contiguous(), dst=1)
        grad = torch.empty_like(out)
        torch.distributed.recv(grad, src=1)
        out.backward(grad)
        return None
    received = torch.empty(hidden_shape)
    torch.distributed.recv(received, src=0)
    received.requires_grad_()
    model.set_input_tensor(received)
    loss = model(ids, pos, mask, labels=labels).mean()
    loss.backward()
    torch.distributed.send(received.grad.contiguous(), dst=0)
    return loss.detach()


def _allreduce_embedding_grads(weight):
    """What Megatron's optimizer does after backward: sum the tied weights' grads over the embedding group."""
    torch.distributed.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def pipeline_body():
    rank = torch.distributed.get_rank()
    first = rank == 0
    ids, pos, mask, labels = gpt_inputs()
    hidden_shape = (ids.shape[1], ids.shape[0], 32)
    results = {}

    # Reference: the whole model on one stage (each rank builds it identically).
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(11)
    reference = GPTModel(tiny_config(num_layers=LAYERS))
    ref_loss = reference(ids, pos, mask, labels=labels).mean()
    ref_loss.backward()
    ref_sd = reference.state_dict()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    parallel_state.destroy_model_parallel()

    # Legacy GPTModel on 2 stages.
    parallel_state.initialize_model_parallel(1, 2)
    tensor_parallel.model_parallel_cuda_manual_seed(100 * rank)  # different streams per stage, as in Megatron
    config = tiny_config(num_layers=LAYERS, pp=2)
    model = GPTModel(config, pre_process=first, post_process=not first)
    shared = model.shared_embedding_or_output_weight()
    assert (not first) == getattr(shared, "shared", False)
    results["equal after init"] = _exchange_equal(shared.detach())
    results["nonzero after init"] = bool(shared.detach().abs().sum() > 0)
    if not first:
        assert "word_embeddings_for_head" in model.state_dict_for_save_checkpoint()

    # Load the reference weights (stage 1 holds layers 2, 3 as its local layers 0, 1).
    local = {}
    for key, value in ref_sd.items():
        if key.startswith("language_model.encoder.layers."):
            index = int(key.split(".")[3])
            if (index < LAYERS // 2) == first:
                local[key.replace(f"layers.{index}.", f"layers.{index % (LAYERS // 2)}.", 1)] = value
        elif key.startswith("language_model.embedding.") and first:
            local[key] = value
        elif key.startswith("language_model.encoder.final_layernorm.") and not first:
            local[key] = value
    if not first:
        local["word_embeddings.weight"] = ref_sd["language_model.embedding.word_embeddings.weight"]
    model.load_state_dict(local)

    loss = _two_stage_step(model, first, ids, pos, mask, labels, hidden_shape)
    _allreduce_embedding_grads(shared)
    results["loss error vs PP=1"] = 0.0 if first else rel_err(loss, ref_loss)
    results["tied grad error vs PP=1"] = rel_err(shared.grad, ref_grads["language_model.embedding.word_embeddings.weight"])
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    results["equal after step"] = _exchange_equal(shared.detach())
    results["changed by step"] = not torch.equal(shared.detach(), ref_sd["language_model.embedding.word_embeddings.weight"])
    parallel_state.destroy_model_parallel()

    # megatron-core GPTModel: the last stage's copy lives in output_layer.weight.
    parallel_state.initialize_model_parallel(1, 2)
    tensor_parallel.model_parallel_cuda_manual_seed(100 * rank)
    core = CoreGPTModel(tiny_config(num_layers=LAYERS, pp=2), get_gpt_layer_local_spec(), 64, 16,
                        pre_process=first, post_process=not first, share_embeddings_and_output_weights=True)
    weight = core.shared_embedding_or_output_weight()
    results["mcore equal after init"] = _exchange_equal(weight.detach())
    _two_stage_step(core, first, ids, pos, mask, labels, hidden_shape)
    _allreduce_embedding_grads(weight)
    torch.optim.SGD(core.parameters(), lr=0.5).step()
    results["mcore equal after step"] = _exchange_equal(weight.detach())
    parallel_state.destroy_model_parallel()
    return results


def test_shared_embeddings_two_stage_pipeline():
    results = run_distributed(pipeline_body, 2, timeout=120)
    for rank, res in enumerate(results):
        print(f"stage {rank}: {res}")
        for key in ("equal after init", "nonzero after init", "equal after step", "changed by step",
                    "mcore equal after init", "mcore equal after step"):
            assert res[key] is True, (rank, key, res)
        assert res["loss error vs PP=1"] <= 1e-6 and res["tied grad error vs PP=1"] <= 1e-5, res
