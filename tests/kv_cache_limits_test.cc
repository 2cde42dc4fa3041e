// KVCache::Create at the limits: options with extreme values (pages, slots,
// heads, head dims, layers, budgets, step capacities near the int32 and
// int64 limits, host tiers, prefix caching) return a Status or a working
// cache, never kill the process; a budget beyond the machine is clamped and
// reported; given pages beyond it are refused with the numbers.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fp4kv/kv_cache.h"
#include "gtest/gtest.h"
#include "src/host_alloc.h"
#include "testing/test_util.h"

#if defined(__SANITIZE_ADDRESS__)
#define FP4KV_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FP4KV_ASAN 1
#endif
#endif

namespace fp4kv {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

#ifdef FP4KV_ASAN
constexpr bool kAsan = true;
#else
constexpr bool kAsan = false;
#endif

// Under ASan a failed malloc returns null only with allocator_may_return_null=1
// (scripts/test.sh sets it); otherwise ASan reports and exits.
bool MallocMayFail() {
  if (!kAsan) return true;
  const char* o = std::getenv("ASAN_OPTIONS");
  return o != nullptr && std::strstr(o, "allocator_may_return_null=1") != nullptr;
}

KVCacheOptions BaseOptions() {
  KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = 8;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 128;
  o.geometry.page_size = 16;
  o.geometry.layout = Layout::kNHD;
  o.device = Device::Cpu();
  o.max_seqs_per_step = 4;
  o.max_tokens_per_step = 64;
  o.max_pages_per_seq = 16;
  return o;
}

// A created cache works: a sequence takes a step of one token.
std::string Exercise(KVCache& cache) {
  absl::StatusOr<SequenceId> seq = cache.CreateSequence();
  if (!seq.ok()) return seq.status().ToString();
  const int32_t id = 7;
  absl::StatusOr<StepInfo> step = cache.PrepareStep({{*seq, 1, {&id, 1}}}, nullptr);
  if (!step.ok()) return step.status().ToString();
  // CheckInvariants takes O(pages) host memory of its own: a cache that
  // took all there was may answer ResourceExhausted.
  absl::Status inv = cache.CheckInvariants();
  return inv.ok() || inv.code() == absl::StatusCode::kResourceExhausted ? "" : inv.ToString();
}

TEST(HostAlloc, SizesThatCannotBeHadAreResourceExhausted) {
  internal::HostVector<int64_t> v;
  absl::Status st = internal::SizeHost(&v, INT64_MAX, int64_t{0}, "Test", "an overflow");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("beyond int64"), absl::string_view::npos) << st;
  if (!MallocMayFail()) GTEST_SKIP() << "ASan without allocator_may_return_null=1 aborts instead";
  // 16 TiB: past every machine's memory and ASan's largest allocation.
  st = internal::SizeHost(&v, int64_t{1} << 41, int64_t{0}, "Test", "16 TiB");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("17592186044416 bytes of host memory for 16 TiB"),
            absl::string_view::npos)
      << st;
  EXPECT_TRUE(v.empty());
  st = internal::ReserveHost(&v, int64_t{1} << 41, "Test", "16 TiB");
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_TRUE(internal::SizeHost(&v, 1000, int64_t{3}, "Test", "a little").ok());
  EXPECT_EQ(v.size(), 1000u);
}

