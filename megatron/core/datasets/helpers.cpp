// Index builders for the GPT, BERT/ICT and blended datasets, exposed as
// megatron.core.datasets.helpers_cpp. Compiled once by `pip install` (setup.py); never at run time.
// megatron/core/datasets/helpers_numpy.py implements the same functions, array for array, and is used
// when this module was not built.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// C-contiguous arrays only: the raw pointers below assume it.
template <typename T>
using Array = py::array_t<T, py::array::c_style>;

// Documents holding a sentence longer than this are skipped by the BERT/ICT mappings.
constexpr int32_t kLongSentenceLen = 512;

// Hand a std::vector's storage to NumPy as a C-contiguous [rows, cols] array without copying.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& values, int64_t rows, int64_t cols) {
  auto* owned = new std::vector<T>(std::move(values));
  py::capsule release(owned, [](void* p) { delete reinterpret_cast<std::vector<T>*>(p); });
  const auto item = static_cast<py::ssize_t>(sizeof(T));
  return py::array_t<T>({static_cast<py::ssize_t>(rows), static_cast<py::ssize_t>(cols)},
                        {static_cast<py::ssize_t>(cols) * item, item}, owned->data(), release);
}

void require(bool condition, const std::string& message) {
  if (!condition) throw std::invalid_argument(message);
}

// ------------------------------------------------------------------------------------------- blending

// Greedy blending: position s goes to the dataset whose share lags furthest behind its weight,
// i.e. argmax_d(weights[d] * max(s, 1) - taken[d]); ties go to the lowest index.
void build_blending_indices(Array<int16_t> dataset_index, Array<int64_t> dataset_sample_index,
                            Array<double> weights, int32_t num_datasets, int64_t size, bool verbose) {
  require(num_datasets > 0, "build_blending_indices: num_datasets must be positive");
  require(dataset_index.size() >= size && dataset_sample_index.size() >= size,
          "build_blending_indices: output arrays are shorter than size");
  require(weights.size() >= num_datasets, "build_blending_indices: fewer weights than datasets");
  int16_t* out_dataset = dataset_index.mutable_data();
  int64_t* out_sample = dataset_sample_index.mutable_data();
  const double* w = weights.data();
  std::vector<int64_t> taken(num_datasets, 0);
  {
    py::gil_scoped_release no_gil;
    for (int64_t s = 0; s < size; ++s) {
      const double position = std::max(static_cast<double>(s), 1.0);
      int32_t best = 0;
      double best_error = w[0] * position - static_cast<double>(taken[0]);
      for (int32_t d = 1; d < num_datasets; ++d) {
        const double error = w[d] * position - static_cast<double>(taken[d]);
        if (error > best_error) {
          best_error = error;
          best = d;
        }
      }
      out_dataset[s] = static_cast<int16_t>(best);
      out_sample[s] = taken[best];
      ++taken[best];
    }
  }
  if (verbose) {
    std::cout << " > sample ratios:" << std::endl;
    for (int32_t d = 0; d < num_datasets; ++d) {
      std::cout << "   dataset " << d << ", input: " << w[d]
                << ", achieved: " << static_cast<double>(taken[d]) / static_cast<double>(size) << std::endl;
    }
  }
}

// Same greedy rule, but dataset d is used exactly sizes[d] times (weights are the size shares).
void build_exhaustive_blending_indices(Array<int16_t> dataset_index, Array<int64_t> dataset_sample_index,
                                       Array<int64_t> sizes, int32_t num_datasets) {
  require(num_datasets > 0, "build_exhaustive_blending_indices: num_datasets must be positive");
  const int64_t* n = sizes.data();
  int64_t total = 0;
  for (int32_t d = 0; d < num_datasets; ++d) total += n[d];
  require(dataset_index.size() >= total && dataset_sample_index.size() >= total,
          "build_exhaustive_blending_indices: output arrays are shorter than sum(sizes)");
  int16_t* out_dataset = dataset_index.mutable_data();
  int64_t* out_sample = dataset_sample_index.mutable_data();
  std::vector<double> share(num_datasets);
  for (int32_t d = 0; d < num_datasets; ++d) share[d] = n[d] / static_cast<double>(total);
  std::vector<int64_t> taken(num_datasets, 0);
  py::gil_scoped_release no_gil;
  for (int64_t s = 0; s < total; ++s) {
    const double position = std::max(static_cast<double>(s), 1.0);
    int32_t best = -1;
    double best_error = std::numeric_limits<double>::lowest();
    for (int32_t d = 0; d < num_datasets; ++d) {
      if (taken[d] >= n[d]) continue;  // spent
      const double error = share[d] * position - static_cast<double>(taken[d]);
      if (error > best_error) {
        best_error = error;
        best = d;
      }
    }
    out_dataset[s] = static_cast<int16_t>(best);
    out_sample[s] = taken[best];
    ++taken[best];
  }
}

