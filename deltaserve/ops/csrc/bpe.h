// Byte-level BPE over a vocabulary's token strings and its merges, as the `tokenizers` library's BPE model runs it
// (and llama.cpp's): a pre-token's characters start as one symbol each (a character not in the vocabulary is
// dropped), then the adjacent pair of lowest merge rank is merged, leftmost first among equal ranks, until no pair
// merges. With whole_pieces (Qwen3.5's ignore_merges) a pre-token that is itself a token is that token.
//
// What it holds, for Qwen3.5's 248k tokens and 500k merges 22 MB (5 MB for a make-model file's), where the
// `tokenizers` model held 72: the token strings once (UTF-8 of the GPT-2 byte alphabet, as the GGUF stores them),
// an open-addressing index of them, and one of the merges ((left, right) -> rank, merged token).
#pragma once
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <queue>
#include <string>
#include <string_view>
#include <vector>

namespace deltaserve {
namespace bpe {

inline uint64_t hash_text(std::string_view s) {  // FNV-1a, then a final mix (short keys hash to nearby values)
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  return h ^ (h >> 33);
}

inline uint64_t table_size(int64_t n) {  // a power of two at least twice n
  uint64_t size = 16;
  while (size < 2 * static_cast<uint64_t>(n)) size <<= 1;
  return size;
}

class Vocabulary {
 public:
  // items[i] = data[starts[i] : ends[i]] for tokens and merges ("left right", split at the first space after the
  // first byte, as llama.cpp splits them)
  Vocabulary(std::string_view tokens, at::Tensor token_starts, at::Tensor token_ends, std::string_view merges,
             at::Tensor merge_starts, at::Tensor merge_ends, bool whole_pieces)
      : whole_pieces_(whole_pieces) {
    const int64_t V = check_spans(token_starts, token_ends, tokens.size(), "token");
    const int64_t* s = token_starts.data_ptr<int64_t>();
    const int64_t* e = token_ends.data_ptr<int64_t>();
    starts_.resize(V + 1);
    std::string packed;
    packed.reserve(tokens.size());
    for (int64_t i = 0; i < V; ++i) {
      starts_[i] = static_cast<uint32_t>(packed.size());
      packed.append(tokens.data() + s[i], e[i] - s[i]);
    }
    starts_[V] = static_cast<uint32_t>(packed.size());
    text_ = std::move(packed);
    index_.assign(table_size(V), kEmpty);
    for (int64_t i = 0; i < V; ++i) {
      uint32_t& slot = index_[probe(token(i))];
      if (slot == kEmpty) slot = static_cast<uint32_t>(i);
      else if (duplicate_ < 0) duplicate_ = i;
    }
    const int64_t M = check_spans(merge_starts, merge_ends, merges.size(), "merge");
    const int64_t* ms = merge_starts.data_ptr<int64_t>();
    const int64_t* me = merge_ends.data_ptr<int64_t>();
    merges_.assign(table_size(M), Merge{kNoPair, 0, 0});
    for (int64_t r = 0; r < M; ++r) {
      const std::string_view m = merges.substr(ms[r], me[r] - ms[r]);
      const size_t cut = m.size() > 1 ? m.find(' ', 1) : std::string_view::npos;
      const int64_t a = cut == std::string_view::npos ? -1 : find(m.substr(0, cut));
      const int64_t b = a < 0 ? -1 : find(m.substr(cut + 1));
      const int64_t joined = b < 0 ? -1 : find(std::string(m.substr(0, cut)) + std::string(m.substr(cut + 1)));
      if (joined < 0) {
        bad_merge_ = r;
        return;
      }
      Merge& slot = merges_[merge_probe(pair_key(a, b))];
      if (slot.key == kNoPair) slot = Merge{pair_key(a, b), static_cast<uint32_t>(r), static_cast<uint32_t>(joined)};
    }
  }

  int64_t size() const { return static_cast<int64_t>(starts_.size()) - 1; }

  std::string_view token(int64_t i) const {
    return std::string_view(text_).substr(starts_[i], starts_[i + 1] - starts_[i]);
  }

