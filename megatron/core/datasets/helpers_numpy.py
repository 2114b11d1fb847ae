"""NumPy implementation of the index builders in helpers.cpp, used when the compiled module is missing.

Every function returns the same array, element for element and dtype for dtype, as its C++ twin
(tests/data/test_data_helpers.py checks this on random inputs). The BERT/ICT mappings reproduce the C++
random streams exactly: ``std::mt19937(seed)`` is NumPy's legacy ``RandomState(seed)`` bit generator, and
``std::mt19937_64`` is implemented below.
"""
from __future__ import annotations

import math
from typing import List

import numpy

_LONG_SENTENCE_LEN = 512


# --------------------------------------------------------------------------------------------- blending


def build_blending_indices(dataset_index: numpy.ndarray, dataset_sample_index: numpy.ndarray,
                           weights: numpy.ndarray, num_datasets: int, size: int, verbose: bool) -> None:
    """Fill ``dataset_index``/``dataset_sample_index`` in place with the greedy largest-deficit blend."""
    w = [float(x) for x in numpy.asarray(weights, dtype=numpy.float64)[:num_datasets]]
    taken = [0] * num_datasets
    chosen = numpy.empty(size, dtype=numpy.int16)
    sample = numpy.empty(size, dtype=numpy.int64)
    datasets = range(1, num_datasets)
    for s in range(size):
        position = float(max(s, 1))
        best, best_error = 0, w[0] * position - taken[0]
        for d in datasets:
            error = w[d] * position - taken[d]
            if error > best_error:
                best, best_error = d, error
        chosen[s] = best
        sample[s] = taken[best]
        taken[best] += 1
    dataset_index[:size] = chosen
    dataset_sample_index[:size] = sample
    if verbose:
        print(" > sample ratios:")
        for d in range(num_datasets):
            print(f"   dataset {d}, input: {w[d]}, achieved: {taken[d] / size}")


def build_exhaustive_blending_indices(dataset_index: numpy.ndarray, dataset_sample_index: numpy.ndarray,
                                      sizes: numpy.ndarray, num_datasets: int) -> None:
    """Greedy blend that uses dataset ``d`` exactly ``sizes[d]`` times."""
    n = [int(x) for x in numpy.asarray(sizes)[:num_datasets]]
    total = sum(n)
    share = [x / float(total) for x in n]
    taken = [0] * num_datasets
    for s in range(total):
        position = float(max(s, 1))
        best, best_error = -1, -numpy.finfo(numpy.float64).max
        for d in range(num_datasets):
            if taken[d] >= n[d]:
                continue
            error = share[d] * position - taken[d]
            if error > best_error:
                best, best_error = d, error
        dataset_index[s] = best
        dataset_sample_index[s] = taken[best]
        taken[best] += 1


# ------------------------------------------------------------------------------------------------- GPT


def _build_sample_idx(sizes: numpy.ndarray, document_idx: numpy.ndarray, seq_length: int, num_epochs: int,
                      tokens_per_epoch: int, drop_last_partial_sequence: bool, add_extra_token_to_sequence: int,
                      dtype) -> numpy.ndarray:
    """Vectorised: sample k starts at global token position k * seq_length of the document stream."""
    if seq_length <= 1 or num_epochs <= 0 or tokens_per_epoch <= 1:
        raise ValueError("build_sample_idx: need seq_length > 1, num_epochs > 0 and tokens_per_epoch > 1")
    if len(document_idx) == 0:
        raise ValueError("build_sample_idx: document_idx is empty")
    add = int(add_extra_token_to_sequence)
    usable = int(num_epochs) * int(tokens_per_epoch) - add
    if drop_last_partial_sequence:
        num_samples = usable // seq_length
    else:
        # Single-precision like the C++ helper.
        num_samples = int(math.ceil(numpy.float32(usable) / numpy.float32(seq_length)))
    doc_lengths = numpy.asarray(sizes)[numpy.asarray(document_idx)].astype(numpy.int64)
    ends = numpy.cumsum(doc_lengths)
    total_tokens = int(ends[-1])
    starts = numpy.arange(1, num_samples + 1, dtype=numpy.int64) * seq_length
    # With the extra token, a start sits on the token at that position (end-exclusive search). Without
    # it, a sample that ends exactly at a document end leaves the next start one past that document's
    # last token, which the C++ loop records as (document, its length): end-inclusive search.
    within = starts <= total_tokens - add
    positions = numpy.searchsorted(ends, starts[within], side="right" if add else "left")
    rows = numpy.zeros((num_samples + 1, 2), dtype=numpy.int64)
    rows[1:][within, 0] = positions
    rows[1:][within, 1] = starts[within] - (ends[positions] - doc_lengths[positions])
    # A partial final sample (drop_last_partial_sequence=False) points at the end of the data.
    rows[1:][~within, 0] = len(document_idx) - 1
    rows[1:][~within, 1] = int(doc_lengths[-1]) - add
    return rows.astype(dtype)


