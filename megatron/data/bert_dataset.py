"""Legacy path of the BERT dataset (re-exports of megatron.core.datasets.bert_dataset)."""
from megatron.core.datasets.bert_dataset import (  # noqa: F401
    BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig, BertDataset)
