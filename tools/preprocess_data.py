"""Tokenise loose JSON (one object per line) into Megatron's ``.bin``/``.idx`` indexed datasets.

Same flags, output names (``{output_prefix}_{key}_{document|sentence}.bin/.idx``) and progress line as
Megatron-LM's tool. Differences that only help:
  * the input is streamed in blocks with a bounded number in flight, so memory does not grow with the
    input (and the index spills to disk past a few million entries);
  * workers receive raw blocks of lines and return NumPy token arrays (little work for the parent);
  * a malformed JSON line stops the run with its file and line number; the documents before it are written as
    a valid dataset named ``{prefix}.partial.bin/.idx``, and an existing ``{prefix}.bin/.idx`` is never touched
    by a failed run (outputs are written under temporary names and renamed only on success);
  * ``.gz`` inputs are recognised by content, with or without partitions.

Example:
    python tools/preprocess_data.py --input data/stdlib_prose.jsonl.gz --output-prefix my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/tokenizers/gpt2/vocab.json \\
        --merge-file data/tokenizers/gpt2/merges.txt --append-eod --workers 2
"""
from __future__ import annotations

import argparse
import glob
import math
import multiprocessing
import os
import sys
import time

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from tools.preprocess_encoder import (  # noqa: E402
    BLOCK_BYTES, EncodeFailure, Encoder, open_input, read_line_blocks)


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="Tokenise JSON lines into Megatron indexed datasets.")
    group = parser.add_argument_group(title="input data")
    group.add_argument("--input", type=str, required=True,
                       help="Path to input JSON (with --partitions > 1 a glob of JSON files)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="space separate listed of keys to extract from json")
    group.add_argument("--split-sentences", action="store_true", help="Split documents into sentences.")
    group.add_argument("--keep-newlines", action="store_true",
                       help="Keep newlines between sentences when splitting.")
    group = parser.add_argument_group(title="tokenizer")
    group.add_argument("--tokenizer-type", type=str, required=True,
                       choices=["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                                "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                                "NullTokenizer"],
                       help="What type of tokenizer to use.")
    group.add_argument("--tokenizer-model", type=str, default=None, help="YTTM tokenizer model.")
    group.add_argument("--vocab-file", type=str, default=None, help="Path to the vocab file")
    group.add_argument("--vocab-size", default=786, help="size of vocab for use with NullTokenizer")
    group.add_argument("--merge-file", type=str, default=None, help="Path to the BPE merge file (if necessary).")
    group.add_argument("--append-eod", action="store_true", help="Append an <eod> token to the end of a document.")
    group.add_argument("--lang", type=str, default="english", help="Language to use for NLTK-powered sentence splitting.")
    group = parser.add_argument_group(title="output data")
    group.add_argument("--output-prefix", type=str, required=True, help="Path to binary output file without suffix")
    group.add_argument("--dataset-impl", type=str, default="mmap", choices=["mmap"],
                       help="Accepted for old command lines; only the mmap format exists.")
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, required=True,
                       help="Number of worker processes to launch. A good default for fast pre-processing is: "
                            "(workers * partitions) = available CPU cores.")
    group.add_argument("--partitions", type=int, default=1, help="Number of file partitions")
    group.add_argument("--log-interval", type=int, default=1000, help="Interval between progress updates")
    group.add_argument("--keep-sequential-samples", action="store_true",
                       help="Ensure ordering of samples in .jsonl files is preserved when using partitions>1.")
    args = parser.parse_args(argv)
    args.keep_empty = False
    if args.tokenizer_type.lower().startswith("bert") and not args.split_sentences:
        print("Are you sure you don't want to split sentences?")
    if args.workers < 1 or args.partitions < 1:
        parser.error("--workers and --partitions must be at least 1")
    if args.workers % args.partitions != 0:
        parser.error(f"--workers ({args.workers}) must be a multiple of --partitions ({args.partitions})")
    if args.log_interval < 1:
        parser.error("--log-interval must be at least 1")
    # Settings build_tokenizer reads (as Megatron's tool sets them); rank 1 keeps it quiet.
    args.rank = 1
    args.make_vocab_size_divisible_by = 128
    args.tensor_model_parallel_size = 1
    args.vocab_extra_ids = 0
    args.vocab_size = int(args.vocab_size) if args.vocab_size is not None else None
    return args


