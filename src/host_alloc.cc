// Internal: how much host memory the process can still take.
#include "src/host_alloc.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

namespace fp4kv {
namespace internal {
namespace {

// The first integer of the file (or of the line starting with `key`); false
// when the file or the key is missing or the value is not a number ("max").
bool ReadNumber(const char* path, const char* key, int64_t* out) {
  std::FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char line[256];
  bool found = false;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    const char* p = line;
    if (key != nullptr) {
      const size_t n = std::strlen(key);
      if (std::strncmp(line, key, n) != 0) continue;
      p += n;
    }
    long long v = 0;
    found = std::sscanf(p, " %lld", &v) == 1 && v >= 0;
    if (found) *out = static_cast<int64_t>(v);
    break;
  }
  std::fclose(f);
  return found;
}

}  // namespace

int64_t HostMemoryAvailable() {
  int64_t avail = INT64_MAX;
  int64_t v = 0;
  if (ReadNumber("/proc/meminfo", "MemAvailable:", &v) && v <= INT64_MAX / 1024) {
    avail = v * 1024;  // kB
  }
  int64_t limit = 0, used = 0;
  if (ReadNumber("/sys/fs/cgroup/memory.max", nullptr, &limit) &&
      ReadNumber("/sys/fs/cgroup/memory.current", nullptr, &used)) {
    avail = std::min(avail, std::max<int64_t>(limit - used, 0));
  }
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    int64_t pages = 0;
    const long page = sysconf(_SC_PAGESIZE);
    const int64_t cur = as.rlim_cur > static_cast<rlim_t>(INT64_MAX)
                            ? INT64_MAX
                            : static_cast<int64_t>(as.rlim_cur);
    if (page > 0 && ReadNumber("/proc/self/statm", nullptr, &pages) &&
        pages <= INT64_MAX / page) {
      avail = std::min(avail, std::max<int64_t>(cur - pages * page, 0));
    } else {
      avail = std::min(avail, cur);
    }
  }
  return avail;
}

}  // namespace internal
}  // namespace fp4kv
