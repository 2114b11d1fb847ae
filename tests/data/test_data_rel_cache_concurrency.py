"""Concurrency of the dataset index cache (megatron/core/datasets/index_cache.py): several processes that build
the same GPT dataset's index cache at the same moment, a builder SIGKILLed in the middle of publishing, and a
truncated cache file. The cache files must always end up complete and byte-identical to a cache built alone."""
import logging
import multiprocessing
import os
import signal
import time

import numpy
import pytest

from helpers.data_support import tokenizer_args, write_indexed

NUM_DOCS, NUM_SAMPLES, SEQ = 3000, 4000, 16
NUM_PROCESSES = 4
BUILD_DELAY = 0.3  # seconds added to each build so that the processes' builds really overlap
STALE_ENV = "MEGATRON_INDEX_CACHE_STALE_SECONDS"


def _dataset(prefix, cache_dir):
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split
    from megatron.tokenizer import build_tokenizer
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend=([prefix], None), split="1,0,0",
                              tokenizer=build_tokenizer(tokenizer_args("NullTokenizer", vocab_size=5000)),
                              reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                              path_to_cache=cache_dir)
    return GPTDataset(IndexedDataset(prefix), prefix, numpy.arange(NUM_DOCS, dtype=numpy.int32), NUM_SAMPLES,
                      Split.train, config)


def _slow_builds(delay):
    from megatron.core.datasets.gpt_dataset import GPTDataset
    original = GPTDataset._build_indices

    def slow(self):
        time.sleep(delay)
        return original(self)
    GPTDataset._build_indices = slow


def _racer(index, prefix, rounds, barrier, results):
    """One of NUM_PROCESSES processes: for each (cache dir, lock kept?) round, wait for all, then build."""
    _slow_builds(BUILD_DELAY)
    for cache_dir, keep_lock in rounds:
        if keep_lock:
            os.environ.pop(STALE_ENV, None)
        else:
            os.environ[STALE_ENV] = "0"  # every waiter breaks the lock at once: truly concurrent builders
        barrier.wait(timeout=60)
        start = time.time()
        dataset = _dataset(prefix, cache_dir)
        results.put((index, cache_dir, bool(dataset.built_anew_on_cache_miss), start, time.time(),
                     dataset[7]["tokens"].tolist()))


def _killed_builder(prefix, cache_dir, ready_path):
    """Takes the lock, writes the first array, starts the second, then waits to be SIGKILLed."""
    from megatron.core.datasets import index_cache
    original = index_cache._write_atomically
    calls = []

    def stalled(path, write):
        calls.append(path)
        if len(calls) == 1:
            return original(path, write)
        import socket
        with open(f"{path}.tmp-{socket.gethostname()}-{os.getpid()}", "wb") as f:
            f.write(b"\x93NUMPY partial")  # a half-written temporary file
        open(ready_path, "w").close()
        time.sleep(120)
    index_cache._write_atomically = stalled
    _dataset(prefix, cache_dir)


def _cache_files(directory):
    return {name: open(os.path.join(directory, name), "rb").read() for name in sorted(os.listdir(directory))}


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    rng = numpy.random.RandomState(7)
    prefix = str(tmp_path_factory.mktemp("rel_cache") / "docs_text_document")
    write_indexed(prefix, [[list(rng.randint(1, 4000, size=int(n)))] for n in rng.randint(2, 40, size=NUM_DOCS)])
    return prefix


@pytest.fixture(scope="module")
def reference(prefix, tmp_path_factory):
    """The cache built by one process alone."""
    directory = str(tmp_path_factory.mktemp("rel_cache_alone"))
    dataset = _dataset(prefix, directory)
    assert dataset.built_anew_on_cache_miss
    files = _cache_files(directory)
    assert sorted(n.split("-", 1)[1] for n in files) == ["GPTDataset-train-description.txt",
                                                         "GPTDataset-train-document_index.npy",
                                                         "GPTDataset-train-sample_index.npy",
                                                         "GPTDataset-train-shuffle_index.npy"]
    return files, dataset[7]["tokens"].tolist()