TEST(KVCacheLimits, BudgetBeyondTheMachineIsClampedOnTheCpu) {
  KVCacheOptions o = BaseOptions();
  o.memory_budget_bytes = INT64_MAX;  // "what there is"
  absl::StatusOr<KVCache> cache = KVCache::Create(o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const KVCacheStats st = cache->Stats();
  EXPECT_TRUE(st.memory_budget_clamped);
  EXPECT_GT(st.memory_available_at_create, 0);
  EXPECT_LE(st.pool_bytes, st.memory_available_at_create);
  EXPECT_LE(st.pool_bytes, st.memory_available_at_create - st.memory_available_at_create / 16);
  EXPECT_GT(st.pages_total, 0);
  EXPECT_EQ(cache->geometry().num_pages, st.pages_total);
  EXPECT_EQ(Exercise(*cache), "");

  o.memory_budget_bytes = 64 * kMiB;  // a budget that fits is not clamped
  absl::StatusOr<KVCache> small = KVCache::Create(o);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_FALSE(small->Stats().memory_budget_clamped);
  EXPECT_LE(small->Stats().pool_bytes, 64 * kMiB);
}

TEST(KVCacheLimits, GivenPagesBeyondTheMachineAreRefusedWithTheNumbers) {
  KVCacheOptions o = BaseOptions();
  o.geometry.num_pages = INT32_MAX;  // 2^31 pages of 73 KiB: 150 TiB
  absl::StatusOr<KVCache> cache = KVCache::Create(o);
  ASSERT_FALSE(cache.ok());
  EXPECT_EQ(cache.status().code(), absl::StatusCode::kResourceExhausted) << cache.status();
  EXPECT_NE(cache.status().message().find("bytes of host memory"), absl::string_view::npos)
      << cache.status();
  EXPECT_NE(cache.status().message().find("available"), absl::string_view::npos)
      << cache.status();
}

TEST(KVCacheLimits, IssueGeometryOfTwoToThe28PagesIsAStatus) {
  // 2^28 pages of 16 slots (the issue's case): 27 GB of bookkeeping with
  // prefix caching and far more pool bytes than a machine has.
  KVCacheOptions o = BaseOptions();
  o.geometry.num_pages = int64_t{1} << 28;
  for (bool prefix : {false, true}) {
    o.prefix_cache.enabled = prefix;
    absl::StatusOr<KVCache> cache = KVCache::Create(o);
    ASSERT_FALSE(cache.ok());
    EXPECT_EQ(cache.status().code(), absl::StatusCode::kResourceExhausted) << cache.status();
  }
}

// One random Create: extreme values for every size. `bounded` keeps out the
// cases that could succeed with a large real footprint (the caller has no
// address-space limit): budgets of at most 256 MiB unless a page of every
// layer takes at least 1 MiB, given pools of at most 256 MiB or beyond 1 TiB.
struct FuzzCase {
  KVCacheOptions o;
  std::string ToString() const {
    const CacheGeometry& g = o.geometry;
    return absl::StrCat("layers ", o.num_layers, " heads ", g.num_kv_heads, " dk ", g.head_dim_k,
                        " dv ", g.head_dim_v, " page_size ", g.page_size, " pages ", g.num_pages,
                        " budget ", o.memory_budget_bytes, " S ", o.max_seqs_per_step, " T ",
                        o.max_tokens_per_step, " M ", o.max_pages_per_seq, " prefix ",
                        o.prefix_cache.enabled, " events ", o.prefix_cache.max_pending_events,
                        " host_pages ", o.host_tier.host_pages, " host_bytes ",
                        o.host_tier.host_bytes, " fp8 keys ",
                        g.key_format == KeyFormat::kFp8);
  }
};

template <typename T>
T Pick(std::mt19937_64& rng, std::initializer_list<T> v) {
  return *(v.begin() + rng() % v.size());
}

// A usual value three times in four, else an extreme one.
template <typename T>
T Mix(std::mt19937_64& rng, std::initializer_list<T> usual, std::initializer_list<T> extreme) {
  return rng() % 4 != 0 ? Pick(rng, usual) : Pick(rng, extreme);
}

bool Draw(std::mt19937_64& rng, bool bounded, FuzzCase* c) {
  KVCacheOptions& o = c->o;
  o = BaseOptions();
  CacheGeometry& g = o.geometry;
  o.num_layers = Mix<int>(rng, {1, 2, 80}, {-1, 0, 1 << 20, INT32_MAX});
  g.num_kv_heads = Mix<int>(rng, {1, 8}, {0, 1 << 16, INT32_MAX});
  g.head_dim_k = Mix<int>(rng, {16, 64, 128, 256}, {1 << 20, INT32_MAX - 15});
  g.head_dim_v = rng() % 2 ? g.head_dim_k : Mix<int>(rng, {16, 128}, {1 << 24});
  g.page_size = Mix<int>(rng, {1, 16, 64}, {0, 1 << 20, INT32_MAX});
  g.layout = rng() % 2 ? Layout::kNHD : Layout::kHND;
  g.key_format = rng() % 4 == 0 ? KeyFormat::kFp8 : KeyFormat::kNvfp4;
  const bool by_budget = rng() % 2;
  g.num_pages = by_budget ? 0
                          : Mix<int64_t>(rng, {1, 2, 1000},
                                         {-1, int64_t{1} << 28, INT32_MAX - 1, INT32_MAX,
                                          int64_t{INT32_MAX} + 1, INT64_MAX});
  o.memory_budget_bytes =
      by_budget ? Mix<int64_t>(rng, {4096, kMiB, 256 * kMiB},
                               {-1, 1, 64 * kGiB, INT64_MAX / 2, INT64_MAX, INT64_MAX, INT64_MAX})
                : 0;
  o.max_seqs_per_step = Mix<int>(rng, {1, 256}, {0, 1 << 20, INT32_MAX});
  o.max_tokens_per_step = Mix<int>(rng, {1, 8192}, {0, 1 << 24, INT32_MAX});
  o.max_pages_per_seq = Mix<int>(rng, {0, 1, 512}, {1 << 20, INT32_MAX});
  o.prefix_cache.enabled = rng() % 2;
  o.prefix_cache.max_pending_events = Mix<int64_t>(rng, {0, 1024}, {-1, INT64_MAX});
  if (rng() % 3 == 0) {
    if (rng() % 2) {
      o.host_tier.host_pages = Mix<int64_t>(rng, {1, 1000}, {-1, INT32_MAX, INT64_MAX});
    } else {
      o.host_tier.host_bytes = Mix<int64_t>(rng, {1, 64 * kMiB}, {64 * kGiB, INT64_MAX});
    }
  }
  if (!bounded) return true;
  // Bytes of one page of every layer (saturating; 0 for invalid geometry).
  const long double page =
      static_cast<long double>(std::max(o.num_layers, 0)) * g.num_kv_heads * g.page_size *
      (static_cast<long double>(g.head_dim_k) + g.head_dim_v);
  const long double slots = static_cast<long double>(g.page_size) *
                            (g.num_pages > 0 ? g.num_pages : 0);
  const long double given = g.num_pages > 0 ? page * g.num_pages + 100 * slots : 0;
  const long double huge = static_cast<long double>(kGiB) * 1024;
  if (by_budget && o.memory_budget_bytes > 256 * kMiB && page < kMiB) return false;
  if (!by_budget && given > 256 * kMiB && given < huge) return false;
  const long double host = static_cast<long double>(o.host_tier.host_pages) * page +
                           static_cast<long double>(o.host_tier.host_bytes);
  if (host > 256 * kMiB && host < huge) return false;
  // Step capacities: staging and tables of up to 16 * S * M + 8 * T bytes.
  const long double step = 16.0L * o.max_seqs_per_step * std::max(o.max_pages_per_seq, 1) +
                           8.0L * o.max_tokens_per_step + 64.0L * o.max_seqs_per_step;
  if (step > 256 * kMiB) return false;
  return true;
}

// Runs `n` random Creates; returns the number that failed the contract
// (a status that is neither OK nor a documented error, or a created cache
// that does not work), printing them.
int RunCreateFuzz(uint64_t seed, int n, bool bounded, int* created, int* refused) {
  std::mt19937_64 rng(seed);
  int bad = 0;
  for (int i = 0; i < n; ++i) {
    FuzzCase c;
    while (!Draw(rng, bounded, &c)) {
    }
    // An exception out of the library is a failure of the contract; caught
    // here only to name the case.
    std::optional<absl::StatusOr<KVCache>> made;
    std::string err;
    try {
      made.emplace(KVCache::Create(c.o));
      if (made->ok()) err = Exercise(**made);
    } catch (const std::exception& e) {
      std::printf("case %d (%s): exception %s\n", i, c.ToString().c_str(), e.what());
      ++bad;
      continue;
    }
    absl::StatusOr<KVCache>& cache = *made;
    if (!cache.ok()) {
      ++*refused;
      const absl::StatusCode code = cache.status().code();
      if (code != absl::StatusCode::kInvalidArgument &&
          code != absl::StatusCode::kResourceExhausted) {
        std::printf("case %d (%s): unexpected %s\n", i, c.ToString().c_str(),
                    cache.status().ToString().c_str());
        ++bad;
      }
      continue;
    }
    ++*created;
    if (!err.empty()) {
      std::printf("case %d (%s): created, then %s\n", i, c.ToString().c_str(), err.c_str());
      ++bad;
    }
  }
  return bad;
}

TEST(KVCacheLimits, CreateOptionsFuzzReturnsAStatusOrAWorkingCache) {
  // In this process (ASan included): no case may succeed with a large real
  // footprint, as nothing limits this process's memory.
  if (!MallocMayFail()) GTEST_SKIP() << "ASan without allocator_may_return_null=1 aborts instead";
  const uint64_t seed = 26;
  const int n = 400;
  int created = 0, refused = 0;
  EXPECT_EQ(RunCreateFuzz(seed, n, /*bounded=*/true, &created, &refused), 0);
  std::printf("seed %llu: %d cases, %d created, %d refused\n",
              static_cast<unsigned long long>(seed), n, created, refused);
  EXPECT_GT(created, 0);
  EXPECT_GT(refused, 0);
}

TEST(KVCacheLimits, CreateOptionsFuzzUnderAnAddressSpaceLimit) {
  if (kAsan) {
    GTEST_SKIP() << "AddressSanitizer reserves terabytes of shadow address space: RLIMIT_AS "
                    "cannot limit an ASan process";
  }
  // A forked child with 2 GiB of address space runs every case, unbounded:
  // the library must see the limit (HostMemoryAvailable) or fail the
  // allocation, and return.
  const uint64_t seed = 2026;
  const int n = 400;
  std::fflush(stdout);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit lim{};
    getrlimit(RLIMIT_AS, &lim);
    lim.rlim_cur = static_cast<rlim_t>(2 * kGiB);
    if (setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
    int created = 0, refused = 0;
    const int bad = RunCreateFuzz(seed, n, /*bounded=*/false, &created, &refused);
    // INT64_MAX under the limit: clamped to what the 2 GiB leave.
    KVCacheOptions o = BaseOptions();
    o.memory_budget_bytes = INT64_MAX;
    absl::StatusOr<KVCache> cache = KVCache::Create(o);
    const bool clamped_ok = cache.ok() && cache->Stats().memory_budget_clamped &&
                            cache->Stats().pool_bytes < 2 * kGiB && Exercise(*cache).empty();
    if (!clamped_ok) {
      std::printf("INT64_MAX budget under 2 GiB: %s\n",
                  cache.ok() ? "not clamped or not working" : cache.status().ToString().c_str());
    }
    std::printf("seed %llu under RLIMIT_AS 2 GiB: %d cases, %d created, %d refused\n",
                static_cast<unsigned long long>(seed), n, created, refused);
    std::fflush(stdout);
    _exit(bad == 0 && clamped_ok ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "see the cases printed above";
}

TEST(KVCacheLimits, GpuBudgetBeyondTheDeviceIsClamped) {
  FP4KV_SKIP_WITHOUT_GPU();
  KVCacheOptions o = BaseOptions();
  o.device = Device::Cuda(0);
  o.memory_budget_bytes = INT64_MAX;
  absl::StatusOr<KVCache> cache = KVCache::Create(o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  const KVCacheStats st = cache->Stats();
  EXPECT_TRUE(st.memory_budget_clamped);
  EXPECT_LE(st.pool_bytes, st.memory_available_at_create - st.memory_available_at_create / 16);
  EXPECT_GT(st.pages_total, 0);
  // A second cache sees what the first left and is clamped to that.
  o.memory_budget_bytes = INT64_MAX;
  absl::StatusOr<KVCache> second = KVCache::Create(o);
  if (second.ok()) {
    EXPECT_LE(second->Stats().pool_bytes, st.memory_available_at_create / 16);
  } else {
    EXPECT_EQ(second.status().code(), absl::StatusCode::kResourceExhausted) << second.status();
  }
  // Given pages beyond the device: refused with the numbers.
  KVCacheOptions big = BaseOptions();
  big.device = Device::Cuda(0);
  big.geometry.num_pages = INT32_MAX;
  absl::StatusOr<KVCache> refused = KVCache::Create(big);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("available"), absl::string_view::npos)
      << refused.status();
}

}  // namespace
}  // namespace fp4kv
