"""RACE multiple-choice finetuning from directories of JSON-lines files."""