// --------------------------------------------------------------------------------------------- GPT

// Row k of the result is (position in document_idx, token offset) where sample k starts. A sample
// spans seq_length + add_extra_token tokens; the next sample starts add_extra_token tokens before the
// previous one ended, so consecutive samples share that many tokens.
template <typename T>
py::array_t<T> build_sample_idx(Array<int32_t> sizes_, Array<int32_t> document_idx_, int32_t seq_length,
                                int32_t num_epochs, int64_t tokens_per_epoch, bool drop_last_partial_sequence = true,
                                int add_extra_token_to_sequence = 1) {
  require(seq_length > 1, "build_sample_idx: seq_length must be > 1");
  require(num_epochs > 0, "build_sample_idx: num_epochs must be > 0");
  require(tokens_per_epoch > 1, "build_sample_idx: tokens_per_epoch must be > 1");
  const int32_t* sizes = sizes_.data();
  const int32_t* document_idx = document_idx_.data();
  const int64_t num_docs = document_idx_.size();
  require(num_docs > 0, "build_sample_idx: document_idx is empty");
  const int64_t usable = static_cast<int64_t>(num_epochs) * tokens_per_epoch - add_extra_token_to_sequence;
  int64_t num_samples;
  if (drop_last_partial_sequence) {
    num_samples = usable / seq_length;
  } else {
    // Single-precision on purpose: this is the rounding megatron-core's helper performs.
    num_samples = static_cast<int64_t>(std::ceil(static_cast<float>(usable) / seq_length));
  }
  std::vector<T> rows(2 * (num_samples + 1));
  {
    py::gil_scoped_release no_gil;
    int64_t doc_pos = 0;   // position in document_idx
    int64_t offset = 0;    // token offset inside that document
    rows[0] = 0;
    rows[1] = 0;
    for (int64_t k = 1; k <= num_samples; ++k) {
      int64_t need = static_cast<int64_t>(seq_length) + add_extra_token_to_sequence;
      while (true) {
        const int64_t available = static_cast<int64_t>(sizes[document_idx[doc_pos]]) - offset;
        if (available >= need) {
          // The sample ends inside this document; the next one starts add_extra_token earlier.
          offset += need - add_extra_token_to_sequence;
          break;
        }
        need -= available;
        if (doc_pos == num_docs - 1) {
          // Out of data: only the final, partial sample may get here.
          offset = static_cast<int64_t>(sizes[document_idx[doc_pos]]) - add_extra_token_to_sequence;
          break;
        }
        ++doc_pos;
        offset = 0;
      }
      rows[2 * k] = static_cast<T>(doc_pos);
      rows[2 * k + 1] = static_cast<T>(offset);
    }
  }
  return to_numpy(std::move(rows), num_samples + 1, 2);
}

// ---------------------------------------------------------------------------------------- BERT / ICT

int32_t target_sample_length(int32_t short_seq_ratio, int32_t max_length, std::mt19937& rng) {
  if (short_seq_ratio == 0) return max_length;
  const uint32_t draw = rng();
  if (draw % static_cast<uint32_t>(short_seq_ratio) == 0) {
    return 2 + static_cast<int32_t>(draw % static_cast<uint32_t>(max_length - 1));
  }
  return max_length;
}

// Fisher-Yates over rows of `width` values, driven by mt19937_64(seed + 1).
template <typename T>
void shuffle_rows(std::vector<T>& rows, int64_t num_rows, int width, int32_t seed) {
  std::mt19937_64 rng(static_cast<uint64_t>(static_cast<int64_t>(seed) + 1));
  for (int64_t i = num_rows - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng() % static_cast<uint64_t>(i + 1));
    for (int c = 0; c < width; ++c) std::swap(rows[width * i + c], rows[width * j + c]);
  }
}

bool has_long_sentence(const int32_t* sizes, int64_t first, int64_t last) {
  for (int64_t s = first; s < last; ++s) {
    if (sizes[s] > kLongSentenceLen) return true;
  }
  return false;
}

