#include "specache/bpe_tokenizer.h"

#include <algorithm>
#include <climits>
#include <functional>
#include <queue>

#include "unicode_classes.h"

namespace specache {
namespace {

using text::IsLetter;
using text::IsNumber;
using text::IsSpace;

// GPT-2's reversible byte -> printable code point map.
void BuildByteAlphabet(std::string (&symbol)[256], std::unordered_map<char32_t, uint8_t>* inverse) {
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    const char32_t cp = printable ? static_cast<char32_t>(b) : next++;
    symbol[b].clear();
    text::AppendUtf8(cp, &symbol[b]);
    (*inverse)[cp] = static_cast<uint8_t>(b);
  }
}

struct CodePoints {
  std::vector<char32_t> cp;
  std::vector<size_t> start;  // byte offset of each code point, plus the end
};

CodePoints SplitCodePoints(std::string_view s) {
  CodePoints c;
  size_t pos = 0;
  while (pos < s.size()) {
    c.start.push_back(pos);
    c.cp.push_back(text::NextCodePoint(s, &pos));
  }
  c.start.push_back(s.size());
  return c;
}

// Length in code points of the GPT-2 pattern's match at i (at least 1).
size_t MatchGpt2(const std::vector<char32_t>& c, size_t i) {
  const size_t n = c.size();
  auto run = [&](size_t j, auto pred) {
    while (j < n && pred(c[j])) ++j;
    return j;
  };
  // Contractions: 's 't 're 've 'm 'll 'd
  if (c[i] == U'\'' && i + 1 < n) {
    const char32_t a = c[i + 1];
    if (a == U's' || a == U't' || a == U'm' || a == U'd') return 2;
    if (i + 2 < n) {
      const char32_t b = c[i + 2];
      if ((a == U'r' && b == U'e') || (a == U'v' && b == U'e') || (a == U'l' && b == U'l')) return 3;
    }
  }
  const size_t j = (c[i] == U' ' && i + 1 < n) ? i + 1 : i;  // the optional leading space
  auto other = [](char32_t x) { return !IsSpace(x) && !IsLetter(x) && !IsNumber(x); };
  if (IsLetter(c[j])) return run(j, IsLetter) - i;
  if (IsNumber(c[j])) return run(j, IsNumber) - i;
  if (other(c[j])) return run(j, other) - i;
  // White space: a run not followed by non-space, else the run minus its last character.
  const size_t end = run(i, IsSpace);
  if (end == n || end - i == 1) return end - i;
  return end - i - 1;
}

}  // namespace

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromGguf(const gguf::GgufFile& file) {
  SPECACHE_ASSIGN_OR_RETURN(std::string model, file.GetString("tokenizer.ggml.model"));
  if (model != "gpt2") return Status::Unimplemented("tokenizer model '" + model + "' (only byte-level BPE 'gpt2')");
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  auto pre = file.GetString("tokenizer.ggml.pre");
  const std::string pre_name = pre.ok() ? *pre : "default";
  // Pre-tokenizers that are the GPT-2 pattern, with or without single-digit splitting.
  if (pre_name == "smollm" || pre_name == "starcoder" || pre_name == "refact") {
    t->split_digits_ = true;
  } else if (pre_name != "gpt2" && pre_name != "default") {
    return Status::Unimplemented("pre-tokenizer '" + pre_name + "'");
  }

  SPECACHE_ASSIGN_OR_RETURN(const std::vector<gguf::Value>* tokens, file.GetArray("tokenizer.ggml.tokens"));
  SPECACHE_ASSIGN_OR_RETURN(const std::vector<gguf::Value>* types, file.GetArray("tokenizer.ggml.token_type"));
  SPECACHE_ASSIGN_OR_RETURN(const std::vector<gguf::Value>* merges, file.GetArray("tokenizer.ggml.merges"));
  if (types->size() != tokens->size()) {
    return Status::DataLoss("tokenizer.ggml.token_type has " + std::to_string(types->size()) + " entries for " +
                            std::to_string(tokens->size()) + " tokens");
  }
  t->tokens_.reserve(tokens->size());
  for (size_t i = 0; i < tokens->size(); ++i) {
    const auto* s = std::get_if<std::string>(&(*tokens)[i].data);
    if (!s) return Status::DataLoss("tokenizer.ggml.tokens[" + std::to_string(i) + "] is not a string");
    const auto* ty = std::get_if<int64_t>(&(*types)[i].data);
    const auto* tu = std::get_if<uint64_t>(&(*types)[i].data);
    if (!ty && !tu) return Status::DataLoss("tokenizer.ggml.token_type[" + std::to_string(i) + "] is not an integer");
    t->tokens_.push_back(*s);
    t->types_.push_back(static_cast<int32_t>(ty ? *ty : static_cast<int64_t>(*tu)));
    t->ids_.emplace(*s, static_cast<int32_t>(i));
    if (t->types_.back() == 3) {
      // An empty one would match everywhere without consuming anything: Encode never ended.
      if (s->empty()) return Status::DataLoss("tokenizer.ggml.tokens[" + std::to_string(i) + "] is an empty control token");
      t->specials_.emplace_back(*s, static_cast<int32_t>(i));
    }
  }
  std::sort(t->specials_.begin(), t->specials_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  for (size_t i = 0; i < merges->size(); ++i) {
    const auto* s = std::get_if<std::string>(&(*merges)[i].data);
    if (!s || s->find(' ') == std::string::npos) {
      return Status::DataLoss("tokenizer.ggml.merges[" + std::to_string(i) + "] is not 'left right'");
    }
    t->merge_ranks_.emplace(*s, static_cast<int32_t>(i));
  }
  auto id_or = [&](const char* key) -> int32_t {
    auto v = file.GetInt(key);
    return v.ok() && *v >= 0 && *v < static_cast<int64_t>(t->tokens_.size()) ? static_cast<int32_t>(*v) : -1;
  };
  t->bos_id_ = id_or("tokenizer.ggml.bos_token_id");
  t->eos_id_ = id_or("tokenizer.ggml.eos_token_id");
  BuildByteAlphabet(t->byte_symbol_, &t->symbol_byte_);
  return t;
}

bool BpeTokenizer::IsControl(int32_t id) const {
  return id >= 0 && id < vocab_size() && types_[id] == 3;
}

int32_t BpeTokenizer::Find(std::string_view token) const {
  auto it = ids_.find(std::string(token));
  return it == ids_.end() ? -1 : it->second;
}

void BpeTokenizer::EncodePiece(std::string_view piece, std::vector<int32_t>* out) const {
  // The piece's bytes in the GPT-2 byte alphabet, and where each byte's symbol starts there: a
  // symbol made of bytes [a, b) is mapped[at[a], at[b]).
  const int32_t n = static_cast<int32_t>(piece.size());
  if (n == 0) return;
  std::string mapped;
  std::vector<int32_t> at(static_cast<size_t>(n) + 1);
  for (int32_t i = 0; i < n; ++i) {
    at[i] = static_cast<int32_t>(mapped.size());
    mapped += byte_symbol_[static_cast<unsigned char>(piece[i])];
  }
  at[n] = static_cast<int32_t>(mapped.size());
  // The symbols as a list over the bytes: the symbol starting at byte i ends where next[i] starts
  // (n: the last); a byte that no symbol starts at any more is dead.
  std::vector<int32_t> next(n), prev(n);
  std::vector<char> alive(n, 1);
  for (int32_t i = 0; i < n; ++i) next[i] = i + 1, prev[i] = i - 1;
  auto symbol = [&](int32_t a, int32_t b) { return std::string_view(mapped).substr(at[a], at[b] - at[a]); };
  // Candidate merges of two neighbours, lowest rank first, then leftmost: the order llama.cpp and
  // Hugging Face's tokenizers merge in, O(n log n). (Merging every occurrence of the best pair in a
  // pass over the symbols, as before, gives the same tokens whenever a merge's parts come from
  // merges of lower rank, as in a trained list, but took O(n^2) for a long run of letters.) A
  // candidate is stale once either symbol changed: it is checked when it comes up.
  struct Candidate {
    int32_t rank, left, right, end;  // the right symbol is [right, end)
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  std::string key;
  auto consider = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = next[left];
    if (right >= n) return;
    const int32_t end = next[right];
    key.assign(symbol(left, right)).append(1, ' ').append(symbol(right, end));
    auto it = merge_ranks_.find(key);
    if (it != merge_ranks_.end()) queue.push({it->second, left, right, end});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    if (!alive[c.left] || next[c.left] != c.right || !alive[c.right] || next[c.right] != c.end) continue;
    alive[c.right] = 0;
    next[c.left] = c.end;
    if (c.end < n) prev[c.end] = c.left;
    consider(prev[c.left]);
    consider(c.left);
  }
  for (int32_t i = 0; i < n; i = next[i]) {
    const std::string s(symbol(i, next[i]));
    auto it = ids_.find(s);
    if (it != ids_.end()) {
      out->push_back(it->second);
      continue;
    }
    // Not in the vocabulary (a malformed file): fall back to its single-byte symbols.
    size_t pos = 0;
    while (pos < s.size()) {
      std::string one;
      text::AppendUtf8(text::NextCodePoint(s, &pos), &one);
      auto b = ids_.find(one);
      if (b != ids_.end()) out->push_back(b->second);
    }
  }
}

void BpeTokenizer::EncodeOrdinary(std::string_view s, std::vector<int32_t>* out) const {
  const CodePoints c = SplitCodePoints(s);
  // Splits [from, to) with the GPT-2 pattern.
  auto split = [&](size_t from, size_t to) {
    std::vector<char32_t> part(c.cp.begin() + from, c.cp.begin() + to);
    size_t i = 0;
    while (i < part.size()) {
      const size_t len = MatchGpt2(part, i);
      EncodePiece(s.substr(c.start[from + i], c.start[from + i + len] - c.start[from + i]), out);
      i += len;
    }
  };
  size_t from = 0;
  for (size_t i = 0; i < c.cp.size(); ++i) {
    if (split_digits_ && IsNumber(c.cp[i])) {
      if (from < i) split(from, i);
      EncodePiece(s.substr(c.start[i], c.start[i + 1] - c.start[i]), out);
      from = i + 1;
    }
  }
  if (from < c.cp.size()) split(from, c.cp.size());
}

std::vector<int32_t> BpeTokenizer::Encode(std::string_view s, bool parse_special) const {
  std::vector<int32_t> out;
  size_t pos = 0;
  // Each control token's next occurrence at or after pos, searched for again only once pos passed
  // it: each token's searches scan the text about once (searching every token from pos after
  // every match made a text full of control tokens quadratic).
  std::vector<size_t> found;
  if (parse_special) {
    for (const auto& sp : specials_) found.push_back(s.find(sp.first));
  }
  while (pos < s.size()) {
    size_t next = s.size();
    const std::pair<std::string, int32_t>* hit = nullptr;
    for (size_t i = 0; i < found.size(); ++i) {  // longest first: the earliest, longest match wins
      if (found[i] != std::string::npos && found[i] < pos) found[i] = s.find(specials_[i].first, pos);
      if (found[i] < next) next = found[i], hit = &specials_[i];
    }
    if (next > pos) EncodeOrdinary(s.substr(pos, next - pos), &out);
    if (!hit) break;
    out.push_back(hit->second);
    pos = next + hit->first.size();
  }
  return out;
}

std::string BpeTokenizer::Decode(std::span<const int32_t> tokens, bool render_control) const {
  std::string out;
  for (int32_t id : tokens) {
    if (id < 0 || id >= vocab_size()) continue;
    if (types_[id] == 3) {
      if (render_control) out += tokens_[id];
      continue;
    }
    const std::string& s = tokens_[id];
    size_t pos = 0;
    while (pos < s.size()) {
      const char32_t cp = text::NextCodePoint(s, &pos);
      auto it = symbol_byte_.find(cp);
      if (it != symbol_byte_.end()) {
        out.push_back(static_cast<char>(it->second));
      } else {
        text::AppendUtf8(cp, &out);  // not a byte symbol (user-defined tokens): as written
      }
    }
  }
  return out;
}

}  // namespace specache
