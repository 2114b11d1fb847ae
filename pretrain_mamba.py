"""Pretrain a hybrid Mamba model (Megatron-LM's entry point; HEAD also calls it ``pretrain_hybrid.py``):
``torchrun pretrain_mamba.py <Megatron flags> --hybrid-layer-pattern M-M*-...``.

Data, batches and the loss are GPT's (``pretrain_gpt.py``); the model is megatron-core's ``MambaModel``
(megatron/training/models/hybrid.py).
"""
import importlib.util
import os

from megatron.core.enums import ModelType
from megatron.post_training.arguments import add_modelopt_args
from megatron.training import pretrain
from megatron.training.errors import exit_on_configuration_error
from megatron.training.models.hybrid import hybrid_model_provider as model_provider


def _gpt_entry_point():
    """pretrain_gpt.py, the sibling script (its batch, loss and dataset functions serve hybrid models too)."""
    spec = importlib.util.spec_from_file_location(
        "pretrain_gpt", os.path.join(os.path.dirname(os.path.abspath(__file__)), "pretrain_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_gpt = _gpt_entry_point()
get_batch, loss_func, forward_step = _gpt.get_batch, _gpt.loss_func, _gpt.forward_step
train_valid_test_datasets_provider = _gpt.train_valid_test_datasets_provider


@exit_on_configuration_error()
def main():
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             extra_args_provider=add_modelopt_args, args_defaults={"tokenizer_type": "GPT2BPETokenizer"})


__all__ = ["model_provider", "forward_step", "train_valid_test_datasets_provider", "ModelType", "pretrain"]

if __name__ == "__main__":
    main()