def output_prefixes(args, output_prefix: str):
    level = "sentence" if args.split_sentences else "document"
    return {key: f"{output_prefix}_{key}_{level}" for key in args.json_keys}


class Partition:
    """Tokenises one input file into ``{output_prefix}_{key}_{level}`` with ``workers`` processes."""

    def __init__(self, args, workers: int) -> None:
        self.args = args
        self.workers = workers

    def process_json_file(self, input_file_name: str, output_prefix: str) -> None:
        from megatron.core.datasets.indexed_format import DType, IndexedDatasetBuilder

        args = self.args
        print("Opening", input_file_name)
        startup_start = time.time()
        encoder = Encoder(args)
        encoder.initializer()
        dtype = DType.optimal_dtype(Encoder.tokenizer.vocab_size)
        prefixes = output_prefixes(args, output_prefix)
        temporary = {key: _temporary_prefix(prefix) for key, prefix in prefixes.items()}
        builders = {key: IndexedDatasetBuilder(temporary[key] + ".bin", dtype=dtype) for key in prefixes}
        pool = None
        if self.workers > 1:
            pool = _context().Pool(self.workers, initializer=encoder.initializer)
        startup_end = time.time()
        print("Time to startup:", startup_end - startup_start)
        failure = None
        count = 0
        total_bytes_processed = 0
        proc_start = time.time()
        read_to_the_end = False
        try:
            with open_input(input_file_name) as fin:
                for result in self._encoded_blocks(fin, pool, encoder):
                    for key, (tokens, lengths, per_doc) in result.arrays.items():
                        builders[key].add_document_batch(tokens, lengths, per_doc)
                    for chars in result.chars_per_doc:
                        count += 1
                        total_bytes_processed += chars
                        if count % args.log_interval == 0:
                            elapsed = time.time() - proc_start
                            mbs = total_bytes_processed / elapsed / 1024 / 1024
                            print(f"Processed {count} documents", f"({count / elapsed} docs/s, {mbs} MB/s).",
                                  file=sys.stderr)
                    if result.failure is not None:
                        failure = result.failure
                        break
            read_to_the_end = failure is None
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            for key, builder in builders.items():
                builder.finalize(temporary[key] + ".idx")
            # Published only when complete; a failed (or interrupted) run leaves its output marked as partial.
            for key, prefix in prefixes.items():
                _publish(temporary[key], prefix if read_to_the_end else prefix + ".partial")
        if failure is not None:
            written = ", ".join(p + ".partial.bin/.idx" for p in prefixes.values())
            raise EncodeFailure(f"{input_file_name}:{failure.line_number}: {failure.message}. The {count} documents "
                                f"before it were written to {written}; no existing output was replaced.")

    def _encoded_blocks(self, fin, pool, encoder):
        """Encoded blocks in input order, at most ``2 * workers + 1`` blocks in flight."""
        blocks = read_line_blocks(fin, BLOCK_BYTES)
        if pool is None:
            for first_line, blob in blocks:
                yield encoder.encode_block(first_line, blob)
            return
        pending = []
        window = 2 * self.workers + 1
        for first_line, blob in blocks:
            pending.append(pool.apply_async(Encoder.encode_block_in_worker, (first_line, blob)))
            if len(pending) >= window:
                yield pending.pop(0).get()
        while pending:
            yield pending.pop(0).get()


