"""GLUE finetuning (MNLI, QQP) from TSV files."""