def build_sample_idx_int32(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                           drop_last_partial_sequence=True, add_extra_token_to_sequence=1) -> numpy.ndarray:
    return _build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                             drop_last_partial_sequence, add_extra_token_to_sequence, numpy.int32)


def build_sample_idx_int64(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                           drop_last_partial_sequence=True, add_extra_token_to_sequence=1) -> numpy.ndarray:
    return _build_sample_idx(sizes, document_idx, seq_length, num_epochs, tokens_per_epoch,
                             drop_last_partial_sequence, add_extra_token_to_sequence, numpy.int64)


# -------------------------------------------------------------------------------------- random streams


class _MT32:
    """The 32-bit outputs of std::mt19937(seed), drawn one at a time (NumPy's legacy seeding is identical)."""

    def __init__(self, seed: int) -> None:
        self._bits = numpy.random.RandomState(seed & 0xFFFFFFFF)._bit_generator
        self._block: List[int] = []
        self._next = 0

    def __call__(self) -> int:
        if self._next == len(self._block):
            self._block = self._bits.random_raw(4096).tolist()
            self._next = 0
        value = self._block[self._next]
        self._next += 1
        return value


_MASK64 = (1 << 64) - 1


def mt19937_64(seed: int, count: int) -> numpy.ndarray:
    """The first ``count`` outputs of C++ ``std::mt19937_64(seed)`` as uint64 (vectorised per block)."""
    nn, mm = 312, 156
    matrix_a = numpy.uint64(0xB5026F5AA96619E9)
    upper, lower = numpy.uint64(0xFFFFFFFF80000000), numpy.uint64(0x7FFFFFFF)
    one = numpy.uint64(1)
    state = [seed & _MASK64]
    for i in range(1, nn):
        prev = state[-1]
        state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & _MASK64)
    mt = numpy.array(state, dtype=numpy.uint64)

    def twist(x, partner):
        return partner ^ (x >> one) ^ numpy.where((x & one) == one, matrix_a, numpy.uint64(0))

    out = numpy.empty(((count + nn - 1) // nn) * nn, dtype=numpy.uint64)
    for block in range(len(out) // nn):
        old = mt.copy()
        # Entries below nn - mm only read old state; the rest read entries rewritten just before them.
        x = (old[:nn - mm] & upper) | (old[1:nn - mm + 1] & lower)
        mt[:nn - mm] = twist(x, old[mm:])
        x = (old[nn - mm:nn - 1] & upper) | (old[nn - mm + 1:nn] & lower)
        mt[nn - mm:nn - 1] = twist(x, mt[:mm - 1])
        x = (old[nn - 1:] & upper) | (mt[:1] & lower)
        mt[nn - 1:] = twist(x, mt[mm - 1:mm])
        y = mt.copy()
        y ^= (y >> numpy.uint64(29)) & numpy.uint64(0x5555555555555555)
        y ^= (y << numpy.uint64(17)) & numpy.uint64(0x71D67FFFEDA60000)
        y ^= (y << numpy.uint64(37)) & numpy.uint64(0xFFF7EEE000000000)
        y ^= y >> numpy.uint64(43)
        out[block * nn:(block + 1) * nn] = y
    return out[:count]


def _shuffle_rows(rows: numpy.ndarray, seed: int) -> numpy.ndarray:
    """Fisher-Yates over rows driven by mt19937_64(seed + 1), as the C++ helpers shuffle."""
    n = rows.shape[0]
    if n < 2:
        return rows
    draws = mt19937_64(seed + 1, n - 1)
    bounds = numpy.arange(n, 1, -1, dtype=numpy.uint64)  # i + 1 for i = n-1 .. 1
    js = (draws % bounds).tolist()
    order = list(range(n))
    for step, i in enumerate(range(n - 1, 0, -1)):
        j = js[step]
        order[i], order[j] = order[j], order[i]
    return rows[numpy.asarray(order, dtype=numpy.int64)]


# ------------------------------------------------------------------------------------------ BERT / ICT


def _has_long_sentence(sizes, first: int, last: int) -> bool:
    return bool(last > first and int(numpy.max(sizes[first:last])) > _LONG_SENTENCE_LEN)


def build_mapping(docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, verbose,
                  min_num_sent) -> numpy.ndarray:
    """Rows (first sentence, end sentence exclusive, target length) of BERT samples, shuffled."""
    if num_epochs <= 0 or max_seq_length <= 1 or not 0.0 <= short_seq_prob <= 1.0 or seed <= 0:
        raise ValueError("build_mapping: need num_epochs > 0, max_seq_length > 1, 0 <= short_seq_prob <= 1, seed > 0")
    docs = numpy.asarray(docs, dtype=numpy.int64)
    sizes = numpy.asarray(sizes, dtype=numpy.int32)
    # C++ round(): halves away from zero.
    ratio = int(math.floor(1.0 / short_seq_prob + 0.5)) if short_seq_prob > 0 else 0
    rng = _MT32(seed)

    def target_length() -> int:
        if ratio == 0:
            return max_seq_length
        draw = rng()
        if draw % ratio == 0:
            return 2 + draw % (max_seq_length - 1)
        return max_seq_length

    bounds = docs.tolist()
    lengths = sizes.tolist()
    long_docs: List[bool] = []  # per document, filled during the first epoch
    rows: List[int] = []
    for epoch in range(num_epochs):
        if len(rows) // 3 >= max_num_samples:
            break
        before = len(rows)
        for doc in range(len(bounds) - 1):
            first, last = bounds[doc], bounds[doc + 1]
            count = last - first
            if epoch == 0:
                long_docs.append(count > 1 and _has_long_sentence(sizes, first, last))
            if count < min_num_sent or long_docs[doc]:
                continue
            start, remaining, length, used = first, count, 0, 0
            target = target_length()
            for s in range(first, last):
                length += lengths[s]
                used += 1
                remaining -= 1
                if (length >= target and remaining > 1 and used >= min_num_sent) or remaining == 0:
                    rows.extend((start, s + 1, target))
                    start, length, used = s + 1, 0, 0
                    target = target_length()
        if len(rows) == before:
            break
    dtype = numpy.uint64 if sizes.size > numpy.iinfo(numpy.uint32).max else numpy.uint32
    table = numpy.asarray(rows, dtype=dtype).reshape(-1, 3)
    if verbose:
        print(f"    will create mapping for {table.shape[0]} samples")
    return _shuffle_rows(table, seed)


def build_blocks_mapping(docs, sizes, titles_sizes, num_epochs, max_num_samples, max_seq_length, seed, verbose,
                         use_one_sent_blocks) -> numpy.ndarray:
    """Rows (first sentence, end sentence exclusive, document, block id) of ICT blocks, shuffled."""
    if num_epochs <= 0 or max_seq_length <= 1 or seed <= 0:
        raise ValueError("build_blocks_mapping: need num_epochs > 0, max_seq_length > 1 and seed > 0")
    docs = numpy.asarray(docs, dtype=numpy.int64)
    sizes = numpy.asarray(sizes, dtype=numpy.int32)
    titles = numpy.asarray(titles_sizes, dtype=numpy.int32).tolist()
    min_num_sent = 1 if use_one_sent_blocks else 2
    bounds, lengths = docs.tolist(), sizes.tolist()
    rows: List[int] = []
    for _epoch in range(num_epochs):
        if len(rows) // 4 >= max_num_samples:
            break
        before = len(rows)
        block_id = 0
        for doc in range(len(bounds) - 1):
            first, last = bounds[doc], bounds[doc + 1]
            remaining = last - first
            target = max_seq_length - titles[doc]
            if remaining < min_num_sent or _has_long_sentence(sizes, first, last):
                continue
            start, length, used = first, 0, 0
            for s in range(first, last):
                length += lengths[s]
                used += 1
                remaining -= 1
                if (length >= target and remaining >= min_num_sent and used >= min_num_sent) or remaining == 0:
                    rows.extend((start, s + 1, doc, block_id))
                    block_id += 1
                    start, length, used = s + 1, 0, 0
        if len(rows) == before:
            break
    dtype = numpy.uint64 if sizes.size > numpy.iinfo(numpy.uint32).max else numpy.uint32
    return _shuffle_rows(numpy.asarray(rows, dtype=dtype).reshape(-1, 4), seed)
