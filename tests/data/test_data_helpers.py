"""Index helpers: the NumPy implementation against hand-computed values (always), and the compiled
helpers_cpp module against the NumPy implementation on random inputs (when it is built)."""
import numpy
import pytest

from megatron.core.datasets import helpers, helpers_numpy

try:
    from megatron.core.datasets import helpers_cpp
except ImportError:
    helpers_cpp = None

needs_cpp = pytest.mark.skipif(
    helpers_cpp is None,
    reason="megatron.core.datasets.helpers_cpp is not built (pip install, or `python setup.py build_ext --inplace`)")

I32 = numpy.int32


# ------------------------------------------------------------------------------------- hand-computed values

def test_sample_idx_by_hand():
    # Documents 0, 1, 2 have 4, 2 and 5 tokens and are visited in the order 2, 0, 1: the token stream is
    # doc2[0..4] doc0[0..3] doc1[0..1] (11 tokens). Sample k starts at stream position k * seq_length.
    sizes = numpy.array([4, 2, 5], dtype=I32)
    doc_idx = numpy.array([2, 0, 1], dtype=I32)
    # seq_length 3 with the extra token: (11 - 1) // 3 = 3 samples starting at 0, 3, 6, 9.
    got = helpers_numpy.build_sample_idx_int32(sizes, doc_idx, 3, 1, 11, True, 1)
    assert got.tolist() == [[0, 0], [0, 3], [1, 1], [2, 0]] and got.dtype == numpy.int32
    # Without the extra token a sample ending at a document end leaves the next start one past its last
    # token: position 9 is recorded as (doc position 1, offset 4).
    got = helpers_numpy.build_sample_idx_int64(sizes, doc_idx, 3, 1, 11, True, 0)
    assert got.tolist() == [[0, 0], [0, 3], [1, 1], [1, 4]] and got.dtype == numpy.int64
    # Keeping the partial last sample (validation): ceil(10 / 4) = 3 samples; the third runs out of data
    # and ends at (last position, its length - 1).
    got = helpers_numpy.build_sample_idx_int32(sizes, doc_idx, 4, 1, 11, False, 1)
    assert got.tolist() == [[0, 0], [0, 4], [1, 3], [2, 1]]
    # Two epochs of a two-document dataset with an empty document in between.
    sizes = numpy.array([3, 0, 2], dtype=I32)
    doc_idx = numpy.array([0, 1, 2, 2, 1, 0], dtype=I32)  # stream: d0 d1 d2 d2 d1 d0 = 3+0+2+2+0+3 = 10
    got = helpers_numpy.build_sample_idx_int32(sizes, doc_idx, 2, 2, 5, True, 1)
    assert got.tolist() == [[0, 0], [0, 2], [2, 1], [3, 1], [5, 1]]


def test_blending_indices_by_hand():
    dataset_index = numpy.zeros(10, dtype=numpy.int16)
    sample_index = numpy.zeros(10, dtype=numpy.int64)
    helpers_numpy.build_blending_indices(dataset_index, sample_index, numpy.array([0.5, 0.3, 0.2]), 3, 10, False)
    assert dataset_index.tolist() == [0, 1, 2, 0, 1, 0, 2, 0, 1, 0]
    assert sample_index.tolist() == [0, 0, 0, 1, 1, 2, 1, 3, 2, 4]

    dataset_index = numpy.zeros(3, dtype=numpy.int16)
    sample_index = numpy.zeros(3, dtype=numpy.int64)
    helpers_numpy.build_exhaustive_blending_indices(dataset_index, sample_index, numpy.array([2, 1]), 2)
    assert dataset_index.tolist() == [0, 1, 0] and sample_index.tolist() == [0, 0, 1]


def test_blending_proportions_follow_the_greedy_rule():
    weights = numpy.array([0.6, 0.25, 0.15])
    size = 2000
    dataset_index = numpy.zeros(size, dtype=numpy.int16)
    sample_index = numpy.zeros(size, dtype=numpy.int64)
    helpers.build_blending_indices(dataset_index, sample_index, weights, 3, size, False)
    # Largest-deficit assignment keeps every prefix within one sample of its target share.
    counts = numpy.zeros(3)
    for position, d in enumerate(dataset_index.tolist(), start=1):
        counts[d] += 1
        assert numpy.all(numpy.abs(counts - weights * position) <= 1.0 + 1e-9)
    # Each dataset's samples are taken in order 0, 1, 2, ...
    for d in range(3):
        assert sample_index[dataset_index == d].tolist() == list(range(int((dataset_index == d).sum())))