// Rows (first sentence, end sentence exclusive, target length) for BERT samples, shuffled.
template <typename T>
py::array mapping_impl(const int64_t* docs, int64_t num_docs, const int32_t* sizes, int32_t num_epochs,
                       uint64_t max_num_samples, int32_t max_seq_length, double short_seq_prob, int32_t seed,
                       bool verbose, int32_t min_num_sent) {
  const int32_t short_seq_ratio = short_seq_prob > 0 ? static_cast<int32_t>(std::round(1.0 / short_seq_prob)) : 0;
  std::vector<T> rows;
  uint64_t empty_docs = 0, one_sent_docs = 0, long_sent_docs = 0;
  {
    py::gil_scoped_release no_gil;
    std::mt19937 rng(static_cast<uint32_t>(seed));
    for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
      if (rows.size() / 3 >= max_num_samples) break;
      const size_t rows_before = rows.size();
      for (int64_t doc = 0; doc < num_docs; ++doc) {
        const int64_t first = docs[doc], last = docs[doc + 1];
        const int64_t count = last - first;
        const bool long_sentence = count > 1 && has_long_sentence(sizes, first, last);
        if (epoch == 0) {
          empty_docs += count == 0;
          one_sent_docs += count == 1;
          long_sent_docs += long_sentence;
        }
        if (count < min_num_sent || long_sentence) continue;
        int64_t start = first, remaining = count;
        int32_t length = 0, used = 0;
        int32_t target = target_sample_length(short_seq_ratio, max_seq_length, rng);
        for (int64_t s = first; s < last; ++s) {
          length += sizes[s];
          ++used;
          --remaining;
          const bool full = length >= target && remaining > 1 && used >= min_num_sent;
          if (full || remaining == 0) {
            rows.push_back(static_cast<T>(start));
            rows.push_back(static_cast<T>(s + 1));
            rows.push_back(static_cast<T>(target));
            start = s + 1;
            target = target_sample_length(short_seq_ratio, max_seq_length, rng);
            length = 0;
            used = 0;
          }
        }
      }
      // An epoch without samples would repeat forever when only a sample count bounds the epochs.
      if (rows.size() == rows_before) break;
    }
    shuffle_rows(rows, static_cast<int64_t>(rows.size() / 3), 3, seed);
  }
  if (verbose) {
    std::cout << "    number of empty documents: " << empty_docs << "\n    number of documents with one sentence: "
              << one_sent_docs << "\n    number of documents with long sentences: " << long_sent_docs
              << "\n    will create mapping for " << rows.size() / 3 << " samples" << std::endl;
  }
  const int64_t n = static_cast<int64_t>(rows.size() / 3);
  return to_numpy(std::move(rows), n, 3);
}

py::array build_mapping(Array<int64_t> docs_, Array<int32_t> sizes_, int32_t num_epochs,
                        uint64_t max_num_samples, int32_t max_seq_length, double short_seq_prob, int32_t seed,
                        bool verbose, int32_t min_num_sent) {
  require(num_epochs > 0, "build_mapping: num_epochs must be > 0");
  require(max_seq_length > 1, "build_mapping: max_seq_length must be > 1");
  require(short_seq_prob >= 0.0 && short_seq_prob <= 1.0, "build_mapping: short_seq_prob must be in [0, 1]");
  require(seed > 0, "build_mapping: seed must be > 0");
  require(docs_.size() >= 1, "build_mapping: docs must hold at least one boundary");
  const int64_t num_docs = docs_.size() - 1;
  if (static_cast<uint64_t>(sizes_.size()) > std::numeric_limits<uint32_t>::max()) {
    return mapping_impl<uint64_t>(docs_.data(), num_docs, sizes_.data(), num_epochs, max_num_samples,
                                  max_seq_length, short_seq_prob, seed, verbose, min_num_sent);
  }
  return mapping_impl<uint32_t>(docs_.data(), num_docs, sizes_.data(), num_epochs, max_num_samples, max_seq_length,
                                short_seq_prob, seed, verbose, min_num_sent);
}

