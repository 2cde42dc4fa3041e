#include "fp4kv/format.h"
#include "gtest/gtest.h"
TEST(Smoke, E2m1) { EXPECT_EQ(fp4kv::E2m1Encode(6.0f), 7); }