def test_mersenne_twisters_match_the_cpp_standard():
    # The C++ standard fixes the 10000th output of default-seeded engines ([rand.predef]).
    rng = helpers_numpy._MT32(5489)
    for _ in range(9999):
        rng()
    assert rng() == 4123659995
    assert int(helpers_numpy.mt19937_64(5489, 10000)[-1]) == 9981545732273789042


def test_bert_mapping_by_hand():
    # Documents: sentences [0, 3), [3, 4) and [4, 7).
    docs = numpy.array([0, 3, 4, 7], dtype=numpy.int64)
    sizes = numpy.array([3, 4, 2, 5, 1, 1, 6], dtype=I32)
    # max length 6, two sentences minimum, no short samples: doc 0 becomes one sample (its second
    # sentence reaches 6 tokens but only one sentence would remain); doc 1 has a single sentence; doc 2
    # becomes one sample.
    got = helpers_numpy.build_mapping(docs, sizes, 1, 100, 6, 0.0, 7, False, 2)
    assert got.dtype == numpy.uint32
    assert sorted(map(tuple, got.tolist())) == [(0, 3, 6), (4, 7, 6)]
    first_draw = int(helpers_numpy.mt19937_64(7 + 1, 1)[0])  # Fisher-Yates: swap rows 1 and (draw % 2)
    expected_first = (0, 3, 6) if first_draw % 2 == 1 else (4, 7, 6)
    assert tuple(got[0].tolist()) == expected_first
    # Epochs repeat until max_num_samples is reached at an epoch boundary.
    assert len(helpers_numpy.build_mapping(docs, sizes, 3, 3, 6, 0.0, 7, False, 2)) == 4
    # A document with a sentence over 512 tokens is skipped.
    long_sizes = sizes.copy()
    long_sizes[5] = 513
    assert sorted(map(tuple, helpers_numpy.build_mapping(docs, long_sizes, 1, 100, 6, 0.0, 7, False, 2).tolist())) \
        == [(0, 3, 6)]


def test_blocks_mapping_by_hand():
    docs = numpy.array([0, 3, 4, 7], dtype=numpy.int64)
    sizes = numpy.array([3, 4, 2, 5, 1, 1, 6], dtype=I32)
    titles = numpy.array([1, 0, 2], dtype=I32)
    got = helpers_numpy.build_blocks_mapping(docs, sizes, titles, 1, 100, 6, 3, False, False)
    assert sorted(map(tuple, got.tolist())) == [(0, 3, 0, 0), (4, 7, 2, 1)]
    got = helpers_numpy.build_blocks_mapping(docs, sizes, titles, 1, 100, 6, 3, False, True)
    assert sorted(map(tuple, got.tolist())) == [(0, 2, 0, 0), (2, 3, 0, 1), (3, 4, 1, 2), (4, 7, 2, 3)]


def test_shim_checks_dtypes_and_picks_int32():
    sizes = numpy.array([4, 2, 5], dtype=I32)
    doc_idx = numpy.array([2, 0, 1], dtype=I32)
    assert helpers.build_sample_idx(sizes, doc_idx, 3, 1, 11).dtype == numpy.int32
    with pytest.raises(TypeError, match="int32 sizes"):
        helpers.build_sample_idx(sizes.astype(numpy.int64), doc_idx, 3, 1, 11)
    assert helpers.IMPLEMENTATION.startswith("C++" if helpers_cpp is not None else "NumPy")


# --------------------------------------------------------------------------------- C++ == NumPy, random

@needs_cpp
def test_cpp_sample_idx_equals_numpy_on_random_inputs():
    rng = numpy.random.default_rng(1)
    for _ in range(300):
        num_docs = int(rng.integers(1, 30))
        sizes = rng.integers(0, 12, size=num_docs).astype(I32)
        sizes[0] += 2
        epochs = int(rng.integers(1, 4))
        doc_idx = numpy.tile(numpy.arange(num_docs, dtype=I32), epochs)
        rng.shuffle(doc_idx)
        args = (sizes, doc_idx, int(rng.integers(2, 9)), epochs, int(sizes.sum()), bool(rng.integers(0, 2)),
                int(rng.integers(0, 2)))
        for name in ("build_sample_idx_int32", "build_sample_idx_int64"):
            expected = getattr(helpers_numpy, name)(*args)
            got = getattr(helpers_cpp, name)(*args)
            assert got.dtype == expected.dtype and numpy.array_equal(got, expected), args


