#include "agent_binding.h"

#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <string>
#include <vector>

#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/string_view.h>
#include <nanobind/stl/vector.h>

#ifdef SPECACHE_PY_CUDA
#include <cuda_runtime_api.h>
#endif

#include "specache/agent.h"
#include "specache/in_memory_source.h"
#include "status_error.h"
#include "tensor_args.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace specache::python {
namespace {

// The CUDA agent works on the device that was current when it was created; torch may have made
// another one current since, so every call runs with the agent's device current and puts the
// caller's back afterwards.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
#ifdef SPECACHE_PY_CUDA
    if (device >= 0 && cudaGetDevice(&previous_) == cudaSuccess && previous_ != device) {
      restore_ = cudaSetDevice(device) == cudaSuccess;
    }
#else
    (void)device;
#endif
  }
  ~DeviceScope() {
#ifdef SPECACHE_PY_CUDA
    if (restore_) (void)cudaSetDevice(previous_);
#endif
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

std::vector<SequenceId> SequenceIds(nb::handle values) {
  std::vector<int64_t> raw = ValueOrThrow(IntegerList(values, "sequences"));
  std::vector<SequenceId> ids;
  ids.reserve(raw.size());
  for (int64_t v : raw) {
    if (v < 0) ThrowIfError(Status::InvalidArgument("sequences: ids are non-negative"));
    ids.push_back(static_cast<SequenceId>(v));
  }
  return ids;
}

// The agent with what the binding must know to check tensors: where it computes and the shape of
// the current step (n sequences x rows), which the agent itself only knows as raw pointers.
class PyAgent {
 public:
  PyAgent(const ModelShape& shape, const KvConfig& config, FullPrecisionSource* source, const std::string& backend,
          int device, uintptr_t stream, int capacity_tokens, int fetch_blocks, int64_t device_pool_bytes) {
    if (source == nullptr) {
      owned_source_ = std::make_unique<InMemorySource>();
      source = owned_source_.get();
    }
    if (backend == "cpu") {
      agent_ = ValueOrThrow(CreateCpuAgent(shape, config, source));
    } else if (backend == "cuda") {
      if (device < 0) ThrowIfError(Status::InvalidArgument("device: a CUDA device index >= 0 is needed"));
      device_ = {2, device};
      cuda_device_ = device;
      CudaAgentOptions options;
      options.capacity_tokens = capacity_tokens;
      options.stream = reinterpret_cast<void*>(stream);
      options.fetch_blocks = fetch_blocks;
      options.device_pool_bytes = device_pool_bytes;
      DeviceScope scope(device);
      agent_ = ValueOrThrow(CreateCudaAgent(shape, config, source, options));
    } else {
      ThrowIfError(Status::InvalidArgument("backend must be 'cpu' or 'cuda', not '" + backend + "'"));
    }
  }

  // Destroying the agent waits for its device work and releases its sequences in the source (a
  // call to a daemon each): without the GIL, so that the process's other Python threads run
  // meanwhile (none can be in this agent: it has no references left), but while the interpreter
  // finalizes, when threads must not take the GIL back and forth.
  ~PyAgent() {
    if (PyGILState_Check() && !InterpreterFinalizing()) {
      nb::gil_scoped_release release;
      Destroy();
    } else {
      Destroy();
    }
  }

  // Copies: a Python object that referred to the agent's own would let its fields be assigned,
  // and the agent would index its tables by the new values.
  ModelShape shape() const { return agent_->shape(); }
  KvConfig config() const { return agent_->config(); }
  std::string backend() const { return std::string(agent_->backend_name()); }
  int device() const { return cuda_device_; }
  int RowsPerSequence(StepKind kind) const { return agent_->RowsPerSequence(kind); }

  // Below 2**63: the other calls take ids in lists of int64 (IntegerList), which could not name it.
  void AddSequence(SequenceId id) {
    if (id > static_cast<SequenceId>(INT64_MAX)) {
      ThrowIfError(Status::InvalidArgument("sequence ids are below 2**63 (the calls that take lists of them read int64)"));
    }
    Run([&] { return agent_->AddSequence(id); });
  }
  void ReleaseSequence(SequenceId id) { Run([&] { return agent_->ReleaseSequence(id); }); }
  int32_t SequenceLength(SequenceId id) { return ValueOrThrow(Locked([&] { return agent_->SequenceLength(id); })); }

  void PrefillLayer(int layer, nb::handle sequences, nb::handle token_offsets, std::optional<nb::ndarray<>> q,
                    const nb::ndarray<>& k, const nb::ndarray<>& v, std::optional<nb::ndarray<>> out) {
    const std::vector<SequenceId> ids = SequenceIds(sequences);
    const std::vector<int64_t> raw_offsets = ValueOrThrow(IntegerList(token_offsets, "token_offsets"));
    if (raw_offsets.size() != ids.size() + 1 || raw_offsets.empty() || raw_offsets[0] != 0) {
      ThrowIfError(Status::InvalidArgument("token_offsets: len(sequences) + 1 offsets starting at 0 are needed"));
    }
    std::vector<int32_t> offsets;
    for (size_t i = 0; i < raw_offsets.size(); ++i) {
      if (i > 0 && raw_offsets[i] <= raw_offsets[i - 1]) {
        ThrowIfError(Status::InvalidArgument("token_offsets: must increase (every sequence has >= 1 token)"));
      }
      if (raw_offsets[i] > INT32_MAX) ThrowIfError(Status::InvalidArgument("token_offsets: beyond int32"));
      offsets.push_back(static_cast<int32_t>(raw_offsets[i]));
    }
    const ModelShape& s = agent_->shape();
    const int64_t tokens = offsets.back();
    PrefillBatch batch;
    batch.sequences = ids;
    batch.token_offsets = offsets;
    batch.k = ValueOrThrow(FloatTensor(k, "k", device_, tokens, {s.n_kv_heads, s.head_dim}));
    batch.v = ValueOrThrow(FloatTensor(v, "v", device_, tokens, {s.n_kv_heads, s.head_dim}));
    if (q.has_value() != out.has_value()) {
      ThrowIfError(Status::InvalidArgument("q and out: give both (attention) or neither (store only)"));
    }
    if (q) {
      batch.q = ValueOrThrow(FloatTensor(*q, "q", device_, tokens, {s.n_q_heads, s.head_dim}));
      batch.out = ValueOrThrow(FloatTensor(*out, "out", device_, tokens, {s.n_q_heads, s.head_dim}));
    }
    Run([&] { return agent_->PrefillLayer(layer, batch); });
  }

  void BeginStep(StepKind kind, nb::handle sequences) {
    const std::vector<SequenceId> ids = SequenceIds(sequences);
    Run([&] {
      Status s = agent_->BeginStep(kind, ids);
      if (s.ok()) {
        step_sequences_ = static_cast<int64_t>(ids.size());
        step_rows_ = agent_->RowsPerSequence(kind);
        ++step_number_;
      }
      return s;
    });
  }

  void DecodeLayer(int layer, const nb::ndarray<>& q, const nb::ndarray<>& k, const nb::ndarray<>& v,
                   const nb::ndarray<>& out) {
    // The rows of the step now; the tensors are checked against them without the lock, so the call
    // below refuses to run if another thread ended the step and began another meanwhile.
    const auto [step_rows, step] = Locked([&]() -> std::pair<std::optional<int64_t>, uint64_t> {
      if (!step_rows_) return {std::nullopt, step_number_};
      return {step_sequences_ * *step_rows_, step_number_};
    });
    if (!step_rows) {
      ThrowIfError(Status::FailedPrecondition("decode_layer outside a step: call begin_step first"));
    }
    const ModelShape& s = agent_->shape();
    const int64_t rows = *step_rows;
    DecodeRows r;
    r.q = ValueOrThrow(FloatTensor(q, "q", device_, rows, {s.n_q_heads, s.head_dim}));
    r.k = ValueOrThrow(FloatTensor(k, "k", device_, rows, {s.n_kv_heads, s.head_dim}));
    r.v = ValueOrThrow(FloatTensor(v, "v", device_, rows, {s.n_kv_heads, s.head_dim}));
    r.out = ValueOrThrow(FloatTensor(out, "out", device_, rows, {s.n_q_heads, s.head_dim}));
    Run([&] {
      if (!step_rows_ || step_number_ != step) {
        return Status::FailedPrecondition("decode_layer: the step ended (another thread) while its tensors were checked");
      }
      return agent_->DecodeLayer(layer, r);
    });
  }

  void StartPrefetch(int layer) { Run([&] { return agent_->StartPrefetch(layer); }); }
  void WaitPrefetch(int layer) { Run([&] { return agent_->WaitPrefetch(layer); }); }
  void EndStep() {
    Run([&] {
      Status s = agent_->EndStep();
      if (s.ok()) step_rows_.reset();
      return s;
    });
  }
  void AbortStep() {
    Locked([&] {
      agent_->AbortStep();
      step_rows_.reset();
      return 0;
    });
  }

  std::vector<int32_t> SelectedTokens(SequenceId id, int layer, int kv_head) {
    return ValueOrThrow(Locked([&] { return agent_->SelectedTokens(id, layer, kv_head); }));
  }

  nb::dict Stats() {
    const AgentStats st = Locked([&] { return agent_->stats(); });
    nb::dict d;
    d["device_bytes"] = st.device_bytes;
    d["device_bytes_reserved"] = st.device_bytes_reserved;
    d["device_pool_bytes"] = st.device_pool_bytes;
    d["device_pool_used_bytes"] = st.device_pool_used_bytes;
    d["full_precision_bytes"] = st.full_precision_bytes;
    d["rows_selected"] = st.rows_selected;
    d["rows_fetched"] = st.rows_fetched;
    d["rows_reused"] = st.rows_reused;
    d["bytes_fetched"] = st.bytes_fetched;
    d["steps"] = st.steps;
    d["commits_failed"] = st.commits_failed;
    d["fetch_host_list_wait_ns"] = st.fetch_host_list_wait_ns;
    d["fetch_host_buffer_wait_ns"] = st.fetch_host_buffer_wait_ns;
    d["fetch_host_gather_ns"] = st.fetch_host_gather_ns;
    d["fetch_caller_wait_ns"] = st.fetch_caller_wait_ns;
    return d;
  }

 private:
  // Calls into the agent without the GIL (attention, top-k, fetches and appends can take
  // milliseconds; other Python threads run meanwhile), with the agent's device current, and one
  // call at a time: the agent is single-threaded (agent.h), and with the GIL released two Python
  // threads could otherwise enter it together. The GIL is dropped before the lock is taken and
  // never wanted while it is held, so the two cannot deadlock.
  template <typename F>
  std::invoke_result_t<F> Locked(F&& call) {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    DeviceScope scope(cuda_device_);
    return call();
  }
  template <typename F>
  void Run(F&& call) {
    ThrowIfError(Locked(std::forward<F>(call)));
  }

  void Destroy() {
    DeviceScope scope(cuda_device_);
    agent_.reset();
  }
  static bool InterpreterFinalizing() {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
  }

  std::mutex mu_;                                 // one call into agent_ at a time
  std::unique_ptr<InMemorySource> owned_source_;  // when no source was given; outlives agent_
  std::unique_ptr<Agent> agent_;
  TensorDevice device_;
  int cuda_device_ = -1;
  int64_t step_sequences_ = 0;
  std::optional<int> step_rows_;  // set between a successful begin_step and end_step / abort_step
  uint64_t step_number_ = 0;      // successful begin_steps so far
};

}  // namespace

