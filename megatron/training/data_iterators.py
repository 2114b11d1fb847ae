"""Train / validation / test data iterators: re-exports of megatron.training.datasets_provider.

One implementation: it builds datasets on the ranks that read data (tensor-parallel rank 0 of every pipeline
stage) and broadcasts the do_train/do_valid/do_test flags from global rank 0, so every rank learns what
will run.
"""
from megatron.training.datasets_provider import (  # noqa: F401
    build_train_valid_test_data_iterators, build_train_valid_test_data_loaders, cyclic_iter,
    get_train_valid_test_num_samples)

train_valid_test_num_samples = get_train_valid_test_num_samples
_cyclic_iter = cyclic_iter
