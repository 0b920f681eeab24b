// DecodePlan's slots (cuda_attention.h), for the kernels of the decode step that read their work
// lists from a slot instead of their parameters: the attention (attention.cu) from device copies,
// the top-k (topk.cu) from device copies or in place (the agent's selection stream); the fetch and
// the page writes (fetch.cu), the row copies (tensors.cu), the appends' key and value quantization
// (quantize.cu), the selection rule's batches (selection.cu) and the mma packing (mma_codes.cu) in
// place, through WithDeviceTasks.
// Internal to the agent.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cuda_status.h"
#include "specache/cuda_attention.h"

namespace specache::cuda {

// The slots of a plan. A slot's host bytes are written by the host and, with device copies,
// copied to its device bytes on the plan's copy stream as soon as the call is made (the copy is
// usually done long before the kernels' turn on their stream, which only waits for `copied`), or
// with stream copies on the call's stream right before its kernels, read there by the kernels; in
// place (mapped), the kernels read the host bytes. The slot is written
// again only after an event recorded after its last kernel completed.
//
// That event is shared: the slots of up to kReleaseEvery calls in a row on one stream (the
// release group) are released by one event, recorded after the group's last call (on that
// stream: it follows every kernel of the group) into that call's slot's `done`, and waited for
// once. A group is closed (its event recorded) when it is full, and before any of its slots can be
// taken again (its oldest slot half a ring from its next turn); so one event record and at most
// one wait serve kReleaseEvery calls instead of one each. Only while every call of the plan came on
// one stream: once a call comes on another stream, the open group is closed there (its stream is
// the one the previous call used, which must still be valid and not captured by anyone else) and
// from then on each call's slot has its own event, recorded in the call, as a plan that serves
// several streams (the fetch's) always had. The slots of a group still open when the plan goes are
// waited for with the whole device of the plan (cudaDeviceSynchronize: their stream may be gone by
// then); a plan made for one call closes its group first (WithOwnPlan). An error of a group's
// event comes back from the call that closes the group.
struct DecodePlan::Impl {
  struct Slot {
    void* host = nullptr;    // pinned (mapped in place)
    void* device = nullptr;  // device memory, or in place the device's address of `host`
    size_t bytes = 0;
    // Device memory zeroed when allocated, which the slot's kernels leave zeroed (counters they
    // count up and reset: the top-k's finished parts); only for calls that ask for it (Begin).
    void* zeroed = nullptr;
    size_t zeroed_bytes = 0;
    cudaEvent_t copied = nullptr, done = nullptr;  // `copied`: device copies only
    // The ring slot whose `done` releases this one (its group's last), once `recorded`: recorded
    // and not yet waited for by this slot. A `done` waited for is `waited` until recorded again.
    int release = -1;
    bool recorded = false;
    bool waited = false;
  };
  static constexpr int kRing = 64;  // calls the host may run ahead of the device on one plan
  static constexpr int kReleaseEvery = 16;  // calls of a release group at most (a quarter of the ring)
  std::vector<Slot> ring = std::vector<Slot>(kRing);
  std::vector<Slot> captured;       // copied from by CUDA graphs: never rewritten
  int next = 0;
  int device = -1;
  bool in_place = false;  // DecodePlan::SlotReads::kInPlace: no device copy, the kernels read `host`
  bool in_stream = false;  // DecodePlan::SlotReads::kStreamCopy: copied on the call's stream (no copy stream)
  cudaStream_t copy = nullptr;      // device copies only, as `fork`
  cudaEvent_t fork = nullptr;       // a captured call's copy joins the capture through it
  // The open release group: the ring slots of the last calls on `group_stream`, oldest first,
  // whose kernels are queued and whose event is not recorded yet.
  std::vector<int> group;
  cudaStream_t group_stream = nullptr;
  bool one_stream = true;  // every call so far on group_stream: calls are grouped
  // The buffers of slots that grew ({host, device}; device null in place), freed with the plan:
  // freed when their slot grows (in the decode loop, whenever a batch's task lists reach a new
  // size) cudaFree and cudaFreeHost would wait for all of the device's work there. A slot at
  // least doubles when it grows, so these hold less than the slots themselves.
  std::vector<std::pair<void*, void*>> outgrown;
  std::vector<void*> outgrown_zeroed;  // the slots' zeroed device bytes that grew, likewise

