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
  m->impl_->bytes = &prometheus::BuildGauge().Name("specache_pool_bytes").Help("Pool memory by state").Register(*m->impl_->registry);
  m->impl_->counts = &prometheus::BuildGauge().Name("specache_objects").Help("Sessions, sequences, pages, requests, errors").Register(*m->impl_->registry);
  m->impl_->tenant_bytes = &prometheus::BuildGauge().Name("specache_tenant_bytes").Help("Memory per tenant").Register(*m->impl_->registry);
  m->impl_->exposer->RegisterCollectable(m->impl_->registry);
  return m;
}

void Metrics::Update(const RegistryStats& s, uint64_t requests, uint64_t errors) {
  Impl& i = *impl_;
  i.bytes->Add({{"state", "total"}}).Set(static_cast<double>(s.pool_bytes));
  i.bytes->Add({{"state", "reserved"}}).Set(static_cast<double>(s.reserved_bytes));
  i.bytes->Add({{"state", "used"}}).Set(static_cast<double>(s.used_bytes));
  i.bytes->Add({{"state", "free"}}).Set(static_cast<double>(s.free_bytes));
  i.counts->Add({{"kind", "sessions"}}).Set(s.sessions);
  i.counts->Add({{"kind", "sequences"}}).Set(s.sequences);
  i.counts->Add({{"kind", "pages"}}).Set(static_cast<double>(s.pages));
  i.counts->Add({{"kind", "requests"}}).Set(static_cast<double>(requests));
  i.counts->Add({{"kind", "errors"}}).Set(static_cast<double>(errors));
  i.counts->Add({{"kind", "sessions_reclaimed"}}).Set(static_cast<double>(s.sessions_reclaimed));
  for (const TenantSummary& t : s.tenants) {
    i.tenant_bytes->Add({{"tenant", t.name}, {"state", "reserved"}}).Set(static_cast<double>(t.reserved_bytes));
    i.tenant_bytes->Add({{"tenant", t.name}, {"state", "used"}}).Set(static_cast<double>(t.used_bytes));
    i.tenant_bytes->Add({{"tenant", t.name}, {"state", "quota"}}).Set(static_cast<double>(t.quota_bytes));
  }
}

}  // namespace specache::daemon
