#include "specache/agent.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <span>
#include <tuple>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "specache/in_memory_source.h"
#include "specache/row_cache.h"
#include "specache/selection.h"
#include "testing/forwarding_source.h"
#include "testing/reference.h"

namespace specache {
namespace {

const ModelShape kShape{2, 4, 2, 64};

KvConfig Config(KvMode mode, int bits = 1, int k = 16) {
  KvConfig c;
  c.mode = mode;
  c.key_bits = c.value_bits = bits;
  c.top_k = k;
  return c;
}

// Random prompt tensors for a ragged batch.
struct Prompt {
  std::vector<float> q, k, v, out;
  Prompt(int tokens, std::mt19937& rng)
      : q(testing::RandomFloats(size_t(tokens) * kShape.n_q_heads * 64, rng, 0.5f)),
        k(testing::RandomFloats(size_t(tokens) * kShape.n_kv_heads * 64, rng)),
        v(testing::RandomFloats(size_t(tokens) * kShape.n_kv_heads * 64, rng)),
        out(q.size()) {}
};

Status PrefillAll(Agent* agent, std::span<const SequenceId> ids, std::span<const int32_t> offsets, Prompt* p) {
  for (int l = 0; l < kShape.n_layers; ++l) {
    SPECACHE_RETURN_IF_ERROR(agent->PrefillLayer(l, {ids, offsets, p->q.data(), p->k.data(), p->v.data(), p->out.data()}));
  }
  return Status::Ok();
}

// One step of every layer: each layer's rows decoded, its next rows prefetched and waited for.
Status StepAllLayers(Agent* agent, StepKind kind, std::span<const SequenceId> ids, const DecodeRows& rows) {
  SPECACHE_RETURN_IF_ERROR(agent->BeginStep(kind, ids));
  for (int l = 0; l < kShape.n_layers; ++l) {
    SPECACHE_RETURN_IF_ERROR(agent->DecodeLayer(l, rows));
    SPECACHE_RETURN_IF_ERROR(agent->StartPrefetch(l));
    SPECACHE_RETURN_IF_ERROR(agent->WaitPrefetch(l));
  }
  return agent->EndStep();
}

struct Fixture {
  InMemorySource source;
  std::unique_ptr<Agent> agent;
  explicit Fixture(const KvConfig& c, const ModelShape& shape = kShape) {
    auto a = CreateCpuAgent(shape, c, &source);
    EXPECT_TRUE(a.ok()) << a.status().ToString();
    if (a.ok()) agent = std::move(a).value();
  }
};

TEST(AgentConfigTest, RejectsBadShapesAndParametersWithClearErrors) {
  InMemorySource source;
  struct Case {
    ModelShape shape;
    KvConfig config;
    const char* needle;
  } cases[] = {
      {{0, 4, 2, 64}, Config(KvMode::kKivi), "positive"},
      {{2, 4, 0, 64}, Config(KvMode::kKivi), "positive"},
      {{2, 4, 2, -64}, Config(KvMode::kKivi), "positive"},
      {{2, 5, 2, 64}, Config(KvMode::kKivi), "multiple of n_kv_heads"},
      {{2, 4, 2, 60}, Config(KvMode::kKivi), "multiple of 8"},
      {kShape, Config(KvMode::kKivi, 3), "key_bits 3"},
      {kShape, Config(KvMode::kKivi, 8), "key_bits 8"},
      {kShape, Config(KvMode::kKivi, 0), "key_bits 0"},
      {kShape, [] { auto c = Config(KvMode::kKivi); c.group_size = 48; return c; }(), "multiple of 32"},
      {kShape, [] { auto c = Config(KvMode::kKivi); c.residual_tokens = 80; return c; }(), "multiple of G"},
      {kShape, [] { auto c = Config(KvMode::kKivi); c.group_size = 128; c.residual_tokens = 128; return c; }(),
       "divide head_dim"},
      {kShape, Config(KvMode::kSpeCache, 1, 0), "top_k"},
      {kShape, Config(KvMode::kSpeCacheNonSpec, 1, -3), "top_k"},
  };
  for (const Case& c : cases) {
    auto agent = CreateCpuAgent(c.shape, c.config, &source);
    ASSERT_FALSE(agent.ok()) << c.needle;
    EXPECT_EQ(agent.status().code(), StatusCode::kInvalidArgument) << c.needle;
    EXPECT_NE(agent.status().message().find(c.needle), std::string::npos) << agent.status().ToString();
  }
  EXPECT_EQ(CreateCpuAgent(kShape, Config(KvMode::kKivi), nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_FALSE(ParseKvMode("fast").ok());
  EXPECT_EQ(*ParseKvMode("specache-nonspec"), KvMode::kSpeCacheNonSpec);
  EXPECT_FALSE(ParseGroupReduction("median").ok());
}

TEST(AgentConfigTest, FetchOverlapNamesRoundTrip) {
  for (FetchOverlap o :
       {FetchOverlap::kFromSelection, FetchOverlap::kBesideNextAttention, FetchOverlap::kWithinNextAttention}) {
    EXPECT_EQ(*ParseFetchOverlap(FetchOverlapName(o)), o);
  }
  EXPECT_EQ(CudaAgentOptions{}.fetch_overlap, FetchOverlap::kFromSelection);
  for (FetchVia v : {FetchVia::kSmLoads, FetchVia::kCopyEngine}) EXPECT_EQ(*ParseFetchVia(FetchViaName(v)), v);
  EXPECT_EQ(FetchViaNames().size(), 2u);
  EXPECT_EQ(CudaAgentOptions{}.fetch_via, FetchVia::kCopyEngine);
  EXPECT_EQ(ParseFetchVia("dma").status().code(), StatusCode::kInvalidArgument);
  const auto bad = ParseFetchOverlap("later");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("within-next-attention"), std::string::npos);
}

TEST(AgentTest, CallsOutOfOrderOrWithBadIdsGiveSpecificErrors) {
  Fixture f(Config(KvMode::kSpeCache));
  Agent& a = *f.agent;
  std::mt19937 rng(1);
  Prompt p(10, rng);
  const SequenceId ids[] = {1};
  const int32_t offsets[] = {0, 10};
  EXPECT_EQ(a.PrefillLayer(0, {ids, offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kNotFound);
  ASSERT_TRUE(a.AddSequence(1).ok());
  EXPECT_EQ(a.AddSequence(1).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(a.BeginStep(StepKind::kDecode, ids).code(), StatusCode::kFailedPrecondition);  // not prefilled
  EXPECT_EQ(a.PrefillLayer(2, {ids, offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(a.PrefillLayer(-1, {ids, offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kOutOfRange);
  const int32_t bad_offsets[] = {0, 0};
  EXPECT_EQ(a.PrefillLayer(0, {ids, bad_offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(a.PrefillLayer(0, {ids, offsets, nullptr, p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kInvalidArgument);
  const SequenceId twice[] = {1, 1};
  const int32_t twice_offsets[] = {0, 5, 10};
  EXPECT_EQ(a.PrefillLayer(0, {twice, twice_offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.PrefillLayer(0, {ids, offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).ok());
  EXPECT_EQ(a.PrefillLayer(0, {ids, offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kFailedPrecondition);  // already prefilled
  EXPECT_EQ(a.BeginStep(StepKind::kDecode, ids).code(), StatusCode::kFailedPrecondition);  // layer 1 missing
  ASSERT_TRUE(a.PrefillLayer(1, {ids, offsets, p.q.data(), p.k.data(), p.v.data(), p.out.data()}).ok());

  std::vector<float> q(4 * 64), k(2 * 64), v(2 * 64), out(4 * 64);
  EXPECT_EQ(a.DecodeLayer(0, {q.data(), k.data(), v.data(), out.data()}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.EndStep().code(), StatusCode::kFailedPrecondition);
  const SequenceId unknown[] = {99};
  EXPECT_EQ(a.BeginStep(StepKind::kDecode, unknown).code(), StatusCode::kNotFound);
  EXPECT_EQ(a.BeginStep(StepKind::kDecode, {}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(a.BeginStep(StepKind::kPreDecode, ids).ok());
  EXPECT_EQ(a.BeginStep(StepKind::kDecode, ids).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.StartPrefetch(0).code(), StatusCode::kFailedPrecondition);  // before DecodeLayer(0)
  EXPECT_EQ(a.DecodeLayer(5, {q.data(), k.data(), v.data(), out.data()}).code(), StatusCode::kOutOfRange);
  ASSERT_TRUE(a.DecodeLayer(0, {q.data(), k.data(), v.data(), out.data()}).ok());
  EXPECT_EQ(a.DecodeLayer(0, {q.data(), k.data(), v.data(), out.data()}).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(a.EndStep().code(), StatusCode::kFailedPrecondition);  // layer 1 not decoded
  EXPECT_EQ(a.ReleaseSequence(1).code(), StatusCode::kFailedPrecondition);  // inside the step
  a.AbortStep();
  EXPECT_EQ(a.SelectedTokens(1, 0, 7).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(a.SelectedTokens(2, 0, 0).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(a.ReleaseSequence(1).ok());
  EXPECT_EQ(a.ReleaseSequence(1).code(), StatusCode::kNotFound);

  Fixture kivi(Config(KvMode::kKivi));
  EXPECT_EQ(kivi.agent->RowsPerSequence(StepKind::kPreDecode), 0);
  ASSERT_TRUE(kivi.agent->AddSequence(3).ok());
  const SequenceId three[] = {3};
  ASSERT_TRUE(PrefillAll(kivi.agent.get(), three, offsets, &p).ok());
  EXPECT_EQ(kivi.agent->BeginStep(StepKind::kPreDecode, three).code(), StatusCode::kFailedPrecondition);
}

TEST(InMemorySourceTest, RejectsOutOfRangeAndOutOfOrderAccess) {
  InMemorySource s;
  EXPECT_EQ(s.CreateSequence(1, {0, 2, 64}).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(s.CreateSequence(1, {2, 2, 8}).ok());
  EXPECT_EQ(s.CreateSequence(1, {2, 2, 8}).code(), StatusCode::kAlreadyExists);
  std::vector<Half> rows(3 * 16, 1);
  EXPECT_EQ(s.AppendRows(1, 0, 0, 1, rows.data(), 3).code(), StatusCode::kFailedPrecondition);  // hole
  EXPECT_EQ(s.AppendRows(1, 2, 0, 0, rows.data(), 3).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s.AppendRows(2, 0, 0, 0, rows.data(), 3).code(), StatusCode::kNotFound);
  ASSERT_TRUE(s.AppendRows(1, 0, 1, 0, rows.data(), 3).ok());
  const int32_t good[] = {2, 0}, bad[] = {3}, negative[] = {-1};
  std::vector<Half> out(2 * 16);
  EXPECT_TRUE(s.ReadRows(1, 0, 1, good, 2, out.data()).ok());
  EXPECT_EQ(s.ReadRows(1, 0, 1, bad, 1, out.data()).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s.ReadRows(1, 0, 1, negative, 1, out.data()).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(*s.Length(1, 0, 1), 3);
  EXPECT_EQ(s.stored_bytes(), 3 * 16 * 2);
  EXPECT_TRUE(s.ReleaseSequence(1).ok());
  EXPECT_EQ(s.ReleaseSequence(1).code(), StatusCode::kNotFound);
}

// A source made with more tokens a page than the daemon's pages allow refuses its sequences; before,
// page_tokens near INT32_MAX overflowed the pages' count, no page was made and the first row
// written went through a null page (a crash a Python caller could cause).
TEST(InMemorySourceTest, PageTokensPastTheDaemonsBoundAreRefusedNotOverflowed) {
  InMemorySource huge(std::numeric_limits<int32_t>::max());
  Status made = huge.CreateSequence(1, {2, 2, 8});
  EXPECT_EQ(made.code(), StatusCode::kInvalidArgument) << made.ToString();
  EXPECT_NE(made.message().find("at most 65536"), std::string::npos) << made.ToString();
  std::vector<Half> rows(16 * 16, 1);
  EXPECT_EQ(huge.AppendRows(1, 0, 0, 0, rows.data(), 16).code(), StatusCode::kNotFound);
  // The bound itself is a page size like any other.
  InMemorySource widest(InMemorySource::kMaxPageTokens, size_t{1} << 20, /*huge_pages=*/false);
  ASSERT_TRUE(widest.CreateSequence(1, {1, 1, 8}).ok());
  ASSERT_TRUE(widest.AppendRows(1, 0, 0, 0, rows.data(), 16).ok());
  EXPECT_EQ(*widest.Length(1, 0, 0), 16);
}

// A slab size so large that rounding it to the pages' alignment wraps (Python may pass any
// size_t): the rows' first page cannot be had, RESOURCE_EXHAUSTED; before, the slab rounded to 0
// bytes, held no page, and the first append took a page from an empty list (a crash). The same
// answer for any slab the host cannot allocate: before, its path took the source's shared lock
// while it still held the exclusive one (std::system_error, "Resource deadlock avoided").
TEST(InMemorySourceTest, ASlabSizeThatCannotBeRoundedIsOutOfMemoryNotACrash) {
  for (size_t slab : {std::numeric_limits<size_t>::max() - 5, size_t{1} << 62}) {
    for (bool huge_pages : {true, false}) {
      InMemorySource s(16, slab, huge_pages);
      ASSERT_TRUE(s.CreateSequence(1, {1, 1, 8}).ok());
      std::vector<Half> rows(16, 1);
      EXPECT_EQ(s.AppendRows(1, 0, 0, 0, rows.data(), 1).code(), StatusCode::kResourceExhausted) << slab << huge_pages;
      EXPECT_EQ(*s.Length(1, 0, 0), 0);
    }
  }
}

// Zero-copy access: rows live in fixed pages laid out [kv_head][token][K|V][head_dim] inside the
// listed regions; rows written in place count once committed; released pages are reused.
TEST(InMemorySourceTest, PagesAreFixedInsideRegionsAndWrittenInPlace) {
  const int page_tokens = 4, n_kv = 2, d = 8;
  const size_t row = 2 * d;
  InMemorySource s(page_tokens);
  ASSERT_EQ(s.page_tokens(), page_tokens);
  ASSERT_TRUE(s.CreateSequence(1, {2, n_kv, d}).ok());
  std::vector<Half> rows(6 * row);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<Half>(i);
  ASSERT_TRUE(s.AppendRows(1, 1, 1, 0, rows.data(), 6).ok());  // two pages at every layer
  std::vector<uint8_t*> pages;
  ASSERT_TRUE(s.HostPages(1, 1, 6, &pages).ok());
  ASSERT_EQ(pages.size(), 2u);
  // Token 5 of head 1 is row 1 of page 1, after head 0's four rows.
  EXPECT_EQ(std::memcmp(pages[1] + (1 * page_tokens + 1) * row * sizeof(Half), &rows[5 * row], row * sizeof(Half)), 0);
  const auto inside = [&s](const uint8_t* p) {
    for (const HostRegion& r : s.host_regions()) {
      if (p >= static_cast<uint8_t*>(r.base) && p < static_cast<uint8_t*>(r.base) + r.bytes) return true;
    }
    return false;
  };
  EXPECT_TRUE(inside(pages[0]) && inside(pages[1]));
  // Growing to 9 tokens adds a third page; the first two stay where they were.
  std::vector<uint8_t*> grown;
  ASSERT_TRUE(s.HostPages(1, 1, 9, &grown).ok());
  ASSERT_EQ(grown.size(), 3u);
  EXPECT_EQ(grown[0], pages[0]);
  EXPECT_EQ(grown[1], pages[1]);
  // In-place write of token 6 at layer 1, head 1, then commit: readable through ReadRows.
  std::memcpy(grown[1] + (1 * page_tokens + 2) * row * sizeof(Half), &rows[0], row * sizeof(Half));
  EXPECT_EQ(s.CommitRows(1, 1, 1, 7, 1).code(), StatusCode::kFailedPrecondition);  // a hole
  ASSERT_TRUE(s.CommitRows(1, 1, 1, 6, 1).ok());
  EXPECT_EQ(s.CommitRows(1, 1, 1, 7, 9).code(), StatusCode::kFailedPrecondition);  // beyond the pages
  const int32_t six[] = {6};
  std::vector<Half> out(row);
  ASSERT_TRUE(s.ReadRows(1, 1, 1, six, 1, out.data()).ok());
  EXPECT_EQ(out, std::vector<Half>(rows.begin(), rows.begin() + row));
  EXPECT_EQ(*s.Length(1, 1, 1), 7);
  // Released pages are reused by the next sequence of the same layout; regions do not change.
  const size_t regions = s.host_regions().size();
  ASSERT_TRUE(s.ReleaseSequence(1).ok());
  ASSERT_TRUE(s.CreateSequence(2, {2, n_kv, d}).ok());
  std::vector<uint8_t*> again;
  ASSERT_TRUE(s.HostPages(2, 0, 12, &again).ok());
  EXPECT_EQ(s.host_regions().size(), regions);
  EXPECT_EQ(s.HostPages(3, 0, 1, &again).code(), StatusCode::kNotFound);
}

// A layer's commit of every head is all or nothing in the in-memory source, with CommitRows' rules.
TEST(InMemorySourceTest, LayerCommitsEveryHeadOrNone) {
  const int page_tokens = 4, n_kv = 3, d = 8;
  InMemorySource s(page_tokens);
  ASSERT_TRUE(s.CreateSequence(1, {2, n_kv, d}).ok());
  std::vector<uint8_t*> pages;
  ASSERT_TRUE(s.HostPages(1, 0, 5, &pages).ok());
  ASSERT_TRUE(s.CommitLayerRows(1, 0, n_kv, 0, 5).ok());
  for (int h = 0; h < n_kv; ++h) EXPECT_EQ(*s.Length(1, 0, h), 5);
  EXPECT_EQ(*s.Length(1, 1, 0), 0);  // the other layer is untouched
  // Head 2 one row ahead: the next commit of the layer is a hole for it, and nothing changes.
  ASSERT_TRUE(s.CommitRows(1, 0, 2, 5, 1).ok());
  EXPECT_EQ(s.CommitLayerRows(1, 0, n_kv, 5, 1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(*s.Length(1, 0, 0), 5);
  EXPECT_EQ(*s.Length(1, 0, 1), 5);
  EXPECT_EQ(s.CommitLayerRows(1, 1, n_kv, 0, 9).code(), StatusCode::kFailedPrecondition);  // beyond the 2 pages
  EXPECT_EQ(*s.Length(1, 1, 0), 0);
  EXPECT_EQ(s.CommitLayerRows(1, 0, n_kv - 1, 5, 1).code(), StatusCode::kInvalidArgument);  // not the layout
  EXPECT_EQ(s.CommitLayerRows(2, 0, n_kv, 0, 1).code(), StatusCode::kNotFound);
  EXPECT_EQ(*s.Length(1, 0, 2), 6);
  // The source's default (head by head) agrees where the commit is valid.
  FullPrecisionSource& base = s;
  ASSERT_TRUE(s.CommitRows(1, 0, 0, 5, 1).ok());
  ASSERT_TRUE(s.CommitRows(1, 0, 1, 5, 1).ok());
  ASSERT_TRUE(base.FullPrecisionSource::CommitLayerRows(1, 0, n_kv, 6, 2).ok());
  for (int h = 0; h < n_kv; ++h) EXPECT_EQ(*s.Length(1, 0, h), 8);
}

// Reserve carves the pages up front: sequences of that layout then take them without new regions
// (a CUDA agent registers the regions once, at its creation, instead of during a prefill).
TEST(InMemorySourceTest, ReservedPagesServeLaterSequencesWithoutNewRegions) {
  const int page_tokens = 16, n_kv = 2, d = 64;  // 8 KiB pages: slabs hold whole pages
  const SequenceLayout layout{3, n_kv, d};
  const size_t page_bytes = size_t(n_kv) * page_tokens * 2 * d * sizeof(Half);
  InMemorySource s(page_tokens, 5 * page_bytes);  // slabs of five pages
  s.Reserve(layout, 2, 40);  // two sequences of 40 tokens: 3 pages x 3 layers each = 18 pages
  const size_t regions = s.host_regions().size();
  EXPECT_EQ(regions, 4u) << "18 pages in slabs of five";
  for (SequenceId id : {1, 2}) {
    ASSERT_TRUE(s.CreateSequence(id, layout).ok());
    for (int l = 0; l < 3; ++l) {
      std::vector<uint8_t*> pages;
      ASSERT_TRUE(s.HostPages(id, l, 40, &pages).ok());
      EXPECT_EQ(pages.size(), 3u);
    }
  }
  EXPECT_EQ(s.host_regions().size(), regions) << "the reserved pages were enough";
  std::vector<Half> rows(2 * d, Half(1.0f));
  ASSERT_TRUE(s.AppendRows(1, 2, 1, 0, rows.data(), 1).ok());
  s.Reserve(layout, 2, 0);  // nothing asked: nothing carved
  EXPECT_EQ(s.host_regions().size(), regions);
}

// Slabs of 2 MiB or more start on a 2 MiB boundary and span whole huge pages, so the kernel can
// back them by transparent huge pages (it is asked to; whether it does is the host's setting);
// without huge pages, or for smaller slabs, 4 KiB alignment as before. Rows read back the same.
TEST(InMemorySourceTest, SlabsOfTwoMiBOrMoreAreHugePageAligned) {
  const SequenceLayout layout{2, 2, 64};
  const size_t huge = size_t{2} << 20;
  for (const auto& [slab, huge_pages, want_align] :
       {std::tuple{size_t{3} << 20, true, huge}, std::tuple{size_t{3} << 20, false, size_t{4096}},
        std::tuple{size_t{64} << 10, true, size_t{4096}}}) {
    InMemorySource s(16, slab, huge_pages);
    s.Reserve(layout, 2, 300);
    ASSERT_FALSE(s.host_regions().empty());
    for (const HostRegion& r : s.host_regions()) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(r.base) % want_align, 0u) << slab << " " << huge_pages;
      EXPECT_EQ(r.bytes % want_align, 0u) << slab << " " << huge_pages;
      EXPECT_GE(r.bytes, slab);
    }
    ASSERT_TRUE(s.CreateSequence(1, layout).ok());
    std::vector<Half> rows(300 * 2 * 64);
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = FloatToHalf(float(i % 1000));
    ASSERT_TRUE(s.AppendRows(1, 1, 1, 0, rows.data(), 300).ok());
    std::vector<int32_t> tokens{0, 17, 299};
    std::vector<Half> got(3 * 2 * 64);
    ASSERT_TRUE(s.ReadRows(1, 1, 1, tokens.data(), 3, got.data()).ok());
    for (int j = 0; j < 3; ++j) {
      for (int e = 0; e < 2 * 64; ++e) ASSERT_EQ(got[j * 128 + e], rows[size_t(tokens[j]) * 128 + e]);
    }
  }
}

// The row cache's rule by hand: capacity k keeps the previous selection only; a larger one keeps
// the most recently used others, oldest (then lowest token) leaving first.
TEST(RowCacheTest, KeepsTheSelectionAndTheMostRecentlyUsedOthers) {
  auto run = [](size_t capacity) {
    RowCacheEntries cache;
    std::vector<bool> hit;
    int64_t hits = 0;
    const std::vector<std::vector<int32_t>> steps{{1, 2}, {2, 3}, {3, 4}, {1, 2}, {5, 6}};
    for (size_t s = 0; s < steps.size(); ++s) {
      UpdateRowCache(&cache, steps[s], static_cast<int64_t>(s + 1), capacity, &hit);
      for (bool h : hit) hits += h;
    }
    return std::make_pair(hits, cache);
  };
  const auto [hits2, cache2] = run(2);
  EXPECT_EQ(hits2, 2);  // 2 at step 2, 3 at step 3
  EXPECT_EQ(cache2.tokens, (std::vector<int32_t>{5, 6}));
  const auto [hits4, cache4] = run(4);
  EXPECT_EQ(hits4, 4);  // 2; 3; 1 and 2 (kept from steps 1-2)
  EXPECT_EQ(cache4.tokens, (std::vector<int32_t>{1, 2, 5, 6}));  // 3 and 4 (used at step 3) left
  EXPECT_EQ(cache4.used, (std::vector<int64_t>{4, 4, 5, 5}));
  // The sources: selected rows by index, kept rows by old position.
  RowCacheEntries c{{1, 4, 9}, {1, 2, 3}};
  std::vector<bool> hit;
  const auto sources = UpdateRowCache(&c, {4, 7}, 4, 3, &hit);
  EXPECT_EQ(hit, (std::vector<bool>{true, false}));
  EXPECT_EQ(c.tokens, (std::vector<int32_t>{4, 7, 9}));   // 1 (used longest ago) left
  EXPECT_EQ(sources, (std::vector<int64_t>{0, 1, -3}));  // 4 and 7 from the selection, 9 from old slot 2
}

// Two sequences of different lengths in one batch give exactly what each gives alone.
TEST(AgentTest, RaggedBatchEqualsSequencesRunAlone) {
  std::mt19937 rng(4);
  const int n0 = 150, n1 = 77;
  const size_t qw = kShape.n_q_heads * 64, kw = kShape.n_kv_heads * 64;
  const StepKind kinds[] = {StepKind::kPreDecode, StepKind::kDecode, StepKind::kDecode};
  const SequenceId ids[] = {10, 11};
  const int32_t offsets[] = {0, n0, n0 + n1};

  // Inputs of every step for both sequences, laid out [seq][rows] as the batched call wants.
  struct StepData {
    int rows;
    std::vector<float> q, k, v, out;
  };
  Fixture batched(Config(KvMode::kSpeCache, 2, 8));
  Prompt both(n0 + n1, rng);
  ASSERT_TRUE(batched.agent->AddSequence(10).ok());
  ASSERT_TRUE(batched.agent->AddSequence(11).ok());
  ASSERT_TRUE(PrefillAll(batched.agent.get(), ids, offsets, &both).ok());
  std::vector<std::vector<StepData>> steps;  // [step][layer]
  for (StepKind kind : kinds) {
    const int rows = batched.agent->RowsPerSequence(kind);
    ASSERT_TRUE(batched.agent->BeginStep(kind, ids).ok());
    steps.emplace_back();
    for (int l = 0; l < kShape.n_layers; ++l) {
      StepData d{rows, testing::RandomFloats(2 * rows * qw, rng, 0.5f), testing::RandomFloats(2 * rows * kw, rng),
                 testing::RandomFloats(2 * rows * kw, rng), std::vector<float>(2 * rows * qw)};
      ASSERT_TRUE(batched.agent->DecodeLayer(l, {d.q.data(), d.k.data(), d.v.data(), d.out.data()}).ok());
      ASSERT_TRUE(batched.agent->StartPrefetch(l).ok());
      steps.back().push_back(std::move(d));
    }
    ASSERT_TRUE(batched.agent->EndStep().ok());
  }

  for (int s = 0; s < 2; ++s) {
    Fixture alone(Config(KvMode::kSpeCache, 2, 8));
    const int first = s == 0 ? 0 : n0, n = s == 0 ? n0 : n1;
    Prompt p(n, rng);
    std::copy_n(both.q.begin() + first * qw, n * qw, p.q.begin());
    std::copy_n(both.k.begin() + first * kw, n * kw, p.k.begin());
    std::copy_n(both.v.begin() + first * kw, n * kw, p.v.begin());
    const SequenceId id[] = {ids[s]};
    const int32_t off[] = {0, n};
    ASSERT_TRUE(alone.agent->AddSequence(ids[s]).ok());
    ASSERT_TRUE(PrefillAll(alone.agent.get(), id, off, &p).ok());
    for (size_t i = 0; i < n * qw; ++i) ASSERT_EQ(p.out[i], both.out[first * qw + i]);
    for (size_t t = 0; t < steps.size(); ++t) {
      ASSERT_TRUE(alone.agent->BeginStep(kinds[t], id).ok());
      for (int l = 0; l < kShape.n_layers; ++l) {
        const StepData& d = steps[t][l];
        std::vector<float> out(d.rows * qw);
        ASSERT_TRUE(alone.agent
                        ->DecodeLayer(l, {d.q.data() + s * d.rows * qw, d.k.data() + s * d.rows * kw,
                                          d.v.data() + s * d.rows * kw, out.data()})
                        .ok());
        ASSERT_TRUE(alone.agent->StartPrefetch(l).ok());
        for (size_t i = 0; i < out.size(); ++i) {
          ASSERT_EQ(out[i], d.out[s * d.rows * qw + i]) << "sequence " << s << " step " << t << " layer " << l;
        }
      }
      ASSERT_TRUE(alone.agent->EndStep().ok());
    }
    for (int l = 0; l < kShape.n_layers; ++l) {
      for (int h = 0; h < kShape.n_kv_heads; ++h) {
        EXPECT_EQ(*alone.agent->SelectedTokens(ids[s], l, h), *batched.agent->SelectedTokens(ids[s], l, h));
      }
    }
  }
}

TEST(AgentTest, StoreOnlyPrefillLeavesTheSameStateAsAComputingOne) {
  std::mt19937 rng(9);
  const int n = 140;
  const SequenceId id[] = {5};
  const int32_t offsets[] = {0, n};
  Prompt p(n, rng);
  Fixture computing(Config(KvMode::kSpeCache, 1, 8)), storing(Config(KvMode::kSpeCache, 1, 8));
  ASSERT_TRUE(computing.agent->AddSequence(5).ok());
  ASSERT_TRUE(storing.agent->AddSequence(5).ok());
  ASSERT_TRUE(PrefillAll(computing.agent.get(), id, offsets, &p).ok());
  for (int l = 0; l < kShape.n_layers; ++l) {
    ASSERT_TRUE(storing.agent->PrefillLayer(l, {id, offsets, nullptr, p.k.data(), p.v.data(), nullptr}).ok());
  }
  // `out` without `q` is refused.
  Fixture bad(Config(KvMode::kKivi));
  ASSERT_TRUE(bad.agent->AddSequence(5).ok());
  EXPECT_EQ(bad.agent->PrefillLayer(0, {id, offsets, nullptr, p.k.data(), p.v.data(), p.out.data()}).code(),
            StatusCode::kInvalidArgument);

  const size_t qw = kShape.n_q_heads * 64, kw = kShape.n_kv_heads * 64;
  for (StepKind kind : {StepKind::kPreDecode, StepKind::kDecode, StepKind::kDecode}) {
    const int rows = computing.agent->RowsPerSequence(kind);
    ASSERT_TRUE(computing.agent->BeginStep(kind, id).ok());
    ASSERT_TRUE(storing.agent->BeginStep(kind, id).ok());
    for (int l = 0; l < kShape.n_layers; ++l) {
      const auto q = testing::RandomFloats(rows * qw, rng, 0.5f), k = testing::RandomFloats(rows * kw, rng),
                 v = testing::RandomFloats(rows * kw, rng);
      std::vector<float> a(rows * qw), b(rows * qw);
      ASSERT_TRUE(computing.agent->DecodeLayer(l, {q.data(), k.data(), v.data(), a.data()}).ok());
      ASSERT_TRUE(storing.agent->DecodeLayer(l, {q.data(), k.data(), v.data(), b.data()}).ok());
      ASSERT_EQ(a, b) << "layer " << l;
      ASSERT_TRUE(computing.agent->StartPrefetch(l).ok());
      ASSERT_TRUE(storing.agent->StartPrefetch(l).ok());
    }
    ASSERT_TRUE(computing.agent->EndStep().ok());
    ASSERT_TRUE(storing.agent->EndStep().ok());
  }
  EXPECT_EQ(computing.agent->stats().bytes_fetched, storing.agent->stats().bytes_fetched);
}

TEST(AgentTest, PrefetchSelectsTopKOfQuantizedTokensAndCountsReuse) {
  std::mt19937 rng(8);
  Fixture f(Config(KvMode::kSpeCache, 1, 16));
  const int n = 200;  // 192 quantized keys at R = 64
  Prompt p(n, rng);
  const SequenceId ids[] = {5};
  const int32_t offsets[] = {0, n};
  ASSERT_TRUE(f.agent->AddSequence(5).ok());
  ASSERT_TRUE(PrefillAll(f.agent.get(), ids, offsets, &p).ok());
  const size_t qw = 4 * 64, kw = 2 * 64;
  for (int step = 0; step < 4; ++step) {
    const StepKind kind = step == 0 ? StepKind::kPreDecode : StepKind::kDecode;
    const int rows = f.agent->RowsPerSequence(kind);
    // Slowly drifting queries: consecutive steps select overlapping rows.
    std::vector<float> q(rows * qw), k = testing::RandomFloats(rows * kw, rng), v = testing::RandomFloats(rows * kw, rng),
                       out(rows * qw);
    std::mt19937 qrng(1);
    for (auto& x : q) x = std::normal_distribution<float>(0, 0.5f)(qrng) + 0.01f * step;
    ASSERT_TRUE(StepAllLayers(f.agent.get(), kind, ids, {q.data(), k.data(), v.data(), out.data()}).ok());
    for (int l = 0; l < kShape.n_layers; ++l) {
      const auto sel = *f.agent->SelectedTokens(5, l, 0);
      ASSERT_EQ(sel.size(), 16u);
      EXPECT_TRUE(std::is_sorted(sel.begin(), sel.end()));
      EXPECT_LT(sel.back(), 192);
    }
  }
  const AgentStats s = f.agent->stats();
  EXPECT_EQ(s.rows_selected, 4 * 2 * 2 * 16);  // steps x layers x kv heads x k
  EXPECT_EQ(s.rows_fetched + s.rows_reused, s.rows_selected);
  EXPECT_GT(s.rows_reused, 0);
  EXPECT_EQ(s.bytes_fetched, s.rows_fetched * 2 * 64 * 2);
  EXPECT_EQ(s.steps, 3);
  EXPECT_EQ(s.full_precision_bytes, int64_t{n + 3} * 2 * 2 * 2 * 64 * 2);
  EXPECT_EQ(f.source.stored_bytes(), s.full_precision_bytes);
  EXPECT_GT(s.device_bytes, 0);
  EXPECT_EQ(s.device_bytes_reserved, s.device_bytes);  // the CPU backend allocates nothing ahead
}

// Two agents side by side: one prompt of n tokens as sequence 3 (a store-only prefill given q),
// then `steps` steps (a pre-decode, then decodes) of the same random rows, whose outputs must be
// equal; after each step `after_step(step)` may check more.
void PrefillSideBySide(Fixture* a, Fixture* b, Prompt* p, int n) {
  const SequenceId ids[] = {3};
  const int32_t offsets[] = {0, n};
  for (Fixture* f : {a, b}) {
    ASSERT_TRUE(f->agent->AddSequence(3).ok());
    for (int l = 0; l < kShape.n_layers; ++l) {
      ASSERT_TRUE(f->agent->PrefillLayer(l, {ids, offsets, p->q.data(), p->k.data(), p->v.data(), nullptr}).ok());
    }
  }
}
void DecodeSideBySide(Fixture* a, Fixture* b, int steps, std::mt19937& rng,
                      const std::function<void(int)>& after_step = {}) {
  const SequenceId ids[] = {3};
  const size_t qw = size_t(kShape.n_q_heads) * 64, kw = size_t(kShape.n_kv_heads) * 64;
  for (int step = 0; step < steps; ++step) {
    const StepKind kind = step == 0 ? StepKind::kPreDecode : StepKind::kDecode;
    const int rows = a->agent->RowsPerSequence(kind);
    std::vector<float> q = testing::RandomFloats(rows * qw, rng, 0.5f), k = testing::RandomFloats(rows * kw, rng),
                       v = testing::RandomFloats(rows * kw, rng);
    std::vector<float> out_a(rows * qw), out_b(rows * qw);
    for (auto [f, out] : {std::pair{a, &out_a}, std::pair{b, &out_b}}) {
      ASSERT_TRUE(StepAllLayers(f->agent.get(), kind, ids, {q.data(), k.data(), v.data(), out->data()}).ok());
    }
    EXPECT_EQ(out_a, out_b) << "step " << step;
    if (after_step) after_step(step);
  }
}

// KvConfig::seed_rows: a row cache seeded at prefill with every quantized token (the store-only
// prefill given q) serves every later selection without a fetch, and, with only the selection
// attended, changes no output or selection against the same run unseeded (which fetches).
TEST(AgentTest, ARowCacheSeededAtPrefillFetchesNothingItHoldsAndChangesNoOutput) {
  std::mt19937 rng(31);
  const int n = 200;  // 192 quantized keys at R = 64
  Prompt p(n, rng);
  KvConfig plain = Config(KvMode::kSpeCache, 1, 16);
  plain.cached_rows = 256;
  KvConfig seeded = plain;
  seeded.seed_rows = 256;  // more than the candidates: all 192
  Fixture a(plain), b(seeded);
  PrefillSideBySide(&a, &b, &p, n);
  EXPECT_GT(b.agent->stats().device_bytes, a.agent->stats().device_bytes);  // the seeds' rows
  DecodeSideBySide(&a, &b, 4, rng, [&](int step) {
    for (int l = 0; l < kShape.n_layers; ++l) {
      EXPECT_EQ(*a.agent->SelectedTokens(3, l, 1), *b.agent->SelectedTokens(3, l, 1)) << "step " << step;
    }
  });
  const AgentStats sa = a.agent->stats(), sb = b.agent->stats();
  EXPECT_EQ(sa.rows_selected, sb.rows_selected);
  EXPECT_GT(sa.rows_fetched, 0);
  EXPECT_EQ(sb.rows_fetched, 0);
  EXPECT_EQ(sb.rows_reused, sb.rows_selected);
  EXPECT_EQ(sb.bytes_fetched, 0);
}

// KvConfig::round_host_rows rounds what goes to the source, not the seeds: they come from the
// prompt's own rows (on a GPU they never leave the device). With every candidate seeded nothing is
// fetched, so an agent whose source rows are rounded decodes exactly as one whose are not.
TEST(AgentTest, SeedsKeepThePromptsOwnRowsWhenTheSourcesAreRounded) {
  std::mt19937 rng(37);
  const int n = 200;  // 192 quantized keys at R = 64
  Prompt p(n, rng);
  KvConfig plain = Config(KvMode::kSpeCache, 1, 16);
  plain.cached_rows = 256;
  plain.seed_rows = 256;  // every candidate
  KvConfig rounded = plain;
  rounded.round_host_rows = HostRowRounding::kInt8;
  Fixture a(plain), b(rounded);
  PrefillSideBySide(&a, &b, &p, n);
  DecodeSideBySide(&a, &b, 4, rng);
  EXPECT_EQ(b.agent->stats().rows_fetched, 0);
  // The source's rows themselves are rounded (host_row_rounding_test.cc checks their values).
  std::vector<Half> row_a(2 * 64), row_b(2 * 64);
  const int32_t token = 5;
  ASSERT_TRUE(a.source.ReadRows(3, 0, 0, &token, 1, row_a.data()).ok());
  ASSERT_TRUE(b.source.ReadRows(3, 0, 0, &token, 1, row_b.data()).ok());
  EXPECT_NE(row_a, row_b);
}

// KvConfig::seed_rows in part, in a ragged batch with GQA: each (sequence, layer, KV head)'s cache
// starts with cpu::SeedTokens of its own last prompt token's query heads over its own keys, so
// the pre-decode step's fetch reuses exactly the selected tokens among those seeds; then steps
// overflow the cache (the seeds leave first) with the counts consistent, the selection alone or
// every resident row attended.
TEST(AgentTest, ASeededRowCacheHoldsEachSequencesLastQueryBestRows) {
  for (bool resident : {false, true}) {
    std::mt19937 rng(41);
    const int lengths[] = {150, 260};  // 128 and 256 quantized keys at R = 64
    Prompt p(lengths[0] + lengths[1], rng);
    KvConfig c = Config(KvMode::kSpeCache, 1, 16);
    c.cached_rows = 48;
    c.seed_rows = 24;
    c.attend_resident = resident;
    Fixture f(c);
    const SequenceId ids[] = {7, 9};
    const int32_t offsets[] = {0, lengths[0], lengths[0] + lengths[1]};
    for (SequenceId id : ids) ASSERT_TRUE(f.agent->AddSequence(id).ok());
    for (int l = 0; l < kShape.n_layers; ++l) {
      ASSERT_TRUE(f.agent->PrefillLayer(l, {ids, offsets, p.q.data(), p.k.data(), p.v.data(), nullptr}).ok());
    }
    const int group = kShape.n_q_heads / kShape.n_kv_heads, d = kShape.head_dim;
    std::vector<std::vector<int32_t>> seeds;  // [sequence][kv head]: the same for both layers
    for (int s = 0; s < 2; ++s) {
      for (int h = 0; h < kShape.n_kv_heads; ++h) {
        std::vector<Half> keys(size_t(lengths[s]) * d);
        for (int t = 0; t < lengths[s]; ++t) {
          for (int e = 0; e < d; ++e) {
            keys[size_t(t) * d + e] = FloatToHalf(p.k[(size_t(offsets[s] + t) * kShape.n_kv_heads + h) * d + e]);
          }
        }
        const float* last_q = p.q.data() + (size_t(offsets[s + 1] - 1) * kShape.n_q_heads + size_t(h) * group) * d;
        seeds.emplace_back();
        cpu::SeedTokens(last_q, keys.data(), group, lengths[s], d, 1.0f / 8.0f, lengths[s] / 64 * 64, 24,
                        GroupReduction::kMean, &seeds.back());
        ASSERT_EQ(seeds.back().size(), 24u);
      }
    }
    const size_t qw = 4 * 64, kw = 2 * 64;
    for (int step = 0; step < 6; ++step) {
      const StepKind kind = step == 0 ? StepKind::kPreDecode : StepKind::kDecode;
      const int rows = 2 * f.agent->RowsPerSequence(kind);
      std::vector<float> q = testing::RandomFloats(rows * qw, rng, 0.5f), k = testing::RandomFloats(rows * kw, rng),
                         v = testing::RandomFloats(rows * kw, rng), out(rows * qw);
      ASSERT_TRUE(StepAllLayers(f.agent.get(), kind, ids, {q.data(), k.data(), v.data(), out.data()}).ok());
      for (float x : out) ASSERT_TRUE(std::isfinite(x));
      const AgentStats st = f.agent->stats();
      EXPECT_EQ(st.rows_fetched + st.rows_reused, st.rows_selected) << "step " << step;
      if (step == 0) {  // the first fetch: its hits are exactly the selected seeds
        int64_t hits = 0;
        for (int s = 0; s < 2; ++s) {
          for (int l = 0; l < kShape.n_layers; ++l) {
            for (int h = 0; h < kShape.n_kv_heads; ++h) {
              const std::vector<int32_t> sel = *f.agent->SelectedTokens(ids[s], l, h);
              const std::vector<int32_t>& seed = seeds[size_t(s) * kShape.n_kv_heads + h];
              std::vector<int32_t> common;
              std::set_intersection(sel.begin(), sel.end(), seed.begin(), seed.end(), std::back_inserter(common));
              hits += static_cast<int64_t>(common.size());
            }
          }
        }
        EXPECT_EQ(st.rows_reused, hits) << "resident " << resident;
        EXPECT_GT(hits, 0);
      }
    }
  }
}

// A prefill without the prompt's queries cannot seed: refused, nothing stored.
TEST(AgentTest, SeedRowsNeedThePrefillsQueries) {
  std::mt19937 rng(2);
  Prompt p(100, rng);
  KvConfig c = Config(KvMode::kSpeCache, 1, 16);
  c.seed_rows = 8;
  Fixture f(c);
  const SequenceId ids[] = {1};
  const int32_t offsets[] = {0, 100};
  ASSERT_TRUE(f.agent->AddSequence(1).ok());
  EXPECT_EQ(f.agent->PrefillLayer(0, {ids, offsets, nullptr, p.k.data(), p.v.data(), nullptr}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(*f.agent->SequenceLength(1), 0);
}

// A source whose reads complete only when finished (as rows coming over the network do): the
// agent starts them in StartPrefetch and finishes them in WaitPrefetch, or in DecodeLayer when the
// engine did not wait, with the same outputs as a source that reads at once.
class DeferredSource final : public testing::ForwardingSource {
 public:
  DeferredSource() : ForwardingSource(/*zero_copy=*/false) {}
  Result<uint64_t> StartReadRows(SequenceId s, int l, int h, const int32_t* t, int32_t n, Half* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    reads_[++next_] = {s, l, h, t, n, out};
    return next_;
  }
  Status FinishReadRows(uint64_t read) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = reads_.find(read);
    if (it == reads_.end()) return Status::InvalidArgument("read finished twice or never started");
    const Read r = it->second;
    reads_.erase(it);
    return rows().ReadRows(r.s, r.l, r.h, r.t, r.n, r.out);
  }
  size_t outstanding() {
    std::lock_guard<std::mutex> lock(mu_);
    return reads_.size();
  }
  // Releases made while a read of that sequence was begun and not finished.
  Status ReleaseSequence(SequenceId id) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& entry : reads_) released_while_read_ += entry.second.s == id ? 1 : 0;
    }
    return ForwardingSource::ReleaseSequence(id);
  }
  int released_while_read() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_while_read_;
  }

 private:
  struct Read {
    SequenceId s;
    int l, h;
    const int32_t* t;
    int32_t n;
    Half* out;
  };
  std::mutex mu_;
  std::map<uint64_t, Read> reads_;
  uint64_t next_ = 0;
  int released_while_read_ = 0;
};

// An agent dropped with sequences still registered (in the middle of a step, a read of the
// source begun) finishes its reads, then releases them in the source, as ReleaseSequence would:
// their rows are freed and a later agent over the same source can add the same ids. A sequence
// the source refuses to release stays there, and the agent still goes.
TEST(AgentTest, ADroppedAgentReleasesItsSequencesInTheSource) {
  DeferredSource source;  // reads finish when the agent asks
  std::mt19937 rng(4);
  Prompt p(350, rng);  // past the residual window: the speculative rows' selection reads the source
  const SequenceId ids[] = {1, 2};
  const int32_t offsets[] = {0, 200, 350};
  {
    auto agent = CreateCpuAgent(kShape, Config(KvMode::kSpeCache), &source);
    ASSERT_TRUE(agent.ok()) << agent.status().ToString();
    for (SequenceId id : ids) ASSERT_TRUE((*agent)->AddSequence(id).ok());
    ASSERT_TRUE(PrefillAll(agent->get(), ids, offsets, &p).ok());
    ASSERT_TRUE((*agent)->AddSequence(3).ok());
    ASSERT_TRUE((*agent)->ReleaseSequence(3).ok());
    EXPECT_GT(source.stored_bytes(), 0);
    std::vector<float> q(2 * 2 * kShape.n_q_heads * kShape.head_dim), k(2 * 2 * kShape.n_kv_heads * kShape.head_dim),
        v(k.size()), out(q.size());
    ASSERT_TRUE((*agent)->BeginStep(StepKind::kPreDecode, ids).ok());
    ASSERT_TRUE((*agent)->DecodeLayer(0, {q.data(), k.data(), v.data(), out.data()}).ok());
    ASSERT_TRUE((*agent)->StartPrefetch(0).ok());  // dropped with a fetch begun, inside the step
    ASSERT_GT(source.outstanding(), 0u);
  }
  EXPECT_EQ(source.outstanding(), 0u);
  EXPECT_EQ(source.released_while_read(), 0);
  EXPECT_EQ(source.stored_bytes(), 0);
  for (SequenceId id : ids) EXPECT_EQ(source.Length(id, 0, 0).status().code(), StatusCode::kNotFound);
  auto again = CreateCpuAgent(kShape, Config(KvMode::kSpeCache), &source);
  ASSERT_TRUE(again.ok());
  for (SequenceId id : ids) EXPECT_TRUE((*again)->AddSequence(id).ok());

  // A source that refuses every release: the sequences stay in it, and dropping the agent is
  // quiet. Refused as unreachable (a daemon gone), the agent stops asking at the first.
  struct Refusing : testing::ForwardingSource {
    explicit Refusing(Status answer) : ForwardingSource(true), answer(std::move(answer)) {}
    Status ReleaseSequence(SequenceId) override {
      ++calls;
      return answer;
    }
    Status answer;
    int calls = 0;
  };
  for (const Status& answer : {Status::FailedPrecondition("not now"), Status::Unavailable("no daemon"),
                               Status::DeadlineExceeded("cut off")}) {
    Refusing refusing(answer);
    {
      auto agent = CreateCpuAgent(kShape, Config(KvMode::kSpeCache), &refusing);
      ASSERT_TRUE(agent.ok());
      for (SequenceId id : {7, 8, 9}) ASSERT_TRUE((*agent)->AddSequence(id).ok());
    }
    for (SequenceId id : {7, 8, 9}) EXPECT_TRUE(refusing.Length(id, 0, 0).ok()) << answer.ToString();
    EXPECT_EQ(refusing.calls, answer.code() == StatusCode::kFailedPrecondition ? 3 : 1) << answer.ToString();
  }
}

TEST(AgentTest, ReadsFinishedLaterGiveTheSameOutputsAsReadsAtOnce) {
  std::mt19937 rng(9);
  const int n = 200;
  Prompt p(n, rng);
  const SequenceId ids[] = {5};
  const int32_t offsets[] = {0, n};
  Fixture at_once(Config(KvMode::kSpeCache, 1, 16));
  DeferredSource deferred;
  auto later = CreateCpuAgent(kShape, Config(KvMode::kSpeCache, 1, 16), &deferred);
  ASSERT_TRUE(later.ok()) << later.status().ToString();
  Prompt p2 = p;
  for (Agent* a : {at_once.agent.get(), later->get()}) {
    ASSERT_TRUE(a->AddSequence(5).ok());
    ASSERT_TRUE(PrefillAll(a, ids, offsets, a == at_once.agent.get() ? &p : &p2).ok());
  }
  const size_t qw = 4 * 64, kw = 2 * 64;
  for (int step = 0; step < 4; ++step) {
    const StepKind kind = step == 0 ? StepKind::kPreDecode : StepKind::kDecode;
    const int rows = at_once.agent->RowsPerSequence(kind);
    std::vector<float> q = testing::RandomFloats(rows * qw, rng, 0.5f), k = testing::RandomFloats(rows * kw, rng),
                       v = testing::RandomFloats(rows * kw, rng), out1(rows * qw), out2(rows * qw);
    ASSERT_TRUE(at_once.agent->BeginStep(kind, ids).ok());
    ASSERT_TRUE((*later)->BeginStep(kind, ids).ok());
    for (int l = 0; l < kShape.n_layers; ++l) {
      ASSERT_TRUE(at_once.agent->DecodeLayer(l, {q.data(), k.data(), v.data(), out1.data()}).ok());
      ASSERT_TRUE((*later)->DecodeLayer(l, {q.data(), k.data(), v.data(), out2.data()}).ok());
      EXPECT_EQ(out1, out2) << "step " << step << " layer " << l;
      ASSERT_TRUE(at_once.agent->StartPrefetch(l).ok());
      ASSERT_TRUE((*later)->StartPrefetch(l).ok());
      // Layer 0 is waited for; layer 1 is left to the next step's DecodeLayer.
      if (l == 0) {
        ASSERT_TRUE((*later)->WaitPrefetch(l).ok());
      }
    }
    ASSERT_TRUE(at_once.agent->EndStep().ok());
    ASSERT_TRUE((*later)->EndStep().ok());
    // Layer 1's reads (at most one per KV head) wait for the next step; layer 0's are done.
    EXPECT_GT(deferred.outstanding(), 0u);
    EXPECT_LE(deferred.outstanding(), 2u);
  }
  EXPECT_EQ(at_once.agent->stats().rows_fetched, (*later)->stats().rows_fetched);
  ASSERT_TRUE((*later)->ReleaseSequence(5).ok());  // finishes what is still begun
  EXPECT_EQ(deferred.outstanding(), 0u);
}

}  // namespace
}  // namespace specache