@needs_cpp
def test_cpp_blending_equals_numpy_on_random_inputs():
    rng = numpy.random.default_rng(2)
    for _ in range(60):
        k = int(rng.integers(1, 7))
        weights = rng.random(k)
        weights /= weights.sum()
        size = int(rng.integers(1, 700))
        out = [(numpy.zeros(size, numpy.int16), numpy.zeros(size, numpy.int64)) for _ in range(2)]
        helpers_cpp.build_blending_indices(*out[0], weights, k, size, False)
        helpers_numpy.build_blending_indices(*out[1], weights, k, size, False)
        assert numpy.array_equal(out[0][0], out[1][0]) and numpy.array_equal(out[0][1], out[1][1])
        sizes = rng.integers(0, 60, size=k).astype(numpy.int64)
        sizes[0] += 1
        total = int(sizes.sum())
        out = [(numpy.zeros(total, numpy.int16), numpy.zeros(total, numpy.int64)) for _ in range(2)]
        helpers_cpp.build_exhaustive_blending_indices(*out[0], sizes, k)
        helpers_numpy.build_exhaustive_blending_indices(*out[1], sizes, k)
        assert numpy.array_equal(out[0][0], out[1][0]) and numpy.array_equal(out[0][1], out[1][1])
    with pytest.raises(TypeError):  # a wrong output dtype must not be silently converted (and lost)
        helpers_cpp.build_blending_indices(numpy.zeros(3, numpy.int64), numpy.zeros(3, numpy.int64),
                                           numpy.array([1.0]), 1, 3, False)


@needs_cpp
def test_cpp_mappings_equal_numpy_on_random_inputs():
    rng = numpy.random.default_rng(3)
    for trial in range(60):
        num_docs = int(rng.integers(1, 40))
        docs = numpy.concatenate([[0], numpy.cumsum(rng.integers(0, 6, size=num_docs))]).astype(numpy.int64)
        sizes = rng.integers(1, 60, size=int(docs[-1])).astype(I32)
        if trial % 5 == 0 and len(sizes):
            sizes[int(rng.integers(0, len(sizes)))] = 600
        epochs, max_samples = int(rng.integers(1, 4)), int(rng.integers(1, 200))
        max_len, seed = int(rng.integers(5, 100)), int(rng.integers(1, 1000))
        prob = float(rng.choice([0.0, 0.1, 0.3, 1.0]))
        min_sent = int(rng.integers(1, 3))
        expected = helpers_numpy.build_mapping(docs, sizes, epochs, max_samples, max_len, prob, seed, False, min_sent)
        got = helpers_cpp.build_mapping(docs, sizes, epochs, max_samples, max_len, prob, seed, False, min_sent)
        assert got.dtype == expected.dtype and numpy.array_equal(got, expected)
        titles = rng.integers(0, 5, size=num_docs).astype(I32)
        one_sent = bool(trial % 2)
        expected = helpers_numpy.build_blocks_mapping(docs, sizes, titles, epochs, max_samples, max_len, seed,
                                                      False, one_sent)
        got = helpers_cpp.build_blocks_mapping(docs, sizes, titles, epochs, max_samples, max_len, seed, False, one_sent)
        assert got.dtype == expected.dtype and numpy.array_equal(got, expected)


def test_setup_py_installs_without_a_working_compiler(tmp_path):
    """The compiled helpers are optional: a failing compiler leaves a notice, not a failed install."""
    import os
    import subprocess
    import sys

    from helpers.data_support import REPO

    env = dict(os.environ, CC="/bin/false", CXX="/bin/false")
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(tmp_path / "lib"),
                           "--build-temp", str(tmp_path / "tmp")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "NOTICE: megatron.core.datasets.helpers_cpp was not built" in done.stderr
    assert not list((tmp_path / "lib").rglob("helpers_cpp*"))