@pytest.mark.timeout(180)
def test_data_rel_concurrent_builders_and_a_killed_one(prefix, reference, tmp_path):
    expected_files, expected_sample = reference
    ctx = multiprocessing.get_context("spawn")
    # A builder killed while publishing: it holds the lock, one array is written, one temporary file is half done.
    killed_dir = str(tmp_path / "killed")
    ready = str(tmp_path / "builder_ready")
    victim = ctx.Process(target=_killed_builder, args=(prefix, killed_dir, ready))
    victim.start()
    try:
        deadline = time.time() + 90
        while not os.path.exists(ready):
            assert victim.is_alive() and time.time() < deadline, "the builder to be killed never got going"
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
    finally:
        victim.join(30)
    assert victim.exitcode == -signal.SIGKILL
    debris = os.listdir(killed_dir)
    assert any(n.endswith("-lock") for n in debris) and any(".tmp-" in n for n in debris), debris
    assert not any(n.endswith("description.txt") for n in debris), debris

    # Rounds: two with the lock honoured, one where every process breaks it (all build and publish at once), and
    # the killed builder's directory, whose dead lock and partial files the racers must get past.
    rounds = [(str(tmp_path / "r0"), True), (str(tmp_path / "r1"), True), (str(tmp_path / "r2"), False),
              (killed_dir, True)]
    barrier, results = ctx.Barrier(NUM_PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_racer, args=(i, prefix, rounds, barrier, results)) for i in range(NUM_PROCESSES)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=150) for _ in range(NUM_PROCESSES * len(rounds))]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0] * NUM_PROCESSES

    for cache_dir, keep_lock in rounds:
        mine = [g for g in got if g[1] == cache_dir]
        assert len(mine) == NUM_PROCESSES
        builders = sum(g[2] for g in mine)
        # They overlapped: every process started before the first one finished.
        assert max(g[3] for g in mine) < min(g[4] for g in mine), cache_dir
        if keep_lock:
            assert builders == 1, f"{cache_dir}: {builders} builders under the lock"
        else:
            assert builders >= 2, f"{cache_dir}: the lock was broken but only {builders} process built"
        for g in mine:
            assert g[5] == expected_sample, f"{cache_dir}: process {g[0]} read a different sample"
        files = _cache_files(cache_dir)
        leftovers = [n for n in files if ".tmp-" in n or (keep_lock and n.endswith("-lock"))]
        assert not leftovers, f"{cache_dir}: {leftovers}"
        files = {n: b for n, b in files.items() if not n.endswith("-lock")}
        assert files == expected_files, f"{cache_dir}: the cache differs from one built alone"
        # A later load reads it without building.
        later = _dataset(prefix, cache_dir)
        assert not later.built_anew_on_cache_miss and later[7]["tokens"].tolist() == expected_sample
    print(f"REL_SUMMARY cache: {len(rounds)} rounds x {NUM_PROCESSES} processes, builders per round "
          f"{[sum(g[2] for g in got if g[1] == d) for d, _ in rounds]}, all caches byte-identical")


def test_data_rel_truncated_cache_file_is_rebuilt(prefix, reference, tmp_path, caplog):
    expected_files, expected_sample = reference
    for name, data in expected_files.items():
        (tmp_path / name).write_bytes(data)
    truncated = next(n for n in expected_files if n.endswith("sample_index.npy"))
    (tmp_path / truncated).write_bytes(expected_files[truncated][:len(expected_files[truncated]) // 2])
    with caplog.at_level(logging.WARNING):
        dataset = _dataset(prefix, str(tmp_path))
    assert dataset.built_anew_on_cache_miss
    assert str(tmp_path / truncated) in caplog.text and "corrupt or truncated" in caplog.text, caplog.text
    assert dataset[7]["tokens"].tolist() == expected_sample
    assert _cache_files(str(tmp_path)) == expected_files
    # A file cut inside its header is caught as well.
    (tmp_path / truncated).write_bytes(expected_files[truncated][:20])
    assert _dataset(prefix, str(tmp_path)).built_anew_on_cache_miss
    assert _cache_files(str(tmp_path)) == expected_files
