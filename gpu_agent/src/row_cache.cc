#include "specache/row_cache.h"

#include <algorithm>
#include <tuple>

namespace specache {

std::vector<int64_t> UpdateRowCache(RowCacheEntries* cache, const std::vector<int32_t>& selected, int64_t now,
                                    size_t capacity, std::vector<bool>* hit) {
  hit->assign(selected.size(), false);
  // (token, used, source) of every entry after the update: selected tokens come from the
  // selection, the others from the old cache.
  std::vector<std::tuple<int32_t, int64_t, int64_t>> entries;
  size_t s = 0;
  for (size_t o = 0; o < cache->tokens.size(); ++o) {
    const int32_t token = cache->tokens[o];
    while (s < selected.size() && selected[s] < token) ++s;
    if (s < selected.size() && selected[s] == token) {
      (*hit)[s] = true;
    } else {
      entries.emplace_back(token, cache->used[o], -1 - static_cast<int64_t>(o));
    }
  }
  if (entries.size() + selected.size() > capacity) {  // the least recently used leave first
    const size_t keep = capacity > selected.size() ? capacity - selected.size() : 0;
    std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) {
      return std::make_pair(std::get<1>(a), std::get<0>(a)) > std::make_pair(std::get<1>(b), std::get<0>(b));
    });
    entries.resize(std::min(keep, entries.size()));
  }
  for (size_t i = 0; i < selected.size(); ++i) entries.emplace_back(selected[i], now, static_cast<int64_t>(i));
  std::sort(entries.begin(), entries.end());
  cache->tokens.clear();
  cache->used.clear();
  std::vector<int64_t> sources;
  for (const auto& [token, used, source] : entries) {
    cache->tokens.push_back(token);
    cache->used.push_back(used);
    sources.push_back(source);
  }
  return sources;
}

}  // namespace specache