  // (A captured slot's events belong to the graph's capture: they are never waited for.)
  void Free(Slot& s) const {
    if (s.done) cudaEventDestroy(s.done);
    if (s.copied) cudaEventDestroy(s.copied);
    if (s.host) cudaFreeHost(s.host);
    if (s.device && !in_place) cudaFree(s.device);
    if (s.zeroed) cudaFree(s.zeroed);
    s = Slot{};
  }
  ~Impl() {
    // Every reader of a slot done before any slot (or event) goes.
    if (!group.empty()) {
      int current = -1;
      const bool switched = device >= 0 && cudaGetDevice(&current) == cudaSuccess && current != device &&
                            cudaSetDevice(device) == cudaSuccess;
      cudaDeviceSynchronize();
      if (switched) cudaSetDevice(current);
    }
    for (const Slot& s : ring) {
      if (!s.recorded) continue;
      Slot& release = ring[s.release];
      if (!release.waited) cudaEventSynchronize(release.done);
      release.waited = true;
    }
    for (Slot& s : ring) Free(s);
    for (Slot& s : captured) Free(s);
    for (const auto& [host, dev] : outgrown) {
      cudaFreeHost(host);
      if (dev) cudaFree(dev);
    }
    for (void* zeroed : outgrown_zeroed) cudaFree(zeroed);
    if (fork) cudaEventDestroy(fork);
    if (copy) cudaStreamDestroy(copy);
  }
  // Records the open group's event on its stream: its slots are released once it completes. When
  // it cannot be recorded, the host waits for the stream instead, or failing that for the device
  // (the slots are then free).
  Status CloseGroup() {
    if (group.empty()) return Status::Ok();
    const int last = group.back();
    const bool recorded = cudaEventRecord(ring[last].done, group_stream) == cudaSuccess;
    if (!recorded) {
      cudaGetLastError();
      if (cudaStreamSynchronize(group_stream) != cudaSuccess) cudaGetLastError(), cudaDeviceSynchronize();
    }
    ring[last].waited = false;
    for (int i : group) {
      ring[i].release = last;
      ring[i].recorded = recorded;
    }
    group.clear();
    return recorded ? Status::Ok() : Status::Unavailable("decode plan: plan event");
  }
  // A slot of at least `bytes` that no copy or kernel still reads.
  Result<Slot*> Take(size_t bytes, bool capturing) {
    int current = 0;
    if (cudaGetDevice(&current) != cudaSuccess) return Status::Unavailable("decode plan: no CUDA device");
    if (device < 0) device = current;
    if (device != current) return Status::InvalidArgument("decode plan: a plan serves the device it was first used on");
    if (!in_place && !in_stream && copy == nullptr &&
        (cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking) != cudaSuccess ||
         cudaEventCreateWithFlags(&fork, cudaEventDisableTiming) != cudaSuccess)) {
      return Status::Unavailable("decode plan: cannot create its copy stream");
    }
    Slot* s = nullptr;
    if (capturing) {
      captured.emplace_back();
      s = &captured.back();
    } else {
      // The open group closes before its oldest slot is half a ring from being taken again (this
      // one at the latest), so that the wait below is for kernels queued long ago.
      if (!group.empty() && (group.front() - next + kRing) % kRing < kRing / 2) SPECACHE_RETURN_IF_ERROR(CloseGroup());
      s = &ring[next];
      next = (next + 1) % kRing;
      if (s->recorded) {
        Slot& release = ring[s->release];
        const bool waited = release.waited || cudaEventSynchronize(release.done) == cudaSuccess;
        if (!waited) cudaGetLastError(), cudaDeviceSynchronize();  // the slot is free either way after
        release.waited = true;
        s->recorded = false;
        if (!waited) return Status::Unavailable("decode plan: waiting for a slot failed");
      }
    }
    if (s->bytes < bytes) {
      const size_t grown = std::max<size_t>({bytes, 2 * s->bytes, 64 << 10});
      if (s->host) outgrown.emplace_back(s->host, in_place ? nullptr : s->device);  // freed with the plan
      s->host = nullptr;
      s->device = nullptr;
      s->bytes = 0;
      if (in_place ? cudaHostAlloc(&s->host, grown, cudaHostAllocMapped) != cudaSuccess ||
                          cudaHostGetDevicePointer(&s->device, s->host, 0) != cudaSuccess
                    : cudaHostAlloc(&s->host, grown, cudaHostAllocDefault) != cudaSuccess ||
                          cudaMalloc(&s->device, grown) != cudaSuccess) {
        cudaGetLastError();
        return Status::ResourceExhausted("decode plan: cannot allocate " + std::to_string(grown) + " bytes");
      }
      s->bytes = grown;
    }
    if ((s->done == nullptr && cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming) != cudaSuccess) ||
        (!in_place && !in_stream && s->copied == nullptr &&
         cudaEventCreateWithFlags(&s->copied, cudaEventDisableTiming) != cudaSuccess)) {
      return Status::Unavailable("decode plan: cannot create its events");
    }
    return s;
  }
  // Copies the slot's first `bytes` to the device; `stream` waits for the copy.
  Status Copy(Slot* s, size_t bytes, cudaStream_t stream, bool capturing) {
    if (in_place) return Status::Ok();  // read in place
    if (in_stream) {  // in the stream's order (a capture takes the copy in as it is)
      if (cudaMemcpyAsync(s->device, s->host, bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess) {
        return Status::Unavailable(std::string("decode plan: copy: ") + cudaGetErrorString(cudaGetLastError()));
      }
      return Status::Ok();
    }
    // A captured copy must hang off the capturing stream to join the graph.
    if (capturing && (cudaEventRecord(fork, stream) != cudaSuccess || cudaStreamWaitEvent(copy, fork, 0) != cudaSuccess)) {
      return Status::Unavailable("decode plan: copy in a capture");
    }
    if (cudaMemcpyAsync(s->device, s->host, bytes, cudaMemcpyHostToDevice, copy) != cudaSuccess) {
      return Status::Unavailable(std::string("decode plan: copy: ") + cudaGetErrorString(cudaGetLastError()));
    }
    if (cudaEventRecord(s->copied, copy) != cudaSuccess || cudaStreamWaitEvent(stream, s->copied, 0) != cudaSuccess) {
      const cudaError_t err = cudaGetLastError();
      // The copy is queued but nothing orders the slot's release after it: it ends here, before the
      // slot is written again or freed (outside a capture: a captured copy runs with its graph).
      if (!capturing) cudaStreamSynchronize(copy);
      return Status::Unavailable(std::string("decode plan: copy: ") + cudaGetErrorString(err));
    }
    return Status::Ok();
  }

  // Grows the slot's zeroed device bytes to at least `bytes`, zeroed on `stream` ahead of the
  // call's kernels (the slot is free: no kernel reads the old bytes, kept until the plan goes as
  // outgrown slots are).
  Status Zeroed(Slot* s, size_t bytes, cudaStream_t stream) {
    if (bytes == 0 || s->zeroed_bytes >= bytes) return Status::Ok();
    const size_t grown = std::max<size_t>({bytes, 2 * s->zeroed_bytes, 4 << 10});
    if (s->zeroed) outgrown_zeroed.push_back(s->zeroed);
    s->zeroed = nullptr;
    s->zeroed_bytes = 0;
    if (cudaMalloc(&s->zeroed, grown) != cudaSuccess) {
      cudaGetLastError();
      s->zeroed = nullptr;
      return Status::ResourceExhausted("decode plan: cannot allocate " + std::to_string(grown) + " device bytes");
    }
    if (cudaMemsetAsync(s->zeroed, 0, grown, stream) != cudaSuccess) {
      const cudaError_t err = cudaGetLastError();
      outgrown_zeroed.push_back(s->zeroed);  // not zeroed: never handed out, freed with the plan
      s->zeroed = nullptr;
      return Status::Unavailable(std::string("decode plan: zeroing: ") + cudaGetErrorString(err));
    }
    s->zeroed_bytes = grown;
    return Status::Ok();
  }

  // One call's bytes on the device, in three steps: Begin takes a slot of at least `bytes` (the
  // call writes them at `host`) and, when asked, `zeroed_bytes` of device memory that reads zero
  // on `stream` and that the call's kernels must leave zero; Send copies the bytes and makes
  // `stream` wait for the copy (the call's kernels then read `device`), Finish, after the call's
  // last kernel is queued (also after a failed launch: the copy was queued), lets the slot be
  // written again once those kernels ran. A failed Send has finished the slot itself.
  struct Upload {
    Slot* slot = nullptr;
    void* host = nullptr;
    const void* device = nullptr;
    void* zeroed = nullptr;  // null unless asked for
    bool capturing = false;  // the stream is being captured into a graph: a slot kept for it
  };
  Result<Upload> Begin(size_t bytes, cudaStream_t stream, size_t zeroed_bytes = 0) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) return Status::Unavailable("decode plan: stream state");
    Upload up;
    up.capturing = capture == cudaStreamCaptureStatusActive;
    SPECACHE_ASSIGN_OR_RETURN(up.slot, Take(bytes, up.capturing));
    // A failure leaves the slot as free as it was taken (nothing of this call queued): taken
    // again when the ring comes round.
    SPECACHE_RETURN_IF_ERROR(Zeroed(up.slot, zeroed_bytes, stream));
    up.host = up.slot->host;
    up.device = up.slot->device;
    up.zeroed = zeroed_bytes > 0 ? up.slot->zeroed : nullptr;
    return up;
  }
  // A failed Send has released the slot as Finish does (the zeroing, and part of the copy, may be
  // queued): the caller returns its error without Finish.
  Status Send(const Upload& up, size_t bytes, cudaStream_t stream) {
    const Status copied = Copy(up.slot, bytes, stream, up.capturing);
    if (!copied.ok()) (void)Finish(up, stream);
    return copied;
  }
  // The slot joins the open release group (a group on another stream is closed first, and the plan
  // groups no more: its slots get an event each).
  Status Finish(const Upload& up, cudaStream_t stream) {
    if (up.capturing) return Status::Ok();
    const bool switched = group_stream != stream;
    if (switched && (group_stream != nullptr || !group.empty())) one_stream = false;
    const Status closed = switched ? CloseGroup() : Status::Ok();
    group_stream = stream;
    group.push_back(static_cast<int>(up.slot - ring.data()));
    SPECACHE_RETURN_IF_ERROR(closed);
    return one_stream && static_cast<int>(group.size()) < kReleaseEvery ? Status::Ok() : CloseGroup();
  }
  // A plan made for one call (a null plan given) frees its slots when the call returns: refused on
  // a stream being captured, whose graph would read them later.
  static Status OwnPlanAllowed(cudaStream_t stream) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) return Status::Unavailable("decode plan: stream state");
    return capture == cudaStreamCaptureStatusNone
               ? Status::Ok()
               : Status::InvalidArgument("decode plan: a stream being captured needs a plan that outlives the graph");
  }
};

