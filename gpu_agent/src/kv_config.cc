#include "specache/kv_config.h"

#include <string>

namespace specache {
namespace {

bool SupportedBits(int bits) { return bits == 1 || bits == 2 || bits == 4 || bits == 16; }

}  // namespace

Status ValidateModelShape(const ModelShape& s) {
  if (s.n_layers <= 0 || s.n_q_heads <= 0 || s.n_kv_heads <= 0 || s.head_dim <= 0) {
    return Status::InvalidArgument("model shape needs positive n_layers, n_q_heads, n_kv_heads, head_dim; got " +
                                   std::to_string(s.n_layers) + ", " + std::to_string(s.n_q_heads) + ", " +
                                   std::to_string(s.n_kv_heads) + ", " + std::to_string(s.head_dim));
  }
  if (s.n_q_heads % s.n_kv_heads != 0) {
    return Status::InvalidArgument("n_q_heads (" + std::to_string(s.n_q_heads) + ") is not a multiple of n_kv_heads (" +
                                   std::to_string(s.n_kv_heads) + ")");
  }
  if (s.head_dim % 8 != 0) {
    return Status::InvalidArgument("head_dim (" + std::to_string(s.head_dim) + ") must be a multiple of 8");
  }
  return Status::Ok();
}

std::string_view KvModeName(KvMode mode) {
  switch (mode) {
    case KvMode::kFull: return "full";
    case KvMode::kKivi: return "kivi";
    case KvMode::kSpeCache: return "specache";
    case KvMode::kSpeCacheNonSpec: return "specache-nonspec";
    case KvMode::kSpeCacheOracle: return "specache-oracle";
  }
  return "?";
}

Result<KvMode> ParseKvMode(std::string_view name) {
  for (KvMode m : {KvMode::kFull, KvMode::kKivi, KvMode::kSpeCache, KvMode::kSpeCacheNonSpec, KvMode::kSpeCacheOracle}) {
    if (KvModeName(m) == name) return m;
  }
  return Status::InvalidArgument("unknown KV mode '" + std::string(name) +
                                 "' (expected full, kivi, specache, specache-nonspec or specache-oracle)");
}

std::string_view GroupReductionName(GroupReduction reduction) {
  return reduction == GroupReduction::kMean ? "mean" : "max";
}

Result<GroupReduction> ParseGroupReduction(std::string_view name) {
  if (name == "mean") return GroupReduction::kMean;
  if (name == "max") return GroupReduction::kMax;
  return Status::InvalidArgument("unknown GQA reduction '" + std::string(name) + "' (expected mean or max)");
}

std::string_view SelectFromName(SelectFrom select) {
  switch (select) {
    case SelectFrom::kSpeculative: return "spec";
    case SelectFrom::kReal: return "real";
    case SelectFrom::kUnion: return "union";
  }
  return "?";
}

Result<SelectFrom> ParseSelectFrom(std::string_view name) {
  for (SelectFrom s : {SelectFrom::kSpeculative, SelectFrom::kReal, SelectFrom::kUnion}) {
    if (SelectFromName(s) == name) return s;
  }
  return Status::InvalidArgument("unknown selection '" + std::string(name) + "' (expected spec, real or union)");
}

std::string_view HostRowRoundingName(HostRowRounding rounding) {
  switch (rounding) {
    case HostRowRounding::kNone: return "none";
    case HostRowRounding::kInt8: return "int8";
    case HostRowRounding::kE4m3: return "e4m3";
    case HostRowRounding::kInt4: return "int4";
    case HostRowRounding::kInt4G16: return "int4-g16";
  }
  return "?";
}

Result<HostRowRounding> ParseHostRowRounding(std::string_view name) {
  for (HostRowRounding r : {HostRowRounding::kNone, HostRowRounding::kInt8, HostRowRounding::kE4m3, HostRowRounding::kInt4,
                            HostRowRounding::kInt4G16}) {
    if (name == HostRowRoundingName(r)) return r;
  }
  return Status::InvalidArgument("unknown host row rounding '" + std::string(name) + "' (expected none, int8, e4m3, int4 or int4-g16)");
}

Status ValidateKvConfig(const KvConfig& c, const ModelShape& shape) {
  SPECACHE_RETURN_IF_ERROR(ValidateModelShape(shape));
  SPECACHE_RETURN_IF_ERROR(CheckHostRowFormat(c.host_row_format, shape.head_dim));
  if (!SupportedBits(c.key_bits)) {
    return Status::InvalidArgument("key_bits " + std::to_string(c.key_bits) + " unsupported (1, 2, 4 or 16)");
  }
  if (!SupportedBits(c.value_bits)) {
    return Status::InvalidArgument("value_bits " + std::to_string(c.value_bits) + " unsupported (1, 2, 4 or 16)");
  }
  // Packing puts 32/B codes in a uint32 word; a group must fill whole words at every width.
  if (c.group_size <= 0 || c.group_size % 32 != 0) {
    return Status::InvalidArgument("group size G=" + std::to_string(c.group_size) + " must be a positive multiple of 32");
  }
  if (c.residual_tokens <= 0 || c.residual_tokens % c.group_size != 0) {
    return Status::InvalidArgument("residual R=" + std::to_string(c.residual_tokens) +
                                   " must be a positive multiple of G=" + std::to_string(c.group_size));
  }
  if (shape.head_dim % c.group_size != 0) {
    return Status::InvalidArgument("G=" + std::to_string(c.group_size) + " must divide head_dim=" +
                                   std::to_string(shape.head_dim) + " (values are grouped along channels)");
  }
  if (c.fetches_rows() && !c.adaptive() && c.top_k <= 0) {
    return Status::InvalidArgument("top_k must be positive in mode " + std::string(KvModeName(c.mode)));
  }
  if (c.top_k < 0) return Status::InvalidArgument("top_k must not be negative");
  if (c.top_k_real < 0) return Status::InvalidArgument("top_k_real must not be negative");
  if (!(c.mass >= 0 && c.mass <= 1)) return Status::InvalidArgument("mass must lie in [0, 1] (0: a fixed top_k)");
  if (c.adaptive() && (c.k_min < 1 || c.k_max < c.k_min)) {
    return Status::InvalidArgument("with a mass, k_min and k_max need 1 <= k_min <= k_max; got " +
                                   std::to_string(c.k_min) + " and " + std::to_string(c.k_max));
  }
  if (c.cached_rows < 0 || (c.cached_rows > 0 && c.cached_rows < c.max_selected())) {
    return Status::InvalidArgument("cached_rows must be 0 (twice the rows selected) or at least the rows selected (" +
                                   std::to_string(c.max_selected()) + ")");
  }
  if (c.seed_rows < 0 || (c.seed_rows > 0 && c.mode != KvMode::kSpeCache)) {
    return Status::InvalidArgument("seed_rows must be 0, or positive in specache mode (the row cache seeded at prefill)");
  }
  return Status::Ok();
}

std::string DescribeKvConfig(const KvConfig& c) {
  std::string s(KvModeName(c.mode));
  if (c.mode == KvMode::kFull) return s + " (fp16)";
  s += " K" + std::to_string(c.key_bits) + "/V" + std::to_string(c.value_bits) + " G=" + std::to_string(c.group_size) +
       " R=" + std::to_string(c.residual_tokens);
  if (c.fetches_rows()) {
    s += c.adaptive() ? " mass=" + std::to_string(c.mass).substr(0, 4) + " k=" + std::to_string(c.k_min) + ".." +
                            std::to_string(c.k_max)
                      : " k=" + std::to_string(c.top_k);
    s += " cache=" + std::to_string(c.cache_rows()) + " " + std::string(GroupReductionName(c.reduction));
    if (c.mode == KvMode::kSpeCache && c.select != SelectFrom::kSpeculative) {
      s += " select=" + std::string(SelectFromName(c.select));
      if (c.select == SelectFrom::kUnion) s += "+" + std::to_string(c.extra_rows());
      if (c.real_next) s += " next";
    }
    if (c.attend_resident) s += " attend-resident";
    if (c.seed_rows > 0) s += " seed=" + std::to_string(c.seed_rows);
  }
  if (c.host_row_format != HostRowFormat::kFp16) s += " host-rows=" + std::string(HostRowFormatName(c.host_row_format));
  if (c.round_host_rows != HostRowRounding::kNone) s += " host-round=" + std::string(HostRowRoundingName(c.round_host_rows));
  return s;
}

}  // namespace specache