  py::bytes token_text(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < size(), "token id ", i, " is outside the vocabulary");
    const std::string_view t = token(i);
    return py::bytes(t.data(), t.size());
  }

  int64_t find(std::string_view text) const {  // the id of a token string, or -1
    const uint32_t id = index_[probe(text)];
    return id == kEmpty ? int64_t{-1} : static_cast<int64_t>(id);
  }

  // the first token whose string an earlier one has, and the first merge that is not two tokens joining into a
  // third: -1 where none (the vocabulary is unusable otherwise; the caller names the entry)
  int64_t duplicate() const { return duplicate_; }
  int64_t bad_merge() const { return bad_merge_; }

  // the merges in rank order as (left, right) ids [M, 2] (a pair given twice: once, at its first rank)
  at::Tensor merge_pairs() const {
    std::vector<std::pair<uint32_t, uint64_t>> ranked;
    for (const Merge& m : merges_)
      if (m.key != kNoPair) ranked.emplace_back(m.rank, m.key);
    std::sort(ranked.begin(), ranked.end());
    at::Tensor out = at::empty({static_cast<int64_t>(ranked.size()), 2}, at::kLong);
    int64_t* o = out.data_ptr<int64_t>();
    for (size_t r = 0; r < ranked.size(); ++r) o[2 * r] = ranked[r].second >> 32, o[2 * r + 1] = ranked[r].second & 0xFFFFFFFF;
    return out;
  }

  int64_t nbytes() const {  // what the tables hold
    return static_cast<int64_t>(text_.size() + 4 * (starts_.size() + index_.size()) + sizeof(Merge) * merges_.size());
  }

  // the ids of pre-tokens (already in the byte alphabet), one after another
  std::vector<int64_t> encode(const std::vector<std::string>& pieces) const {
    std::vector<int64_t> ids;
    std::vector<Symbol> symbols;
    for (const std::string& piece : pieces) encode_piece(piece, symbols, ids);
    return ids;
  }

 private:
  static constexpr uint32_t kEmpty = 0xFFFFFFFFu;
  static constexpr uint64_t kNoPair = ~0ull;

  struct Merge {
    uint64_t key;
    uint32_t rank, id;
  };
  struct Symbol {
    int64_t id, prev, next;  // prev / next: neighbours' positions, -1 at the ends; id -1: merged into its left
  };
  struct Candidate {  // a pair (pos, its next) that merges at `rank` into `id`; the queue's top is lowest rank, then pos
    uint32_t rank;
    int64_t pos, id;
    bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };

  static uint64_t pair_key(int64_t a, int64_t b) { return static_cast<uint64_t>(a) << 32 | static_cast<uint64_t>(b); }

  static int64_t check_spans(const at::Tensor& starts, const at::Tensor& ends, size_t bytes, const char* what) {
    TORCH_CHECK(starts.dtype() == at::kLong && ends.dtype() == at::kLong && starts.is_contiguous() &&
                    ends.is_contiguous() && starts.dim() == 1 && starts.sizes() == ends.sizes(),
                what, " spans must be two contiguous int64 vectors of one length");
    const int64_t n = starts.numel();
    const int64_t* s = starts.data_ptr<int64_t>();
    const int64_t* e = ends.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(0 <= s[i] && s[i] <= e[i] && e[i] <= static_cast<int64_t>(bytes), what, " ", i, " lies outside its bytes");
    TORCH_CHECK(bytes < (1ull << 32) && n < (1ll << 31), "too many ", what, "s");
    return n;
  }

  uint64_t probe(std::string_view text) const {  // the index slot holding `text`, or the empty one it would take
    const uint64_t mask = index_.size() - 1;
    for (uint64_t at = hash_text(text) & mask;; at = (at + 1) & mask)
      if (index_[at] == kEmpty || token(index_[at]) == text) return at;
  }

  uint64_t merge_probe(uint64_t key) const {
    const uint64_t mask = merges_.size() - 1;
    for (uint64_t at = hash_text(std::string_view(reinterpret_cast<const char*>(&key), 8)) & mask;; at = (at + 1) & mask)
      if (merges_[at].key == kNoPair || merges_[at].key == key) return at;
  }

