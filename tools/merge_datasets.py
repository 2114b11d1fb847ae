"""Concatenate every ``.bin``/``.idx`` dataset in a directory (sorted by prefix) into one dataset.

    python tools/merge_datasets.py --input DIR --output-prefix merged_text_document
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.core.datasets.indexed_dataset import (  # noqa: E402
    IndexedDataset, IndexedDatasetBuilder, get_bin_path, get_idx_path)


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="Merge indexed datasets.")
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Path to directory containing all document files to merge")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix")
    group = parser.add_argument_group(title="miscellaneous")
    group.add_argument("--multimodal", action="store_true", help="Whether the datasets are assumed to be multimodal")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.input):
        parser.error(f"--input {args.input} is not a directory")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output_prefix))):
        parser.error(f"the directory of --output-prefix {args.output_prefix} does not exist")
    return args


def dataset_prefixes(directory: str):
    """Sorted prefixes of the .bin/.idx pairs in ``directory``; a lone .bin or .idx is an error."""
    stems = {}
    for name in os.listdir(directory):
        stem, ext = os.path.splitext(name)
        if ext in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
            stems.setdefault(stem, set()).add(ext)
    for stem, exts in stems.items():
        if exts != {".bin", ".idx"}:
            missing = ({".bin", ".idx"} - exts).pop()
            raise FileNotFoundError(f"{os.path.join(directory, stem)}{missing} is missing (its pair exists)")
    return [os.path.join(directory, stem) for stem in sorted(stems)]


def merge(prefixes, output_prefix: str, multimodal: bool = False) -> None:
    if not prefixes:
        raise FileNotFoundError("no .bin/.idx datasets to merge")
    output_prefix_abs = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == output_prefix_abs for p in prefixes):
        raise ValueError(f"--output-prefix {output_prefix} is one of the inputs; write it elsewhere")
    first = IndexedDataset(prefixes[0], multimodal=multimodal)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=first.index.dtype, multimodal=multimodal)
    del first
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(get_idx_path(output_prefix))


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        merge(dataset_prefixes(args.input), args.output_prefix, args.multimodal)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