void BindAgent(nb::module_& m) {
  nb::class_<ModelShape>(m, "ModelShape", "Attention shapes of the model (GQA: n_q_heads a multiple of n_kv_heads).")
      .def(nb::init<>())
      .def(
          "__init__",
          [](ModelShape* self, int n_layers, int n_q_heads, int n_kv_heads, int head_dim) {
            new (self) ModelShape{n_layers, n_q_heads, n_kv_heads, head_dim};
            ThrowIfError(ValidateModelShape(*self));
          },
          "n_layers"_a, "n_q_heads"_a, "n_kv_heads"_a, "head_dim"_a)
      .def_rw("n_layers", &ModelShape::n_layers)
      .def_rw("n_q_heads", &ModelShape::n_q_heads)
      .def_rw("n_kv_heads", &ModelShape::n_kv_heads)
      .def_rw("head_dim", &ModelShape::head_dim)
      .def("__repr__", [](const ModelShape& s) {
        return "ModelShape(n_layers=" + std::to_string(s.n_layers) + ", n_q_heads=" + std::to_string(s.n_q_heads) +
               ", n_kv_heads=" + std::to_string(s.n_kv_heads) + ", head_dim=" + std::to_string(s.head_dim) + ")";
      });

  nb::class_<KvConfig>(m, "KvConfig",
                       "How the agent keeps the KV cache: mode (full, kivi, specache, specache-nonspec), key and "
                       "value bits (1, 2, 4, 16), group size G, residual window R, top_k k, cached_rows, reduction "
                       "(mean, max), host_row_format (fp16, int8: how host memory stores the full-precision rows; "
                       "int8 halves their bytes), round_host_rows (none, int8, e4m3: fp16 "
                       "rows rounded to an 8-bit format's values, CPU backend only; a fidelity measure). "
                       "bits= sets key_bits and value_bits together.")
      .def(
          "__init__",
          [](KvConfig* self, const std::string& mode, std::optional<int> bits, int key_bits, int value_bits,
             int group_size, int residual_tokens, int top_k, int cached_rows, const std::string& reduction,
             const std::string& round_host_rows, const std::string& host_row_format) {
            KvConfig c;
            c.mode = ValueOrThrow(ParseKvMode(mode));
            c.key_bits = bits.value_or(key_bits);
            c.value_bits = bits.value_or(value_bits);
            c.group_size = group_size;
            c.residual_tokens = residual_tokens;
            c.top_k = top_k;
            c.cached_rows = cached_rows;
            c.reduction = ValueOrThrow(ParseGroupReduction(reduction));
            c.round_host_rows = ValueOrThrow(ParseHostRowRounding(round_host_rows));
            c.host_row_format = ValueOrThrow(ParseHostRowFormat(host_row_format));
            new (self) KvConfig(c);
          },
          "mode"_a = "specache", "bits"_a = nb::none(), "key_bits"_a = 1, "value_bits"_a = 1, "group_size"_a = 32,
          "residual_tokens"_a = 64, "top_k"_a = 64, "cached_rows"_a = 0, "reduction"_a = "mean",
          "round_host_rows"_a = "none", "host_row_format"_a = "fp16")
      .def_prop_rw(
          "mode", [](const KvConfig& c) { return std::string(KvModeName(c.mode)); },
          [](KvConfig& c, const std::string& name) { c.mode = ValueOrThrow(ParseKvMode(name)); })
      .def_rw("key_bits", &KvConfig::key_bits)
      .def_rw("value_bits", &KvConfig::value_bits)
      .def_rw("group_size", &KvConfig::group_size)
      .def_rw("residual_tokens", &KvConfig::residual_tokens)
      .def_rw("top_k", &KvConfig::top_k)
      .def_rw("cached_rows", &KvConfig::cached_rows)
      .def_prop_rw(
          "reduction", [](const KvConfig& c) { return std::string(GroupReductionName(c.reduction)); },
          [](KvConfig& c, const std::string& name) { c.reduction = ValueOrThrow(ParseGroupReduction(name)); })
      .def_prop_rw(
          "round_host_rows", [](const KvConfig& c) { return std::string(HostRowRoundingName(c.round_host_rows)); },
          [](KvConfig& c, const std::string& name) { c.round_host_rows = ValueOrThrow(ParseHostRowRounding(name)); })
      .def_prop_rw(
          "host_row_format", [](const KvConfig& c) { return std::string(HostRowFormatName(c.host_row_format)); },
          [](KvConfig& c, const std::string& name) { c.host_row_format = ValueOrThrow(ParseHostRowFormat(name)); })
      .def("validate", [](const KvConfig& c, const ModelShape& s) { ThrowIfError(ValidateKvConfig(c, s)); },
           "shape"_a, "Raises StatusError(INVALID_ARGUMENT) when the config cannot be used with the shape.")
      .def("describe", [](const KvConfig& c) { return DescribeKvConfig(c); },
           "One line, e.g. 'specache K1/V1 G=32 R=64 k=64 mean'.")
      .def("__repr__", [](const KvConfig& c) { return "KvConfig(" + DescribeKvConfig(c) + ")"; });

  nb::enum_<StepKind>(m, "StepKind", "Kind of a step: PRE_DECODE (specache mode only, once) or DECODE.")
      .value("PRE_DECODE", StepKind::kPreDecode)
      .value("DECODE", StepKind::kDecode);

  nb::class_<FullPrecisionSource>(m, "FullPrecisionSource",
                                  "Where the full-precision KV rows live (InMemorySource or DaemonSource).")
      .def_prop_ro("stored_bytes", &FullPrecisionSource::stored_bytes)
      .def_prop_ro("page_tokens", &FullPrecisionSource::page_tokens);

  nb::class_<InMemorySource, FullPrecisionSource>(
      m, "InMemorySource", "Full-precision rows in this process's memory, laid out like the daemon's pages.")
      .def(nb::init<int32_t, size_t>(), "page_tokens"_a = 64, "slab_bytes"_a = size_t{4} << 20);

  nb::class_<PyAgent>(m, "Agent",
                      "The SpeCache agent (specache/agent.h). backend 'cpu' takes host float32 tensors; 'cuda' "
                      "takes float32 tensors on `device` and queues its work on `stream` (a cudaStream_t as int; "
                      "capacity_tokens, fetch_blocks and device_pool_bytes as in CudaAgentOptions; "
                      "specache.Agent in Python passes torch's current stream). Tensors are used in place "
                      "(DLPack, no copies): float32, C-contiguous, [rows, heads, head_dim] or [batch, rows, "
                      "heads, head_dim]. `source` defaults to an InMemorySource owned by the agent.")
      .def(nb::init<const ModelShape&, const KvConfig&, FullPrecisionSource*, const std::string&, int, uintptr_t,
                    int, int, int64_t>(),
           "shape"_a, "config"_a, "source"_a = nb::none(), "backend"_a = "cpu", "device"_a = -1, "stream"_a = 0,
           "capacity_tokens"_a = 32768, "fetch_blocks"_a = 32, "device_pool_bytes"_a = 0, nb::keep_alive<1, 4>())
      .def_prop_ro("shape", &PyAgent::shape)
      .def_prop_ro("config", &PyAgent::config)
      .def_prop_ro("backend", &PyAgent::backend)
      .def_prop_ro("device", &PyAgent::device, "CUDA device index (-1 for the CPU backend).")
      .def("rows_per_sequence", &PyAgent::RowsPerSequence, "kind"_a)
      .def("add_sequence", &PyAgent::AddSequence, "id"_a)
      .def("release_sequence", &PyAgent::ReleaseSequence, "id"_a)
      .def("sequence_length", &PyAgent::SequenceLength, "id"_a)
      .def("prefill_layer", &PyAgent::PrefillLayer, "layer"_a, "sequences"_a, "token_offsets"_a, "q"_a.none(),
           "k"_a, "v"_a, "out"_a.none() = nb::none(),
           "Exact causal attention over the prompts (ragged: sequence i owns rows token_offsets[i]:"
           "token_offsets[i+1]), then the K/V go to the replica and the source. q and out None: store only.")
      .def("begin_step", &PyAgent::BeginStep, "kind"_a, "sequences"_a)
      .def("decode_layer", &PyAgent::DecodeLayer, "layer"_a, "q"_a, "k"_a, "v"_a, "out"_a,
           "The step's rows at this layer: [n_sequences * rows_per_sequence(kind)] rows, sequence-major.")
      .def("start_prefetch", &PyAgent::StartPrefetch, "layer"_a)
      .def("wait_prefetch", &PyAgent::WaitPrefetch, "layer"_a)
      .def("end_step", &PyAgent::EndStep)
      .def("abort_step", &PyAgent::AbortStep)
      .def("selected_tokens", &PyAgent::SelectedTokens, "id"_a, "layer"_a, "kv_head"_a)
      .def("stats", &PyAgent::Stats, "AgentStats as a dict.");
}

}  // namespace specache::python