  const Merge* merge(int64_t a, int64_t b) const {
    const Merge& m = merges_[merge_probe(pair_key(a, b))];
    return m.key == kNoPair ? nullptr : &m;
  }

  void push(std::priority_queue<Candidate>& queue, const std::vector<Symbol>& symbols, int64_t pos) const {
    const int64_t next = symbols[pos].next;
    if (next < 0) return;
    if (const Merge* m = merge(symbols[pos].id, symbols[next].id)) queue.push({m->rank, pos, m->id});
  }

  void encode_piece(const std::string& piece, std::vector<Symbol>& symbols, std::vector<int64_t>& ids) const {
    if (whole_pieces_) {
      const int64_t whole = find(piece);
      if (whole >= 0) {
        ids.push_back(whole);
        return;
      }
    }
    symbols.clear();
    for (size_t i = 0; i < piece.size();) {  // one symbol per UTF-8 character
      size_t len = 1;
      const unsigned char lead = piece[i];
      if (lead >= 0xF0) len = 4;
      else if (lead >= 0xE0) len = 3;
      else if (lead >= 0xC0) len = 2;
      len = std::min(len, piece.size() - i);
      const int64_t id = find(std::string_view(piece).substr(i, len));
      i += len;
      if (id < 0) continue;  // not in the vocabulary and no unknown token: dropped, as `tokenizers` does
      const int64_t pos = static_cast<int64_t>(symbols.size());
      if (pos) symbols[pos - 1].next = pos;
      symbols.push_back({id, pos - 1, -1});
    }
    std::priority_queue<Candidate> queue;
    for (int64_t pos = 0; pos + 1 < static_cast<int64_t>(symbols.size()); ++pos) push(queue, symbols, pos);
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = symbols[top.pos];
      if (left.id < 0 || left.next < 0) continue;
      const Merge* m = merge(left.id, symbols[left.next].id);  // the pair may have changed since it was queued
      if (m == nullptr || static_cast<int64_t>(m->id) != top.id) continue;
      Symbol& right = symbols[left.next];
      left.id = top.id;
      left.next = right.next;
      right.id = -1;
      if (left.next >= 0) symbols[left.next].prev = top.pos;
      if (left.prev >= 0) push(queue, symbols, left.prev);
      push(queue, symbols, top.pos);
    }
    for (const Symbol& s : symbols)
      if (s.id >= 0) ids.push_back(s.id);
  }

  bool whole_pieces_;
  int64_t duplicate_ = -1, bad_merge_ = -1;
  std::string text_;              // every token's string, one after another
  std::vector<uint32_t> starts_;  // token i: text_[starts_[i] : starts_[i + 1]]
  std::vector<uint32_t> index_;   // open addressing over token strings: id or kEmpty
  std::vector<Merge> merges_;     // open addressing over (left, right)
};

inline void bind_bpe(py::module& m) {
  py::class_<Vocabulary>(m, "BpeVocabulary")
      .def(py::init<std::string_view, at::Tensor, at::Tensor, std::string_view, at::Tensor, at::Tensor, bool>(),
           "tokens, token starts, token ends, merges, merge starts, merge ends (bytes and int64 spans), whole_pieces")
      .def("__len__", &Vocabulary::size)
      .def("token", &Vocabulary::token_text, "token i's string as UTF-8 bytes")
      .def("find", [](const Vocabulary& v, std::string_view text) { return v.find(text); }, "a string's token id, or -1")
      .def("duplicate", &Vocabulary::duplicate, "the first token that repeats an earlier one's string, or -1")
      .def("bad_merge", &Vocabulary::bad_merge, "the first merge that is not two tokens joining into a third, or -1")
      .def("nbytes", &Vocabulary::nbytes, "bytes the tables hold")
      .def("merge_pairs", &Vocabulary::merge_pairs, "the merges in rank order as (left, right) ids")
      .def("encode", &Vocabulary::encode, py::call_guard<py::gil_scoped_release>(), "token ids of pre-tokens");
}

}  // namespace bpe
}  // namespace deltaserve
