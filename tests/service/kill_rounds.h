// Clients SIGKILLed in the middle of work, round after round: every time, all their pages must be
// back in the pool within the lease (2 s). Used with 20 rounds in CI and 1000 under `slow`.
#pragma once

#include <gtest/gtest.h>

#include "processes.h"
#include "specache/client.h"

namespace specache::testing {

inline void KillClientRounds(int rounds) {
  DaemonProcess d;
  ASSERT_TRUE(d.Start());
  auto admin = client::Client::Connect({d.socket, std::chrono::milliseconds(2000), "admin"});
  ASSERT_TRUE(admin.ok()) << admin.status().ToString();
  double worst_ms = 0, total_ms = 0;
  for (int i = 0; i < rounds; ++i) {
    auto c = Spawn({TEST_CLIENT_PATH, "hold", d.socket, "default"});
    ASSERT_EQ(c->ReadLine(10000).rfind("ready", 0), 0u) << "round " << i;
    auto s = (*admin)->Stats();
    ASSERT_TRUE(s.ok());
    ASSERT_EQ(s->sessions, 1u);
    ASSERT_GT(s->used_bytes, 0u);
    c->Kill(SIGKILL);
    ASSERT_EQ(c->Wait(5000), 128 + SIGKILL);
    const auto start = std::chrono::steady_clock::now();
    bool empty = false;
    while (!empty && std::chrono::steady_clock::now() - start < std::chrono::seconds(2)) {
      auto now = (*admin)->Stats();
      empty = now.ok() && now->sessions == 0 && now->free_bytes == now->pool_bytes;
      if (!empty) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    ASSERT_TRUE(empty) << "round " << i << ": pages not back within 2 s";
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    worst_ms = std::max(worst_ms, ms);
    total_ms += ms;
  }
  std::printf("SIGKILLed clients, %d rounds: pool empty again after %.1f ms on average, %.1f ms at worst\n", rounds,
              total_ms / rounds, worst_ms);
}

}  // namespace specache::testing