// Runs `launch(device_tasks)`, which queues kernels on `stream` that read tasks[0, n) through a
// slot of `plan` (null: an in-place plan of the call's own, which waits for the kernels before
// this returns), and checks that they were accepted (LaunchStatus: `what` names them in the
// error). The slot is released after the launch, also after a failed one. For the batched kernels
// whose task lists were kernel parameters (32 KB at most: a few hundred tasks a launch, and ~2x a
// plain launch's host cost each).
// Runs `call(&plan)` with a plan of the call's own (`reads`) on `stream` (refused on a stream being
// captured, whose graph would read the plan's slots after it went), then closes the plan's release
// group, so that the plan's end waits for this call's kernels only, not for the whole device.
template <typename Call>
Status WithOwnPlan(cudaStream_t stream, DecodePlan::SlotReads reads, Call&& call) {
  SPECACHE_RETURN_IF_ERROR(DecodePlan::Impl::OwnPlanAllowed(stream));
  DecodePlan own(reads);
  const Status done = call(&own);
  const Status closed = own.impl()->CloseGroup();
  return done.ok() ? closed : done;
}

template <typename T, typename Launch>
Status WithDeviceTasks(DecodePlan* plan, const T* tasks, int n, cudaStream_t stream, const char* what,
                       Launch&& launch) {
  if (plan == nullptr) {
    return WithOwnPlan(stream, DecodePlan::SlotReads::kInPlace,
                       [&](DecodePlan* own) { return WithDeviceTasks(own, tasks, n, stream, what, launch); });
  }
  const size_t bytes = static_cast<size_t>(std::max(n, 1)) * sizeof(T);
  SPECACHE_ASSIGN_OR_RETURN(const DecodePlan::Impl::Upload up, plan->impl()->Begin(bytes, stream));
  if (n > 0) std::memcpy(up.host, tasks, static_cast<size_t>(n) * sizeof(T));
  SPECACHE_RETURN_IF_ERROR(plan->impl()->Send(up, bytes, stream));
  launch(static_cast<const T*>(up.device));
  const Status launched = LaunchStatus(what);
  SPECACHE_RETURN_IF_ERROR(plan->impl()->Finish(up, stream));
  return launched;
}

}  // namespace specache::cuda
