"""Legacy path of the indexed dataset (re-exports of megatron.core.datasets.indexed_dataset)."""
from megatron.core.datasets.indexed_dataset import (  # noqa: F401
    DType, IndexedDataset, IndexedDatasetBuilder, MMapIndexedDataset, MMapIndexedDatasetBuilder, get_bin_path,
    get_idx_path)

data_file_path = get_bin_path
index_file_path = get_idx_path
best_fitting_dtype = DType.optimal_dtype
