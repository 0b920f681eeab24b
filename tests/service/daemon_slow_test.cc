#include "kill_rounds.h"

TEST(DaemonSlowTest, AThousandClientsKilledMidWorkLeakNothing) { specache::testing::KillClientRounds(1000); }