def partition_file_names(args, file_id: int):
    """Megatron's names: ``<input>_<i><ext>`` next to the input (next to the output for a glob input)."""
    if glob.has_magic(args.input):
        base, extension = f"{args.output_prefix}_input", ".jsonl"
    else:
        base, extension = os.path.splitext(args.input)
        if extension == ".gz":  # partitions are written uncompressed
            base, extension = os.path.splitext(base)
    return {"partition": f"{base}_{file_id}{extension}", "output_prefix": f"{args.output_prefix}_{file_id}"}


def write_partitions(args, names) -> None:
    in_file_names = sorted(glob.glob(args.input))
    if not in_file_names:
        raise FileNotFoundError(f"--input {args.input} matches no file")
    partition_size = None
    if args.keep_sequential_samples:
        total = 0
        for name in in_file_names:
            with open_input(name) as fin:
                total += sum(1 for _ in fin)
        partition_size = max(1, math.ceil(total / args.partitions))
    outputs = [open(n["partition"], "wb") for n in names]
    try:
        index, line_count = 0, 0
        for name in in_file_names:
            with open_input(name) as fin:
                for line in fin:
                    outputs[index].write(line)
                    if partition_size is not None:
                        line_count += 1
                        if line_count % partition_size == 0:
                            index += 1
                    else:
                        index = (index + 1) % args.partitions
    finally:
        for f in outputs:
            f.close()


def _temporary_prefix(prefix: str) -> str:
    return f"{prefix}.tmp-{os.getpid()}"


def _publish(temporary: str, prefix: str) -> None:
    """Rename ``temporary.bin/.idx`` to ``prefix.bin/.idx`` (the .idx last: a reader never sees a new index
    next to an old .bin for long, and a crash before it leaves the old pair's index in place)."""
    for suffix in (".bin", ".idx"):
        os.replace(temporary + suffix, prefix + suffix)


def _run_partition(args, workers: int, input_file: str, output_prefix: str, errors) -> None:
    try:
        Partition(args, workers).process_json_file(input_file, output_prefix)
    except EncodeFailure as failure:
        errors.put(str(failure))


def _context():
    # fork starts workers in milliseconds; the parent has not used any tokenizer thread pool by then.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def main(argv=None) -> int:
    args = get_args(argv)
    # --workers is the parallelism: each process tokenises on one thread.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        if args.partitions == 1:
            if not os.path.isfile(args.input):
                raise FileNotFoundError(f"--input {args.input} does not exist")
            Partition(args, args.workers).process_json_file(args.input, args.output_prefix)
            return 0
        names = [partition_file_names(args, i) for i in range(args.partitions)]
        if all(os.path.isfile(n["partition"]) for n in names):
            print(f"Reusing the existing partition files {names[0]['partition']} ...")
        else:
            write_partitions(args, names)
        ctx = _context()
        errors = ctx.Queue()
        processes = [ctx.Process(target=_run_partition,
                                 args=(args, args.workers // args.partitions, n["partition"], n["output_prefix"], errors))
                     for n in names]
        for p in processes:
            p.start()
        for p in processes:
            p.join()
        failed = [p for p in processes if p.exitcode != 0]
        messages = []
        while not errors.empty():
            messages.append(errors.get())
        if messages or failed:
            raise EncodeFailure("; ".join(messages) or f"{len(failed)} partition process(es) failed")
        merge_partitions(args, names)
        return 0
    except (EncodeFailure, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


def merge_partitions(args, names) -> None:
    from megatron.core.datasets.indexed_format import IndexedDatasetBuilder, IndexReader, get_idx_path

    for key, prefix in output_prefixes(args, args.output_prefix).items():
        parts = [output_prefixes(args, n["output_prefix"])[key] for n in names]
        dtype = IndexReader(get_idx_path(parts[0]), multimodal=False).dtype
        temporary = _temporary_prefix(prefix)
        builder = IndexedDatasetBuilder(temporary + ".bin", dtype=dtype)
        for part in parts:
            builder.add_index(part)
        builder.finalize(temporary + ".idx")
        _publish(temporary, prefix)


if __name__ == "__main__":
    sys.exit(main())