// Rows (first sentence, end sentence exclusive, document, block id) for ICT blocks, shuffled.
template <typename T>
py::array blocks_impl(const int64_t* docs, int64_t num_docs, const int32_t* sizes, const int32_t* title_sizes,
                      int32_t num_epochs, uint64_t max_num_samples, int32_t max_seq_length, int32_t seed,
                      bool use_one_sent_blocks) {
  const int64_t min_num_sent = use_one_sent_blocks ? 1 : 2;
  std::vector<T> rows;
  {
    py::gil_scoped_release no_gil;
    for (int32_t epoch = 0; epoch < num_epochs; ++epoch) {
      if (rows.size() / 4 >= max_num_samples) break;
      const size_t rows_before = rows.size();
      int64_t block_id = 0;  // block ids restart every epoch
      for (int64_t doc = 0; doc < num_docs; ++doc) {
        const int64_t first = docs[doc], last = docs[doc + 1];
        int64_t remaining = last - first;
        const int32_t target = max_seq_length - title_sizes[doc];
        if (remaining < min_num_sent || has_long_sentence(sizes, first, last)) continue;
        int64_t start = first;
        int32_t length = 0;
        int64_t used = 0;
        for (int64_t s = first; s < last; ++s) {
          length += sizes[s];
          ++used;
          --remaining;
          const bool full = length >= target && remaining >= min_num_sent && used >= min_num_sent;
          if (full || remaining == 0) {
            rows.push_back(static_cast<T>(start));
            rows.push_back(static_cast<T>(s + 1));
            rows.push_back(static_cast<T>(doc));
            rows.push_back(static_cast<T>(block_id));
            ++block_id;
            start = s + 1;
            length = 0;
            used = 0;
          }
        }
      }
      if (rows.size() == rows_before) break;
    }
    shuffle_rows(rows, static_cast<int64_t>(rows.size() / 4), 4, seed);
  }
  const int64_t n = static_cast<int64_t>(rows.size() / 4);
  return to_numpy(std::move(rows), n, 4);
}

py::array build_blocks_mapping(Array<int64_t> docs_, Array<int32_t> sizes_,
                               Array<int32_t> titles_sizes_, int32_t num_epochs, uint64_t max_num_samples,
                               int32_t max_seq_length, int32_t seed, bool verbose, bool use_one_sent_blocks) {
  require(num_epochs > 0, "build_blocks_mapping: num_epochs must be > 0");
  require(max_seq_length > 1, "build_blocks_mapping: max_seq_length must be > 1");
  require(seed > 0, "build_blocks_mapping: seed must be > 0");
  require(docs_.size() >= 1, "build_blocks_mapping: docs must hold at least one boundary");
  const int64_t num_docs = docs_.size() - 1;
  require(titles_sizes_.size() >= num_docs, "build_blocks_mapping: need one title size per document");
  (void)verbose;
  if (static_cast<uint64_t>(sizes_.size()) > std::numeric_limits<uint32_t>::max()) {
    return blocks_impl<uint64_t>(docs_.data(), num_docs, sizes_.data(), titles_sizes_.data(), num_epochs,
                                 max_num_samples, max_seq_length, seed, use_one_sent_blocks);
  }
  return blocks_impl<uint32_t>(docs_.data(), num_docs, sizes_.data(), titles_sizes_.data(), num_epochs,
                               max_num_samples, max_seq_length, seed, use_one_sent_blocks);
}

}  // namespace

PYBIND11_MODULE(helpers_cpp, m) {
  m.doc() = "Compiled index builders for megatron.core.datasets (see helpers_numpy.py for the reference).";
  // Output arrays must not be converted: a converted copy would receive the results instead.
  m.def("build_blending_indices", &build_blending_indices, py::arg("dataset_index").noconvert(),
        py::arg("dataset_sample_index").noconvert(), py::arg("weights"), py::arg("num_datasets"), py::arg("size"),
        py::arg("verbose"));
  m.def("build_exhaustive_blending_indices", &build_exhaustive_blending_indices, py::arg("dataset_index").noconvert(),
        py::arg("dataset_sample_index").noconvert(), py::arg("sizes"), py::arg("num_datasets"));
  m.def("build_sample_idx_int32", &build_sample_idx<int32_t>, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_sample_idx_int64", &build_sample_idx<int64_t>, py::arg("sizes"), py::arg("document_idx"),
        py::arg("seq_length"), py::arg("num_epochs"), py::arg("tokens_per_epoch"),
        py::arg("drop_last_partial_sequence") = true, py::arg("add_extra_token_to_sequence") = 1);
  m.def("build_mapping", &build_mapping);
  m.def("build_blocks_mapping", &build_blocks_mapping);
}
