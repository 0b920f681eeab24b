#include "metrics.h"

#include <prometheus/exposer.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

namespace specache::daemon {

struct Metrics::Impl {
  std::unique_ptr<prometheus::Exposer> exposer;
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Family<prometheus::Gauge>* bytes = nullptr;
  prometheus::Family<prometheus::Gauge>* counts = nullptr;
  prometheus::Family<prometheus::Gauge>* tenant_bytes = nullptr;
  prometheus::Family<prometheus::Gauge>* kept_bytes = nullptr;
  prometheus::Family<prometheus::Gauge>* spill = nullptr;
};

Metrics::Metrics() : impl_(std::make_unique<Impl>()) {}
Metrics::~Metrics() = default;

Result<std::unique_ptr<Metrics>> Metrics::Start(const std::string& address) {
  std::unique_ptr<Metrics> m(new Metrics());
  try {
    m->impl_->exposer = std::make_unique<prometheus::Exposer>(address);
  } catch (const std::exception& e) {
    return Status::Unavailable("metrics endpoint " + address + ": " + e.what());
  }
  m->impl_->bytes = &prometheus::BuildGauge().Name("specache_pool_bytes").Help("Pool memory by state (huge_pages: mapped by huge pages at startup)").Register(*m->impl_->registry);
  m->impl_->counts = &prometheus::BuildGauge().Name("specache_objects").Help("Sessions, sequences, pages, requests, errors, refusals, attach connections, accept errors").Register(*m->impl_->registry);
  m->impl_->tenant_bytes = &prometheus::BuildGauge().Name("specache_tenant_bytes").Help("Memory per tenant").Register(*m->impl_->registry);
  m->impl_->kept_bytes = &prometheus::BuildGauge().Name("specache_kept_bytes").Help("Kept sequences: parked in RAM, spilled to disk only, in the spill store").Register(*m->impl_->registry);
  m->impl_->spill = &prometheus::BuildGauge().Name("specache_spill").Help("Spill tier: spills, restores, bytes, seconds, checksum failures, read errors, write errors, failed spills and the backoff, unreadable records, damaged sequences, kept sequences lost").Register(*m->impl_->registry);
  m->impl_->exposer->RegisterCollectable(m->impl_->registry);
  return m;
}

void Metrics::Update(const RegistryStats& s, const ServiceCounts& n) {
  Impl& i = *impl_;
  i.bytes->Add({{"state", "total"}}).Set(static_cast<double>(s.pool_bytes));
  i.bytes->Add({{"state", "reserved"}}).Set(static_cast<double>(s.reserved_bytes));
  i.bytes->Add({{"state", "used"}}).Set(static_cast<double>(s.used_bytes));
  i.bytes->Add({{"state", "free"}}).Set(static_cast<double>(s.free_bytes));
  if (s.pool_huge_bytes >= 0) i.bytes->Add({{"state", "huge_pages"}}).Set(static_cast<double>(s.pool_huge_bytes));
  i.counts->Add({{"kind", "sessions"}}).Set(s.sessions);
  i.counts->Add({{"kind", "sequences"}}).Set(s.sequences);
  i.counts->Add({{"kind", "pages"}}).Set(static_cast<double>(s.pages));
  i.counts->Add({{"kind", "requests"}}).Set(static_cast<double>(n.requests));
  i.counts->Add({{"kind", "errors"}}).Set(static_cast<double>(n.errors));
  i.counts->Add({{"kind", "denied"}}).Set(static_cast<double>(n.denied));
  i.counts->Add({{"kind", "attach_connections"}}).Set(static_cast<double>(n.attach_connections));
  i.counts->Add({{"kind", "refused_connections"}}).Set(static_cast<double>(n.refused_connections));
  i.counts->Add({{"kind", "accept_errors"}}).Set(static_cast<double>(n.accept_errors));
  i.counts->Add({{"kind", "remote_connections"}}).Set(static_cast<double>(n.remote_connections));
  i.counts->Add({{"kind", "remote_requests"}}).Set(static_cast<double>(n.remote_requests));
  i.counts->Add({{"kind", "remote_refused"}}).Set(static_cast<double>(n.remote_refused));
  i.counts->Add({{"kind", "remote_dropped"}}).Set(static_cast<double>(n.remote_dropped));
  i.counts->Add({{"kind", "chunks_out_of_service"}}).Set(static_cast<double>(s.chunks_out_of_service));
  i.counts->Add({{"kind", "sessions_reclaimed"}}).Set(static_cast<double>(s.sessions_reclaimed));
  i.kept_bytes->Add({{"state", "parked"}}).Set(static_cast<double>(s.kept.parked_bytes));
  i.kept_bytes->Add({{"state", "spilled"}}).Set(static_cast<double>(s.kept.spilled_bytes));
  i.kept_bytes->Add({{"state", "on_disk"}}).Set(static_cast<double>(s.kept.spill.stored_bytes));
  const SpillStats& sp = s.kept.spill;
  const std::pair<const char*, double> spill[] = {
      {"spills", static_cast<double>(sp.spills)},
      {"restores", static_cast<double>(sp.restores)},
      {"spilled_bytes_total", static_cast<double>(sp.spilled_bytes_total)},
      {"restored_bytes_total", static_cast<double>(sp.restored_bytes_total)},
      {"spill_seconds_total", sp.spill_seconds},
      {"restore_seconds_total", sp.restore_seconds},
      {"checksum_failures", static_cast<double>(sp.checksum_failures)},
      {"read_errors", static_cast<double>(sp.read_errors)},
      {"write_errors", static_cast<double>(sp.write_errors)},
      {"spill_failures", static_cast<double>(s.kept.spill_failures)},
      {"spill_backoff_ms", static_cast<double>(s.kept.spill_backoff_ms)},
      {"write_through_failures", static_cast<double>(s.kept.write_through_failures)},
      {"unreadable_records", static_cast<double>(sp.unreadable_records)},
      {"damaged_sequences", static_cast<double>(sp.damaged_sequences)},
      {"write_resumes", static_cast<double>(sp.resumes)},
      {"kept_lost", static_cast<double>(s.kept.dropped)},
      {"kept_evicted", static_cast<double>(s.kept.evicted)},
      {"kept_evicted_bytes", static_cast<double>(s.kept.evicted_bytes)}};
  for (const auto& [kind, value] : spill) i.spill->Add({{"kind", kind}}).Set(value);
  for (const TenantSummary& t : s.tenants) {
    i.tenant_bytes->Add({{"tenant", t.name}, {"state", "reserved"}}).Set(static_cast<double>(t.reserved_bytes));
    i.tenant_bytes->Add({{"tenant", t.name}, {"state", "used"}}).Set(static_cast<double>(t.used_bytes));
    i.tenant_bytes->Add({{"tenant", t.name}, {"state", "quota"}}).Set(static_cast<double>(t.quota_bytes));
    i.tenant_bytes->Add({{"tenant", t.name}, {"state", "retained"}}).Set(static_cast<double>(t.retained_bytes));
  }
}

}  // namespace specache::daemon
