// A serving loop on a model-shaped NVFP4 KV cache.
//
// Requests arrive with random prompt lengths, are prefilled in chunks, then
// decode while others finish and new ones join; one request is forked for
// parallel sampling (its children share the prompt's pages and copy a shared
// partial page on their first write). Every step, every layer appends its new
// K/V rows and then reads the step's sequences: by default with attention
// straight from the NVFP4 pages, or with --read=materialize as FP8 pages
// (what an FP8 attention kernel would read next). The attention reads use
// two ops of the cache: a decode-only step attends one query row per
// sequence (an op of max_q_len 1, q and out of max_batch + samples rows); a
// step with prefill chunks (possibly mixed with decode rows) attends every
// new token's query row, causal over the cached prefix and the chunk (an op
// of max_q_len = --chunk, q and out of --chunk rows, the step's new tokens
// in the order the appender reads them). The query rows are synthetic
// (random bf16, one set per layer); a real model's would come from the
// layer. No global scales are given: every layer calibrates from its first
// rows. On a GPU, the decode step (all layers) is captured once as two CUDA
// graphs (appends, reads) and replayed, with events between them for the
// per-step time split; prefill steps run eagerly, timed with events around
// their appends and reads. Without a GPU the same loop runs on the CPU
// device (the CPU reference), with smaller defaults, and checks every
// prefill step's attention (layer 0): every new token's output row is
// written, and the row of each entry's last token equals, bit for bit,
// what the max_q_len 1 op computes for that row alone. At the end it prints
// tokens/s, the decode step's append / read time, the prefill steps' append
// / attention time and prefill tokens/s, pages in use, the scale-event
// counters and the error of dequantized K/V against the original rows.
//
// Prefix caching (--prefix_cache=1, the default): prompts start with one of
// a few shared system prompts, and some requests are follow-up turns of an
// earlier conversation (its whole history plus a new user turn). Requests
// are admitted with CreateSequenceFromPrefix, so the cached part of the
// prompt is shared instead of prefilled; steps pass token ids; finished
// requests leave their full pages cached for later turns. A token's K/V row
// is a function of its token prefix (as in a real model), so reused pages
// hold exactly the rows a prefill would write, and the error check below
// covers them too. Only the uncached rest of a prompt is prefilled; its
// chunks attend the shared prefix pages where they lie (the end counts the
// prefill tokens attended after a prefix hit). The end prints the hit rate
// and prefill tokens saved.
//
// Tensor parallelism (--tp=N, docs/kv_cache.md "Tensor parallelism"): N
// caches (ranks), each holding kv_heads / N heads with the same options, get
// every cache call of the loop in the same order; each appends its slice of
// the K/V rows and attends with its qo_heads / N query heads (on a GPU: its
// own stream and captured graphs, rank r on GPU r when there are N GPUs,
// else all on GPU 0). After every call and every step the ranks' host
// decisions (statuses, ids, StepInfo, slot mappings, block tables,
// SequencePages, prefix matches, KV events, Stats counts) are compared; the
// loop aborts naming the step and the call where they differ.
//
// Two steps in flight (--overlap=1, docs/kv_cache.md "Two steps in
// flight"): a cache of two step slots; step N+1 is scheduled and prepared
// (admission, PrepareStep, its K/V rows) while step N runs, each slot with
// its own captured graphs on a GPU, and the ids of decode tokens are not
// passed to PrepareStep but delivered after the step was launched
// (SetTokenIds; on a GPU from device memory, as a sampler's output would be).
// The end prints the host time between two launches, the device time of a
// step, and how much of the host time the device work hid. On the CPU every
// op runs synchronously inside its call, so nothing can be hidden there; the
// mode still checks the slots and late ids.
//
// Flags (--name=value): device (auto|cpu|cuda), read (attention|materialize),
// layers, kv_heads, qo_heads (0: 4 * kv_heads), head_dim, page_size,
// requests, max_batch, prompt_min, prompt_max, decode_min, decode_max, chunk
// (max tokens per step), samples (forked children), pool_pages (0: enough for
// max_batch + samples full-length sequences), error_seqs (finished sequences
// whose error is measured), prefix_cache (0|1), system_prompts (distinct
// shared system prompts), follow_ups (percent of requests that continue an
// earlier conversation), tp (ranks), overlap (0|1), seed.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fp4kv/format.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/kv_events.h"
#include "fp4kv/ops.h"

namespace {

using fp4kv::DType;
using fp4kv::KVCache;
using fp4kv::SequenceId;
using fp4kv::StepEntry;
using fp4kv::StepInfo;
using fp4kv::TensorView;

#define CHECK_OK(expr)                                                                \
  do {                                                                                \
    const absl::Status s_ = (expr);                                                   \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

#define CHECK_CUDA(expr)                                                                          \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

struct Flags {
  std::string device = "auto";
  std::string read = "attention";
  int layers = -1, kv_heads = 8, qo_heads = 0, head_dim = 128, page_size = 16;
  int requests = -1, max_batch = -1, prompt_min = -1, prompt_max = -1;
  int decode_min = -1, decode_max = -1, chunk = -1, samples = 4;
  int64_t pool_pages = 0;
  int error_seqs = 8;
  int prefix_cache = 1, system_prompts = 3, follow_ups = 40;
  int host_prefix_mib = 0;
  int tp = 1;
  int overlap = 0;
  uint64_t seed = 1;

  bool Parse(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--help" || a == "-h") {
        std::printf(
            "usage: serving_loop [--name=value ...]\n"
            "  --device=auto|cuda|cpu   where the cache lives (auto: a GPU when present)\n"
            "  --read=attention|materialize  read path: NVFP4 attention (a query row per sequence in\n"
            "           decode-only steps, per new token in steps with prefill chunks), or FP8 pages\n"
            "  --layers, --kv_heads, --qo_heads, --head_dim, --page_size   model shape\n"
            "  --requests, --max_batch, --prompt_min, --prompt_max, --decode_min, --decode_max,\n"
            "  --chunk (prefill chunk), --samples (forked samples), --pool_pages,\n"
            "  --error_seqs (sequences whose dequantized error is reported), --seed\n"
            "  --prefix_cache=0|1, --system_prompts, --follow_ups (percent)\n"
            "  --host_prefix_mib=N   a host tier of N MiB for the prefix cache: evicted cached\n"
            "           pages are demoted there and promoted back on a hit (hit rates per tier)\n"
            "  --tp=N   N ranks of kv_heads / N heads each (N divides kv_heads and qo_heads),\n"
            "           driven by the same calls; checks that their host decisions agree\n"
            "  --overlap=0|1   two step slots: step N+1 prepared while step N runs, decode\n"
            "           token ids delivered late (SetTokenIds); prints the host time hidden\n"
            "Unset sizes get GPU- or CPU-sized defaults.\n");
        std::exit(0);
      }
      const size_t eq = a.find('=');
      if (a.rfind("--", 0) != 0 || eq == std::string::npos) {
        std::fprintf(stderr, "unknown argument %s (flags are --name=value)\n", a.c_str());
        return false;
      }
      const std::string k = a.substr(2, eq - 2), v = a.substr(eq + 1);
      if (k == "device" || k == "read") {
        (k == "device" ? device : read) = v;
        continue;
      }
      const struct {
        const char* name;
        int* value;
      } ints[] = {
          {"layers", &layers},         {"kv_heads", &kv_heads},     {"qo_heads", &qo_heads},
          {"head_dim", &head_dim},
          {"page_size", &page_size},   {"requests", &requests},     {"max_batch", &max_batch},
          {"prompt_min", &prompt_min}, {"prompt_max", &prompt_max}, {"decode_min", &decode_min},
          {"decode_max", &decode_max}, {"chunk", &chunk},           {"samples", &samples},
          {"error_seqs", &error_seqs}, {"prefix_cache", &prefix_cache},
          {"system_prompts", &system_prompts}, {"follow_ups", &follow_ups},
          {"host_prefix_mib", &host_prefix_mib},
          {"tp", &tp},                 {"overlap", &overlap}};
      bool known = false;
      for (const auto& f : ints) {
        if (k == f.name) {
          *f.value = std::atoi(v.c_str());
          known = true;
        }
      }
      if (k == "pool_pages") pool_pages = std::atoll(v.c_str()), known = true;
      if (k == "seed") seed = std::strtoull(v.c_str(), nullptr, 10), known = true;
      if (!known) {
        std::fprintf(stderr, "unknown flag --%s\n", k.c_str());
        return false;
      }
    }
    return true;
  }
  // Model-shaped defaults on a GPU; fewer layers and requests on the CPU.
  void FillDefaults(bool gpu) {
    auto def = [](int& x, int v) {
      if (x < 0) x = v;
    };
    def(layers, gpu ? 32 : 4);
    def(requests, gpu ? 96 : 10);
    def(max_batch, gpu ? 48 : 5);
    def(prompt_min, gpu ? 128 : 24);
    def(prompt_max, gpu ? 2048 : 200);
    def(decode_min, gpu ? 64 : 8);
    def(decode_max, gpu ? 384 : 32);
    def(chunk, gpu ? 2048 : 256);
  }
};

uint64_t Mix(uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Synthetic K/V rows with a model-like shape: per-channel magnitudes with a
// few outlier channels (stronger in K), normal values, clipped at 4 sigma.
// A token's row is one of `rows` precomputed rows picked by a hash of
// (sequence lineage, position, layer), so originals can be looked up again.
class RowBank {
 public:
  RowBank(int heads, int dim, int rows, uint64_t seed) : width_(heads * dim), rows_(rows) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> normal;
    for (int kv = 0; kv < 2; ++kv) {
      std::vector<float> channel(width_);
      for (float& c : channel) {
        c = std::exp(0.5f * normal(rng));
        if (rng() % (kv == 0 ? 24 : 96) == 0) c *= kv == 0 ? 12.0f : 4.0f;
      }
      amax_[kv] = 0;
      bank_[kv].resize(static_cast<size_t>(rows) * width_);
      for (int r = 0; r < rows; ++r) {
        for (int i = 0; i < width_; ++i) {
          const float x = std::max(-4.0f, std::min(4.0f, normal(rng))) * channel[i];
          bank_[kv][static_cast<size_t>(r) * width_ + i] = fp4kv::FloatToBf16Bits(x);
          amax_[kv] =
              std::max(amax_[kv], std::fabs(fp4kv::Bf16BitsToFloat(fp4kv::FloatToBf16Bits(x))));
        }
      }
    }
  }
  const uint16_t* Row(int kv, uint64_t key) const {
    return bank_[kv].data() + static_cast<size_t>(Mix(key) % rows_) * width_;
  }
  int width() const { return width_; }
  float amax(int kv) const { return amax_[kv]; }

 private:
  int width_, rows_;
  std::vector<uint16_t> bank_[2];
  float amax_[2];
};

struct Request {
  enum State { kWaiting, kPrefill, kDecode, kDone };
  int id = 0;
  int prompt = 0, decode = 0;
  int stored = 0;     // tokens in the cache
  int generated = 0;  // decode tokens appended
  int cached = 0;     // prompt tokens shared from the prefix cache at admission
  int parent = -1;    // forked from this request at `fork_len` tokens
  int fork_len = 0;
  State state = kWaiting;
  SequenceId seq = 0;
  // Token ids of the prompt and of the tokens it will generate (decided up
  // front: the "sampler" is a hash), and key[t], a hash of ids[0..t].
  std::vector<int32_t> ids;
  std::vector<uint64_t> key;
};

// Fills r.key from r.ids (a running hash of the token prefix).
void KeyTokens(Request& r) {
  r.key.resize(r.ids.size());
  uint64_t h = 0x5eed;
  for (size_t t = 0; t < r.ids.size(); ++t) r.key[t] = h = Mix(h ^ static_cast<uint32_t>(r.ids[t]));
}

// Key of token `pos` of request `r` in a layer: a function of the token
// prefix, like a real model's K/V.
uint64_t TokenKey(const std::vector<Request>& reqs, int r, int pos, int layer) {
  return Mix(reqs[r].key[pos] + static_cast<uint64_t>(layer));
}

struct ErrorStats {
  double err2[2] = {0, 0}, sig2[2] = {0, 0};
  double max_rel[2] = {0, 0};  // max |err| / amax of the row's 16-block
  int64_t rows = 0;
  int seqs = 0;
};

// One tensor-parallel rank: a cache of kv_heads / tp heads, its bound ops,
// stream, buffers (a captured graph bakes their addresses in) and graphs.
struct Rank {
  int gpu = 0;  // CUDA device ordinal
  fp4kv::Device device;
  absl::StatusOr<KVCache> cache = absl::UnknownError("not created");
  absl::StatusOr<fp4kv::CacheAppender> appender = absl::UnknownError("not created");
  absl::StatusOr<fp4kv::CacheMaterializer> materializer =
      absl::FailedPreconditionError("not used (--read=attention)");
  absl::StatusOr<fp4kv::CacheAttention> attention =
      absl::FailedPreconditionError("not used (--read=materialize)");
  // Steps with prefill chunks: max_q_len = --chunk, a query row per new token.
  absl::StatusOr<fp4kv::CacheAttention> prefill_attention =
      absl::FailedPreconditionError("not used (--read=materialize)");
  cudaStream_t cs = nullptr;
  fp4kv::Stream stream = nullptr;
  std::vector<std::vector<uint16_t>> host_in;  // K/V rows (one staging buffer on a GPU)
  std::vector<void*> in_ptr, q_ptr, o_ptr;     // per layer: K/V inputs; queries, outputs
  std::vector<void*> pq_ptr, po_ptr;           // per layer: prefill steps' queries, outputs
  void *check_q = nullptr, *check_o = nullptr;  // CPU check: [S, HQR, D] each
  std::vector<std::vector<uint8_t>> host_buffers;
  std::vector<void*> device_buffers;
  int64_t W = 0;  // FP8 workspace pages at capacity
  void *ws = nullptr, *attn_ws = nullptr;
  int64_t attn_ws_bytes = 0;
  cudaGraphExec_t graph_append = nullptr, graph_read = nullptr;
  cudaEvent_t ev[3] = {nullptr, nullptr, nullptr};
  // --overlap: the ops bound to each step slot, a graph pair and events per
  // slot, pinned K/V rows and token ids per slot (rewritten once the slot's
  // previous copies are done: in_done), and the "sampled" ids on the device.
  std::vector<fp4kv::CacheAppender> slot_appender;
  std::vector<fp4kv::CacheAttention> slot_attention, slot_prefill_attention;
  std::vector<fp4kv::CacheMaterializer> slot_materializer;
  cudaGraphExec_t slot_graph_append[2] = {nullptr, nullptr}, slot_graph_read[2] = {nullptr, nullptr};
  cudaEvent_t slot_ev[2][3] = {{nullptr, nullptr, nullptr}, {nullptr, nullptr, nullptr}};
  cudaEvent_t in_done[2] = {nullptr, nullptr};
  bool in_pending[2] = {false, false};
  uint16_t* pinned_in[2] = {nullptr, nullptr};
  int32_t* pinned_ids[2] = {nullptr, nullptr};
  int32_t* d_ids[2] = {nullptr, nullptr};
};

// Host decisions as text: with --tp, every rank's text must be equal.
std::string Text(const std::string& s) { return s; }
std::string Text(const absl::Status& s) { return s.ok() ? "OK" : s.ToString(); }
std::string Text(const absl::StatusOr<SequenceId>& s) {
  return s.ok() ? absl::StrCat("seq ", *s) : Text(s.status());
}
std::string Text(const absl::StatusOr<fp4kv::PrefixSequence>& p) {
  return p.ok() ? absl::StrCat("seq ", p->seq, " cached tokens ", p->cached_tokens)
                : Text(p.status());
}
std::string Text(const fp4kv::PrefixMatch& m) {
  return absl::StrCat("tokens ", m.tokens, " pages ", m.pages, " evictable ", m.pages_evictable);
}
std::string Text(const fp4kv::KVEventBatch& b) {
  std::string out = absl::StrCat("dropped ", b.dropped, "\n");
  for (const fp4kv::KVEvent& e : b.events) {
    absl::StrAppend(&out, static_cast<int>(e.type), " [");
    for (const fp4kv::BlockHash& h : e.block_hashes) absl::StrAppend(&out, h.ToHex(), " ");
    absl::StrAppend(&out, "] parent ", e.has_parent ? e.parent_block_hash.ToHex() : "-", " ids ",
                    absl::StrJoin(e.token_ids, ","), " size ", e.block_size, " key '", e.extra_key,
                    "'\n");
  }
  return out;
}
// A step's StepInfo and host step buffers (slots, lengths, block tables).
std::string StepText(const KVCache& c, const absl::StatusOr<StepInfo>& s) {
  if (!s.ok()) return Text(s.status());
  const StepInfo& i = *s;
  std::string out = absl::StrCat("seqs ", i.num_seqs, " tokens ", i.num_tokens, " max len ",
                                 i.max_seq_len, " pages ", i.num_pages, " fp8 ",
                                 i.fp8_workspace_pages, " allocated ", i.pages_allocated,
                                 " copied ", i.pages_copied, " evicted ", i.pages_evicted, "\n");
  absl::StrAppend(&out, "slots ", absl::StrJoin(c.host_slot_mapping(), ","), "\nlens ",
                  absl::StrJoin(c.host_seq_lens(), ","), "\nkv indptr ",
                  absl::StrJoin(c.host_kv_page_indptr(), ","), "\ntoken indptr ",
                  absl::StrJoin(c.host_token_indptr(), ","), "\n");
  const absl::Span<const int32_t> indptr = c.host_kv_page_indptr();
  for (int r = 0; r < i.num_seqs; ++r) {
    absl::StrAppend(&out, "table ", r, ": ",
                    absl::StrJoin(c.host_block_table(r).subspan(0, indptr[r + 1] - indptr[r]), ","),
                    "\n");
  }
  return out;
}
// The decision counts of Stats() and the pages of sequences `ids`.
std::string StateText(const KVCache& c, const std::vector<SequenceId>& ids) {
  const fp4kv::KVCacheStats s = c.Stats();
  std::string out = absl::StrCat(
      "pages total/free/used/shared/cached/indexed ", s.pages_total, "/", s.pages_free, "/",
      s.pages_used, "/", s.pages_shared, "/", s.pages_cached, "/", s.pages_indexed, "; seqs ",
      s.num_sequences, " tokens stored/resident ", s.tokens_stored, "/", s.tokens_resident,
      " wasted ", s.wasted_slots, "; evictions ", s.evictions, "; prefix ", s.prefix_queries, "/",
      s.prefix_query_tokens, "/", s.prefix_hit_tokens, "; events ", s.events_pending, "/",
      s.events_dropped, "\n");
  for (const auto& [id, len] : s.sequence_lengths) absl::StrAppend(&out, id, ":", len, " ");
  out += "\n";
  for (SequenceId id : ids) {
    absl::StatusOr<absl::Span<const int32_t>> p = c.SequencePages(id);
    absl::StrAppend(&out, "seq ", id, ": ",
                    p.ok() ? absl::StrJoin(*p, ",") : std::string(p.status().message()), "\n");
  }
  return out;
}

// Aborts unless every rank described its answer to `what` alike.
void Agree(const std::vector<std::string>& got, int64_t step, const char* what) {
  for (size_t r = 1; r < got.size(); ++r) {
    if (got[r] == got[0]) continue;
    std::fprintf(stderr,
                 "tp: step %lld: %s differs between rank 0 and rank %zu\n--- rank 0:\n%s\n"
                 "--- rank %zu:\n%s\n",
                 static_cast<long long>(step), what, r, got[0].c_str(), r, got[r].c_str());
    std::exit(1);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Flags f;
  if (!f.Parse(argc, argv)) return 2;
  int gpu_count = 0;
  const cudaError_t probe = cudaGetDeviceCount(&gpu_count);
  if (probe != cudaSuccess) (void)cudaGetLastError();
  const bool have_gpu = probe == cudaSuccess && gpu_count > 0;
  bool gpu = f.device == "cuda" || (f.device == "auto" && have_gpu);
  if (gpu && !have_gpu) {
    std::fprintf(stderr, "--device=cuda: no GPU on this machine (%s)\n",
                 probe == cudaSuccess ? "no CUDA device found" : cudaGetErrorName(probe));
    return 1;
  }
  f.FillDefaults(gpu);
  if (f.layers < 1 || f.requests < 1 || f.max_batch < 1 || f.prompt_min < 1 ||
      f.prompt_max < f.prompt_min || f.decode_min < 1 || f.decode_max < f.decode_min ||
      f.samples < 0 || f.error_seqs < 0 || (f.read != "attention" && f.read != "materialize")) {
    std::fprintf(stderr,
                 "bad flags: need layers, requests, max_batch, prompt_min, decode_min >= 1, "
                 "prompt_max >= prompt_min, decode_max >= decode_min, samples >= 0, "
                 "read=attention|materialize\n");
    return 2;
  }
  const int TP = f.tp;
  const int HQ = f.qo_heads > 0 ? f.qo_heads : 4 * f.kv_heads;
  if (TP < 1 || f.kv_heads % TP != 0 || HQ % TP != 0) {
    std::fprintf(stderr,
                 "--tp=%d: each rank holds kv_heads / tp KV heads and qo_heads / tp query heads, "
                 "so tp must be >= 1 and divide kv_heads (%d) and qo_heads (%d)\n",
                 TP, f.kv_heads, HQ);
    return 2;
  }
  if (gpu) {
    cudaDeviceProp prop;
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: CUDA 0 (%s); decode steps replay one captured CUDA graph\n", prop.name);
  } else {
    std::printf("device: CPU (%s): every op runs through the CPU reference; smaller defaults\n",
                f.device == "cpu"
                    ? "--device=cpu"
                    : (probe == cudaSuccess || probe == cudaErrorNoDevice ||
                               probe == cudaErrorInsufficientDriver
                           ? "no GPU on this machine"
                           : cudaGetErrorName(probe)));
  }
  const int L = f.layers, H = f.kv_heads, D = f.head_dim, PS = f.page_size;
  const int HR = H / TP, HQR = HQ / TP;  // one rank's KV and query heads
  const int total_requests = f.requests + std::max(0, f.samples);
  const int max_seq = f.prompt_max + f.decode_max;
  const int M = (max_seq + PS - 1) / PS;
  const int S = f.max_batch + std::max(0, f.samples);
  const int T = f.chunk;
  if (T < S) {
    std::fprintf(stderr, "--chunk must be at least max_batch + samples (%d)\n", S);
    return 2;
  }

  RowBank bank(H, D, 2048, f.seed);
  fp4kv::KVCacheOptions o;
  o.num_layers = L;
  o.geometry.num_kv_heads = HR;
  o.geometry.head_dim_k = o.geometry.head_dim_v = D;
  o.geometry.page_size = PS;
  o.geometry.num_pages = f.pool_pages > 0 ? f.pool_pages : static_cast<int64_t>(S) * M;
  // No global scales: each layer calibrates from its first rows (with
  // headroom); the counters show whether later rows outgrew it.
  o.count_scale_events = true;
  o.max_seqs_per_step = S;
  o.max_tokens_per_step = T;
  o.max_pages_per_seq = M;
  o.prefix_cache.enabled = f.prefix_cache != 0;
  if (f.prefix_cache != 0) o.prefix_cache.host_bytes = int64_t{f.host_prefix_mib} << 20;
  const bool overlap = f.overlap != 0;
  o.step_slots = overlap ? 2 : 1;
  // With --tp the KV events are compared across ranks every step.
  if (TP > 1) o.prefix_cache.max_pending_events = 1 << 14;
  // Ranks: the same options (num_pages explicit), kv_heads / tp heads each.
  std::vector<Rank> ranks(TP);
  auto use = [&](const Rank& k) {
    if (gpu) CHECK_CUDA(cudaSetDevice(k.gpu));
  };
  double pool_bytes = 0, bytes_per_token = 0;  // all ranks
  for (int r = 0; r < TP; ++r) {
    Rank& k = ranks[r];
    k.gpu = gpu && gpu_count >= TP ? r : 0;
    k.device = gpu ? fp4kv::Device::Cuda(k.gpu) : fp4kv::Device::Cpu();
    use(k);
    o.device = k.device;
    k.cache = KVCache::Create(o);
    CHECK_OK(k.cache.status());
    pool_bytes += k.cache->Stats().pool_bytes;
    bytes_per_token += k.cache->Stats().bytes_per_token;
  }
  const fp4kv::KVCacheStats st0 = ranks[0].cache->Stats();
  std::printf(
      "model: %d layers, %d KV heads, head_dim %d, page %d tokens; pool %lld pages (%.1f MiB), "
      "%.1f KiB/token (bf16: %.1f KiB, %.2fx)\n",
      L, H, D, PS, static_cast<long long>(st0.pages_total), pool_bytes / 1048576.0,
      bytes_per_token / 1024.0, 4.0 * L * H * D / 1024.0, 4.0 * L * H * D / bytes_per_token);
  if (TP > 1) {
    std::printf(
        "tp: %d ranks of %d KV heads and %d query heads, %s; the same calls in the same "
        "order on every rank, host decisions compared after each\n",
        TP, HR, HQR,
        !gpu ? "all on the CPU"
             : (gpu_count >= TP ? "rank r on GPU r, each its own stream and graphs"
                                : "all on GPU 0, each its own stream and graphs"));
  }

  const bool attend = f.read == "attention";
  for (Rank& k : ranks) {
    use(k);
    k.appender = k.cache->appender(DType::kBF16);
    CHECK_OK(k.appender.status());
    if (attend) {
      // Decode-only steps: max_q_len 1, so their rows run on the fastest
      // decode kernel family (on CUDA, tokens-in-M while group * max_q_len
      // <= 8); an op of a larger max_q_len would put them on the rows-in-M
      // kernels. This op's steps are the ones captured as graphs.
      fp4kv::CacheAttentionOptions ao;
      ao.num_qo_heads = HQR;
      k.attention = k.cache->attention(ao);
      CHECK_OK(k.attention.status());
      // Steps with prefill chunks (and decode rows beside them): a query row
      // per new token; on CUDA chunks of more than kDecodeRowsQLen tokens
      // take the prefill kernel, the rest the decode kernels, in one Run().
      ao.max_q_len = T;
      k.prefill_attention = k.cache->attention(ao);
      CHECK_OK(k.prefill_attention.status());
    } else {
      k.materializer = k.cache->materializer();
      CHECK_OK(k.materializer.status());
    }
    for (int slot = 0; overlap && slot < 2; ++slot) {
      absl::StatusOr<fp4kv::CacheAppender> a = k.appender->ForSlot(slot);
      CHECK_OK(a.status());
      k.slot_appender.push_back(*a);
      if (attend) {
        absl::StatusOr<fp4kv::CacheAttention> at = k.attention->ForSlot(slot);
        CHECK_OK(at.status());
        k.slot_attention.push_back(*at);
        absl::StatusOr<fp4kv::CacheAttention> pat = k.prefill_attention->ForSlot(slot);
        CHECK_OK(pat.status());
        k.slot_prefill_attention.push_back(*pat);
      } else {
        absl::StatusOr<fp4kv::CacheMaterializer> m = k.materializer->ForSlot(slot);
        CHECK_OK(m.status());
        k.slot_materializer.push_back(*m);
      }
    }
  }
  if (overlap) {
    std::printf(
        "overlap: two step slots; step N+1 prepared while step N runs, decode token ids "
        "given late (SetTokenIds%s)\n",
        gpu ? " from device memory" : "");
  }
  if (attend) {
    std::printf(
        "reads: attention from the NVFP4 pages, %d query heads (group %d); decode-only steps "
        "one query row per sequence (max_q_len 1), steps with prefill chunks one per new token "
        "(max_q_len %d); synthetic queries\n",
        HQ, HQ / H, T);
  } else {
    std::printf("reads: FP8 materialization of every active page\n");
  }

  // Fixed buffers of each rank: per-layer K/V inputs [T, HR, D], queries and
  // outputs [S, HQR, D] (decode-only steps) and [T, HQR, D] (steps with
  // prefill chunks), the attention workspace, the FP8 workspace at capacity
  // (a captured graph bakes these addresses in).
  const size_t in_elems = static_cast<size_t>(T) * HR * D;
  // Bytes on a rank's device (host memory for the CPU); freed at exit.
  auto alloc = [&](Rank& k, size_t bytes) -> void* {
    if (bytes == 0) bytes = 256;
    if (!gpu) {
      k.host_buffers.emplace_back(bytes);
      return k.host_buffers.back().data();
    }
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, bytes));
    k.device_buffers.push_back(p);
    return p;
  };
  for (Rank& k : ranks) {
    use(k);
    if (gpu) CHECK_CUDA(cudaStreamCreateWithFlags(&k.cs, cudaStreamNonBlocking));
    k.stream = reinterpret_cast<fp4kv::Stream>(k.cs);
    k.host_in.assign(gpu ? 1 : 2 * L, std::vector<uint16_t>(in_elems));
    k.in_ptr.resize(2 * L);
    for (int i = 0; i < 2 * L; ++i) {
      if (gpu) {
        CHECK_CUDA(cudaMalloc(&k.in_ptr[i], in_elems * 2));
      } else {
        k.in_ptr[i] = k.host_in[i].data();
      }
    }
    if (gpu && overlap) {
      for (int slot = 0; slot < 2; ++slot) {
        void *in = nullptr, *ids = nullptr, *d_ids = nullptr;
        CHECK_CUDA(cudaMallocHost(&in, 2 * L * in_elems * 2));
        CHECK_CUDA(cudaMallocHost(&ids, static_cast<size_t>(S) * 4));
        CHECK_CUDA(cudaMalloc(&d_ids, static_cast<size_t>(S) * 4));
        k.pinned_in[slot] = static_cast<uint16_t*>(in);
        k.pinned_ids[slot] = static_cast<int32_t*>(ids);
        k.d_ids[slot] = static_cast<int32_t*>(d_ids);
        CHECK_CUDA(cudaEventCreateWithFlags(&k.in_done[slot], cudaEventDisableTiming));
        for (cudaEvent_t& e : k.slot_ev[slot]) CHECK_CUDA(cudaEventCreate(&e));
      }
    }
    k.W = k.cache->Fp8WorkspacePagesAtCapacity();
    if (k.materializer.ok()) k.ws = alloc(k, static_cast<size_t>(k.W) * 2 * HR * PS * D);
    if (attend) {
      // Both attention ops run on the rank's stream, never at once: one
      // workspace serves them.
      k.attn_ws_bytes =
          std::max(k.attention->WorkspaceBytes(), k.prefill_attention->WorkspaceBytes());
      k.attn_ws = alloc(k, static_cast<size_t>(k.attn_ws_bytes));
    }
  }
  // Queries per layer, synthetic (random bf16; a model's would come from the
  // layer): [S, HQ, D] for decode-only steps, [T, HQ, D] for steps with
  // prefill chunks; rank r reads its query heads [r * HQR, (r + 1) * HQR).
  const size_t q_elems = static_cast<size_t>(S) * HQR * D;
  const size_t pq_elems = static_cast<size_t>(T) * HQR * D;
  if (attend) {
    std::normal_distribution<float> normal;
    std::mt19937_64 qrng(f.seed + 17), pqrng(f.seed + 23);
    // Fills `rows` random query rows of layer l into each rank's buffers
    // (appended to ptrs(k)), with output buffers of the same size (outs(k)).
    auto make_q = [&](int rows, std::mt19937_64& g, auto ptrs, auto outs) {
      const size_t elems = static_cast<size_t>(rows) * HQR * D;
      std::vector<uint16_t> q(static_cast<size_t>(rows) * HQ * D), q_rank(elems);
      for (int l = 0; l < L; ++l) {
        for (uint16_t& x : q) x = fp4kv::FloatToBf16Bits(normal(g));
        for (int r = 0; r < TP; ++r) {
          Rank& k = ranks[r];
          use(k);
          for (int i = 0; i < rows; ++i) {
            std::memcpy(q_rank.data() + static_cast<size_t>(i) * HQR * D,
                        q.data() + (static_cast<size_t>(i) * HQ + r * HQR) * D, HQR * D * 2);
          }
          ptrs(k).push_back(alloc(k, elems * 2));
          outs(k).push_back(alloc(k, elems * 2));
          if (gpu) {
            CHECK_CUDA(cudaMemcpy(ptrs(k)[l], q_rank.data(), elems * 2, cudaMemcpyHostToDevice));
          } else {
            std::memcpy(ptrs(k)[l], q_rank.data(), elems * 2);
          }
        }
      }
    };
    make_q(
        S, qrng, [](Rank& k) -> std::vector<void*>& { return k.q_ptr; },
        [](Rank& k) -> std::vector<void*>& { return k.o_ptr; });
    make_q(
        T, pqrng, [](Rank& k) -> std::vector<void*>& { return k.pq_ptr; },
        [](Rank& k) -> std::vector<void*>& { return k.po_ptr; });
    for (Rank& k : ranks) {
      if (gpu) break;
      k.check_q = alloc(k, q_elems * 2);
      k.check_o = alloc(k, q_elems * 2);
    }
  }
  auto view = [&](const Rank& k, void* p) {
    return TensorView::Contiguous(p, DType::kBF16, {T, HR, D}, k.device);
  };
  auto qview = [&](const Rank& k, void* p) {
    return TensorView::Contiguous(p, DType::kBF16, {S, HQR, D}, k.device);
  };
  auto pqview = [&](const Rank& k, void* p) {
    return TensorView::Contiguous(p, DType::kBF16, {T, HQR, D}, k.device);
  };
  // The step's ops: with --overlap those bound to the step's slot (so that
  // a graph captured for a slot replays on that slot's step buffers).
  int cur_slot = 0;
  bool cur_prefill = false;  // the step has prefill chunks: the max_q_len T op
  auto append_layers = [&](Rank& k) {
    const fp4kv::CacheAppender& app = overlap ? k.slot_appender[cur_slot] : *k.appender;
    for (int l = 0; l < L; ++l) {
      CHECK_OK(app.Run(l, view(k, k.in_ptr[2 * l]), view(k, k.in_ptr[2 * l + 1]), k.stream));
    }
  };
  auto read_layers = [&](Rank& k) {
    for (int l = 0; l < L; ++l) {
      if (attend && cur_prefill) {
        const fp4kv::CacheAttention& at =
            overlap ? k.slot_prefill_attention[cur_slot] : *k.prefill_attention;
        CHECK_OK(at.Run(l, pqview(k, k.pq_ptr[l]), pqview(k, k.po_ptr[l]), k.attn_ws,
                        k.attn_ws_bytes, k.stream));
      } else if (attend) {
        const fp4kv::CacheAttention& at = overlap ? k.slot_attention[cur_slot] : *k.attention;
        CHECK_OK(at.Run(l, qview(k, k.q_ptr[l]), qview(k, k.o_ptr[l]), k.attn_ws, k.attn_ws_bytes,
                        k.stream));
      } else {
        const fp4kv::CacheMaterializer& m =
            overlap ? k.slot_materializer[cur_slot] : *k.materializer;
        const std::vector<int64_t> s = k.cache->Fp8WorkspaceShape(k.W);
        CHECK_OK(m.Run(
            l, TensorView::Contiguous(k.ws, DType::kE4M3, {s[0], s[1], s[2], s[3], s[4]}, k.device),
            k.stream));
      }
    }
  };
  // A step's layers run as append_layers then read_layers: in a real model
  // layer l's reads come before layer l+1's appends; here each phase runs
  // over all layers so that a step can be timed per phase.

  // Requests: f.requests arrive over time; request 0 is forked into
  // f.samples children once its prompt is in.
  // Prompts: a shared system prompt (about half of prompt_min) and a user
  // turn; a follow-up continues an earlier request's whole conversation.
  std::mt19937_64 rng(f.seed);
  auto random_ids = [&](int n, std::vector<int32_t>* out) {
    for (int i = 0; i < n; ++i) out->push_back(static_cast<int32_t>(rng() % 151936));
  };
  std::vector<std::vector<int32_t>> system(std::max(1, f.system_prompts));
  for (auto& sp : system) random_ids(std::max(1, f.prompt_min / 2), &sp);
  std::vector<Request> reqs;
  int64_t follow_up_requests = 0;
  for (int i = 0; i < f.requests; ++i) {
    Request r;
    r.id = i;
    r.prompt = std::uniform_int_distribution<int>(f.prompt_min, f.prompt_max)(rng);
    r.decode = std::uniform_int_distribution<int>(f.decode_min, f.decode_max)(rng);
    const int turn = std::uniform_int_distribution<int>(8, std::max(8, f.prompt_min / 2))(rng);
    const int prev = i > 0 ? static_cast<int>(rng() % i) : -1;
    if (prev >= 0 && static_cast<int>(rng() % 100) < f.follow_ups &&
        static_cast<int>(reqs[prev].ids.size()) + turn <= f.prompt_max) {
      r.ids = reqs[prev].ids;  // the earlier turn's prompt and answer
      ++follow_up_requests;
    } else {
      r.ids = system[rng() % system.size()];
    }
    r.prompt = std::max(r.prompt, static_cast<int>(r.ids.size()) + turn);
    r.prompt = std::min(r.prompt, std::max(f.prompt_max, static_cast<int>(r.ids.size()) + 1));
    random_ids(r.prompt - static_cast<int>(r.ids.size()), &r.ids);
    random_ids(r.decode, &r.ids);  // what it will generate
    KeyTokens(r);
    reqs.push_back(r);
  }
  reqs.reserve(total_requests);
  std::deque<int> waiting;
  int arrived = 0;
  std::vector<int> active;
  bool forked = f.samples <= 0;
  ErrorStats err;
  int64_t prefill_tokens = 0, decode_tokens = 0, steps = 0, replays = 0, preemptions = 0;
  int64_t prefill_saved = 0;  // prompt tokens shared from the prefix cache instead of prefilled
  int64_t peak_pages = 0, copies = 0;
  double prepare_s = 0, layers_s = 0;  // host time in PrepareStep; the layers' ops (synchronized)
  int done = 0;
  int done_at_preemption = -1;  // `done` when a request was last preempted
  if (gpu) {
    for (Rank& k : ranks) {
      use(k);
      for (cudaEvent_t& e : k.ev) CHECK_CUDA(cudaEventCreate(&e));
    }
  }
  double decode_append_ms = 0, decode_read_ms = 0;  // summed over replayed steps (rank 0)
  // Steps with prefill chunks (rank 0): their count, the time of their
  // layers' appends and reads (CUDA events on a GPU, a steady clock on the
  // CPU), the prefill tokens their attention covered (of them, those of
  // chunks after a prefix hit, and such chunks).
  int64_t prefill_steps = 0, prefill_attended = 0, prefill_attended_hit = 0, hit_chunks = 0;
  double prefill_append_ms = 0, prefill_read_ms = 0;
  // The CPU check of the prefill steps' attention (layer 0, every rank).
  int64_t checked_steps = 0, checked_rows = 0, checked_last = 0, checked_hit_chunks = 0;
  double check_s = 0;  // host time of the check (not counted in layers_s)
  // --overlap: host time between one step's launch and the next one's, the
  // device time of the steps, and the part of the host time they hid.
  bool have_prev = false, prev_replay = false, prev_prefill = false;
  int prev_slot = 0;
  std::chrono::steady_clock::time_point prev_launched;
  double host_between_s = 0, device_step_s = 0, hidden_s = 0;
  int64_t overlapped_steps = 0;
  // Every cache call goes to every rank in rank order; with --tp the answers
  // (as text) must agree. Returns rank 0's answer.
  const auto text = [](const KVCache&, const auto& x) { return Text(x); };
  auto on_all = [&](const char* what, auto call, auto describe) {
    std::vector<decltype(call(ranks[0]))> got;
    for (Rank& k : ranks) {
      use(k);
      got.push_back(call(k));
    }
    if (TP > 1) {
      std::vector<std::string> texts;
      for (int r = 0; r < TP; ++r) texts.push_back(describe(*ranks[r].cache, got[r]));
      Agree(texts, steps, what);
    }
    return std::move(got[0]);
  };
  auto sync_all = [&]() {
    for (Rank& k : ranks) {
      use(k);
      if (gpu) CHECK_CUDA(cudaStreamSynchronize(k.cs));
    }
  };

  // Error of a finished request's dequantized K/V (layers 0 and L-1).
  // With --tp each rank dequantizes its heads; the error covers all of them.
  auto measure_rank = [&](const Request& r, int rank) {
    Rank& k = ranks[rank];
    use(k);
    const KVCache& cache = *k.cache;
    const cudaStream_t cs = k.cs;
    const fp4kv::Stream stream = k.stream;
    const fp4kv::Device device = k.device;
    const int H = HR;
    const int len = r.stored;
    absl::StatusOr<absl::Span<const int32_t>> pages = cache.SequencePages(r.seq);
    CHECK_OK(pages.status());
    std::vector<int32_t> table(pages->begin(), pages->end());
    const int32_t lens[1] = {len};
    const size_t n = static_cast<size_t>(len) * H * D;
    std::vector<uint16_t> out[2] = {std::vector<uint16_t>(n), std::vector<uint16_t>(n)};
    void *d_table = table.data(), *d_lens = const_cast<int32_t*>(lens),
         *d_out[2] = {out[0].data(), out[1].data()};
    if (gpu) {
      CHECK_CUDA(cudaMalloc(&d_table, table.size() * 4));
      CHECK_CUDA(cudaMalloc(&d_lens, 4));
      CHECK_CUDA(cudaMalloc(&d_out[0], n * 2));
      CHECK_CUDA(cudaMalloc(&d_out[1], n * 2));
      // On the cache's stream (non-blocking: a legacy-stream copy would not be ordered).
      CHECK_CUDA(
          cudaMemcpyAsync(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice, cs));
      CHECK_CUDA(cudaMemcpyAsync(d_lens, lens, 4, cudaMemcpyHostToDevice, cs));
    }
    for (int layer = 0; layer < L; layer += std::max(1, L - 1)) {  // first and last
      CHECK_OK(fp4kv::DequantizePaged(
          cache.LayerCache(layer),
          TensorView::Contiguous(d_table, DType::kI32, {1, static_cast<int64_t>(table.size())},
                                 device),
          TensorView::Contiguous(d_lens, DType::kI32, {1}, device),
          TensorView::Contiguous(d_out[0], DType::kBF16, {1, len, H, D}, device),
          TensorView::Contiguous(d_out[1], DType::kBF16, {1, len, H, D}, device),
          fp4kv::GlobalScale::Pointer(cache.global_scale_ptr(layer, 0)),
          fp4kv::GlobalScale::Pointer(cache.global_scale_ptr(layer, 1)), stream));
      if (gpu) {
        CHECK_CUDA(cudaStreamSynchronize(cs));
        CHECK_CUDA(cudaMemcpy(out[0].data(), d_out[0], n * 2, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(out[1].data(), d_out[1], n * 2, cudaMemcpyDeviceToHost));
      }
      for (int kv = 0; kv < 2; ++kv) {
        for (int t = 0; t < len; ++t) {
          const uint16_t* x = bank.Row(kv, TokenKey(reqs, r.id, t, layer) * 2 + kv) + rank * HR * D;
          const uint16_t* y = out[kv].data() + static_cast<size_t>(t) * H * D;
          for (int b = 0; b < H * D; b += 16) {
            float amax = 0;
            for (int i = b; i < b + 16; ++i)
              amax = std::max(amax, std::fabs(fp4kv::Bf16BitsToFloat(x[i])));
            for (int i = b; i < b + 16; ++i) {
              const double xv = fp4kv::Bf16BitsToFloat(x[i]);
              const double e = xv - fp4kv::Bf16BitsToFloat(y[i]);
              err.err2[kv] += e * e;
              err.sig2[kv] += xv * xv;
              if (amax > 0) err.max_rel[kv] = std::max(err.max_rel[kv], std::fabs(e) / amax);
            }
          }
        }
      }
      if (rank == 0) err.rows += 2 * len;
    }
    if (gpu) {
      CHECK_CUDA(cudaFree(d_table));
      CHECK_CUDA(cudaFree(d_lens));
      CHECK_CUDA(cudaFree(d_out[0]));
      CHECK_CUDA(cudaFree(d_out[1]));
    }
  };
  auto measure = [&](const Request& r) {
    for (int rank = 0; rank < TP; ++rank) measure_rank(r, rank);
    ++err.seqs;
  };

  // CPU check of a prefill step's attention, layer 0 (its output rows were
  // poisoned before the step): every new token's row is written, and the row
  // of each entry's last token equals bit for bit what the max_q_len 1 op
  // (one query row per sequence: that last token's) computes for it. The CPU
  // reference computes each row alone in fp64, so the two are the same math
  // on the same row.
  const uint16_t kPoison = 0xffff;  // a bf16 NaN: never written by attention
  auto poison_prefill_out = [&](Rank& k) {
    std::fill_n(static_cast<uint16_t*>(k.po_ptr[0]), pq_elems, kPoison);
  };
  auto check_prefill = [&](Rank& k, int rank, const std::vector<StepEntry>& entries,
                           const std::vector<int>& entry_req) {
    const size_t row = static_cast<size_t>(HQR) * D;
    const uint16_t* pq = static_cast<const uint16_t*>(k.pq_ptr[0]);
    const uint16_t* po = static_cast<const uint16_t*>(k.po_ptr[0]);
    uint16_t* cq = static_cast<uint16_t*>(k.check_q);
    const uint16_t* co = static_cast<const uint16_t*>(k.check_o);
    std::vector<int64_t> last(entries.size());
    int64_t tokens = 0;
    for (size_t j = 0; j < entries.size(); ++j) {
      tokens += entries[j].num_new_tokens;
      last[j] = tokens - 1;
      std::memcpy(cq + j * row, pq + last[j] * row, row * 2);
    }
    const fp4kv::CacheAttention& one = overlap ? k.slot_attention[cur_slot] : *k.attention;
    CHECK_OK(
        one.Run(0, qview(k, k.check_q), qview(k, k.check_o), k.attn_ws, k.attn_ws_bytes, k.stream));
    for (int64_t t = 0; t < tokens; ++t) {
      for (size_t i = 0; i < row; ++i) {
        if (po[t * row + i] != kPoison) continue;
        std::fprintf(stderr,
                     "check: step %lld rank %d: the attention row of new token %lld "
                     "was not written\n",
                     static_cast<long long>(steps), rank, static_cast<long long>(t));
        std::exit(1);
      }
    }
    for (size_t j = 0; j < entries.size(); ++j) {
      if (std::memcmp(co + j * row, po + last[j] * row, row * 2) != 0) {
        std::fprintf(stderr,
                     "check: step %lld rank %d entry %zu: the last token's attention row "
                     "differs from the max_q_len 1 op's\n",
                     static_cast<long long>(steps), rank, j);
        std::exit(1);
      }
      const Request& r = reqs[entry_req[j]];
      if (rank == 0 && r.state == Request::kPrefill && r.cached > 0) ++checked_hit_chunks;
    }
    if (rank == 0) {
      ++checked_steps;
      checked_rows += tokens;
      checked_last += static_cast<int64_t>(entries.size());
    }
  };

  const auto t_start = std::chrono::steady_clock::now();
  while (done < static_cast<int>(reqs.size()) || arrived < f.requests) {
    // Arrivals: one or two new requests every few steps.
    if (arrived < f.requests && (steps % 3 == 0 || waiting.empty())) {
      const int n = 1 + static_cast<int>(rng() % 2);
      for (int i = 0; i < n && arrived < f.requests; ++i) waiting.push_back(arrived++);
    }
    // Admission: a new request joins when a slot is free, and not between a
    // preemption and the next completion (a preempted request admitted again
    // at once would make the same step fail again, forever).
    while (!waiting.empty() && static_cast<int>(active.size()) < f.max_batch &&
           done_at_preemption != done) {
      Request& r = reqs[waiting.front()];
      waiting.pop_front();
      if (f.prefix_cache != 0) {
        // Shares the cached pages of the prompt's longest cached prefix.
        absl::StatusOr<fp4kv::PrefixSequence> ps = on_all(
            "CreateSequenceFromPrefix",
            [&](Rank& k) {
              return k.cache->CreateSequenceFromPrefix(
                  absl::Span<const int32_t>(r.ids.data(), r.prompt));
            },
            text);
        CHECK_OK(ps.status());
        r.seq = ps->seq;
        r.stored = r.cached = static_cast<int>(ps->cached_tokens);
        prefill_saved += ps->cached_tokens;
      } else {
        absl::StatusOr<SequenceId> created = on_all(
            "CreateSequence", [&](Rank& k) { return k.cache->CreateSequence(); }, text);
        CHECK_OK(created.status());
        r.seq = *created;
        r.cached = 0;
      }
      r.state = Request::kPrefill;
      active.push_back(r.id);
    }
    // The step: one token for each decoding request, then prefill chunks.
    std::vector<StepEntry> entries;
    int budget = T;
    bool decode_only = true;
    for (int id : active) {
      if (reqs[id].state == Request::kDecode) {
        // --overlap: the id of the token sampled by the step in flight is
        // not known yet; it is given after the launch (SetTokenIds).
        entries.push_back({reqs[id].seq, 1,
                           overlap ? absl::Span<const int32_t>()
                                   : absl::Span<const int32_t>(
                                         reqs[id].ids.data() + reqs[id].stored, 1)});
        --budget;
      }
    }
    for (int id : active) {
      Request& r = reqs[id];
      if (r.state != Request::kPrefill || budget == 0) continue;
      const int n = std::min(budget, r.prompt - r.stored);
      entries.push_back({r.seq, n, {r.ids.data() + r.stored, static_cast<size_t>(n)}});
      budget -= n;
      decode_only = false;
    }
    if (entries.empty()) continue;
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<StepInfo> info = on_all(
        "PrepareStep", [&](Rank& k) { return k.cache->PrepareStep(entries, k.stream); }, StepText);
    prepare_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!info.ok() && info.status().code() == absl::StatusCode::kResourceExhausted) {
      if (active.size() == 1) {
        std::fprintf(stderr, "the pool cannot hold one request: %s\n",
                     info.status().ToString().c_str());
        return 1;
      }
      // Preempt the newest request (recompute later) and retry next round.
      const int id = active.back();
      active.pop_back();
      CHECK_OK(on_all(
          "ReleaseSequence (preemption)",
          [&](Rank& k) { return k.cache->ReleaseSequence(reqs[id].seq); }, text));
      reqs[id].stored = reqs[id].generated = 0;
      reqs[id].state = Request::kWaiting;
      waiting.push_front(id);
      ++preemptions;
      done_at_preemption = done;
      continue;
    }
    CHECK_OK(info.status());
    copies += info->pages_copied;
    cur_slot = info->slot;
    cur_prefill = !decode_only;
    // New K/V rows of every layer, in the step's token order; each rank
    // gets the columns of its heads.
    std::vector<int> entry_req;
    for (const StepEntry& e : entries) {
      for (int id : active) {
        if (reqs[id].seq == e.seq) entry_req.push_back(id);
      }
    }
    for (int rank = 0; rank < TP; ++rank) {
      Rank& k = ranks[rank];
      use(k);
      if (gpu && overlap && k.in_pending[cur_slot]) {
        // The slot's previous rows were copied before its step ran: long done.
        CHECK_CUDA(cudaEventSynchronize(k.in_done[cur_slot]));
        k.in_pending[cur_slot] = false;
      }
      for (int l = 0; l < L; ++l) {
        for (int kv = 0; kv < 2; ++kv) {
          uint16_t* dst = !gpu      ? k.host_in[2 * l + kv].data()
                          : overlap ? k.pinned_in[cur_slot] + (2 * l + kv) * in_elems
                                    : k.host_in[0].data();
          int64_t row = 0;
          for (size_t j = 0; j < entries.size(); ++j) {
            for (int i = 0; i < entries[j].num_new_tokens; ++i) {
              const int pos = reqs[entry_req[j]].stored + i;
              std::memcpy(
                  dst + row * HR * D,
                  bank.Row(kv, TokenKey(reqs, entry_req[j], pos, l) * 2 + kv) + rank * HR * D,
                  HR * D * 2);
              ++row;
            }
          }
          if (gpu) {
            CHECK_CUDA(cudaMemcpyAsync(k.in_ptr[2 * l + kv], dst, row * HR * D * 2,
                                       cudaMemcpyHostToDevice, k.cs));
            // The host row buffer is reused (--overlap: one per slot and row).
            if (!overlap) CHECK_CUDA(cudaStreamSynchronize(k.cs));
          }
        }
      }
    }
    const auto t1 = std::chrono::steady_clock::now();
    if (overlap && have_prev) host_between_s += std::chrono::duration<double>(t1 - prev_launched).count();
    if (gpu && decode_only) {
      for (Rank& k : ranks) {
        use(k);
        cudaGraphExec_t& ga = overlap ? k.slot_graph_append[cur_slot] : k.graph_append;
        cudaGraphExec_t& gr = overlap ? k.slot_graph_read[cur_slot] : k.graph_read;
        cudaEvent_t* ev = overlap ? k.slot_ev[cur_slot] : k.ev;
        if (ga == nullptr) {
          for (int part = 0; part < 2; ++part) {
            cudaGraph_t g;
            CHECK_CUDA(cudaStreamBeginCapture(k.cs, cudaStreamCaptureModeThreadLocal));
            if (part == 0) {
              append_layers(k);
            } else {
              read_layers(k);
            }
            CHECK_CUDA(cudaStreamEndCapture(k.cs, &g));
            CHECK_CUDA(cudaGraphInstantiate(part == 0 ? &ga : &gr, g, 0));
            CHECK_CUDA(cudaGraphDestroy(g));
          }
        }
        CHECK_CUDA(cudaEventRecord(ev[0], k.cs));
        CHECK_CUDA(cudaGraphLaunch(ga, k.cs));
        CHECK_CUDA(cudaEventRecord(ev[1], k.cs));
        CHECK_CUDA(cudaGraphLaunch(gr, k.cs));
        CHECK_CUDA(cudaEventRecord(ev[2], k.cs));
      }
      if (!overlap) {
        for (Rank& k : ranks) {
          use(k);
          CHECK_CUDA(cudaEventSynchronize(k.ev[2]));
        }
        float a_ms = 0, r_ms = 0;
        use(ranks[0]);
        CHECK_CUDA(cudaEventElapsedTime(&a_ms, ranks[0].ev[0], ranks[0].ev[1]));
        CHECK_CUDA(cudaEventElapsedTime(&r_ms, ranks[0].ev[1], ranks[0].ev[2]));
        decode_append_ms += a_ms;
        decode_read_ms += r_ms;
      }
      ++replays;
    } else {
      // Eager: steps with prefill chunks (and, on the CPU, every step).
      // Events (GPU) or a steady clock (CPU) around the appends and the reads.
      const bool check = !gpu && attend && cur_prefill;
      auto c = std::chrono::steady_clock::now();
      for (Rank& k : ranks) {
        if (check) poison_prefill_out(k);
      }
      check_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - c).count();
      for (Rank& k : ranks) {
        use(k);
        cudaEvent_t* ev = overlap ? k.slot_ev[cur_slot] : k.ev;
        if (gpu) CHECK_CUDA(cudaEventRecord(ev[0], k.cs));
        const auto c0 = std::chrono::steady_clock::now();
        append_layers(k);
        if (gpu) CHECK_CUDA(cudaEventRecord(ev[1], k.cs));
        const auto c1 = std::chrono::steady_clock::now();
        read_layers(k);
        if (gpu) CHECK_CUDA(cudaEventRecord(ev[2], k.cs));
        if (!gpu && cur_prefill && &k == &ranks[0]) {
          const auto c2 = std::chrono::steady_clock::now();
          prefill_append_ms += 1000.0 * std::chrono::duration<double>(c1 - c0).count();
          prefill_read_ms += 1000.0 * std::chrono::duration<double>(c2 - c1).count();
        }
      }
      if (cur_prefill) {
        ++prefill_steps;
        for (size_t j = 0; attend && j < entries.size(); ++j) {
          const Request& r = reqs[entry_req[j]];
          if (r.state != Request::kPrefill) continue;
          prefill_attended += entries[j].num_new_tokens;
          if (r.cached > 0) {
            prefill_attended_hit += entries[j].num_new_tokens;
            ++hit_chunks;
          }
        }
      }
      c = std::chrono::steady_clock::now();
      for (int rank = 0; check && rank < TP; ++rank) {
        check_prefill(ranks[rank], rank, entries, entry_req);
      }
      check_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - c).count();
    }
    if (overlap) {
      // The ids "sampled" by this step's decode tokens arrive now, while it
      // runs: from device memory on a GPU (copied back without a sync and
      // applied two PrepareSteps later), from the host on the CPU.
      std::vector<std::pair<size_t, int>> late;  // entry, position
      for (size_t j = 0; j < entries.size(); ++j) {
        if (entries[j].num_new_tokens == 1 && entries[j].token_ids.empty()) {
          for (int id : active) {
            if (reqs[id].seq == entries[j].seq) late.emplace_back(j, reqs[id].stored);
          }
        }
      }
      std::vector<int32_t> late_ids;
      for (const auto& [j, pos] : late) {
        for (int id : active) {
          if (reqs[id].seq == entries[j].seq) late_ids.push_back(reqs[id].ids[pos]);
        }
      }
      if (gpu && !late.empty()) {
        for (Rank& k : ranks) {
          use(k);
          std::memcpy(k.pinned_ids[cur_slot], late_ids.data(), late_ids.size() * 4);
          CHECK_CUDA(cudaMemcpyAsync(k.d_ids[cur_slot], k.pinned_ids[cur_slot],
                                     late_ids.size() * 4, cudaMemcpyHostToDevice, k.cs));
        }
      }
      for (size_t i = 0; i < late.size(); ++i) {
        CHECK_OK(on_all(
            "SetTokenIds",
            [&](Rank& k) {
              if (!gpu) {
                return k.cache->SetTokenIds(entries[late[i].first].seq, late[i].second,
                                            absl::Span<const int32_t>(&late_ids[i], 1));
              }
              return k.cache->SetTokenIds(
                  entries[late[i].first].seq, late[i].second,
                  TensorView::Contiguous(k.d_ids[cur_slot] + i, DType::kI32, {1}, k.device),
                  k.stream);
            },
            text));
      }
      for (Rank& k : ranks) {
        if (!gpu) break;
        use(k);
        CHECK_CUDA(cudaEventRecord(k.in_done[cur_slot], k.cs));
        k.in_pending[cur_slot] = true;
      }
      // Step N-1 (the other slot) must be done before PrepareStep N+1 reuses
      // its slot: wait for it here and count how much of the host time
      // since its launch it hid.
      if (have_prev) {
        double device_ms = 0;
        if (gpu) {
          for (Rank& k : ranks) {
            use(k);
            CHECK_CUDA(cudaEventSynchronize(k.slot_ev[prev_slot][2]));
          }
          use(ranks[0]);
          float a_ms = 0, r_ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&a_ms, ranks[0].slot_ev[prev_slot][0],
                                          ranks[0].slot_ev[prev_slot][1]));
          CHECK_CUDA(cudaEventElapsedTime(&r_ms, ranks[0].slot_ev[prev_slot][1],
                                          ranks[0].slot_ev[prev_slot][2]));
          device_ms = a_ms + r_ms;
          if (prev_replay) {
            decode_append_ms += a_ms;
            decode_read_ms += r_ms;
          } else if (prev_prefill) {
            prefill_append_ms += a_ms;
            prefill_read_ms += r_ms;
          }
        }
        const double host_ms =
            1000.0 * std::chrono::duration<double>(t1 - prev_launched).count();
        device_step_s += device_ms / 1000.0;
        hidden_s += std::min(host_ms, device_ms) / 1000.0;
        ++overlapped_steps;
      }
      have_prev = true;
      prev_slot = cur_slot;
      prev_replay = gpu && decode_only;
      prev_prefill = !decode_only;
    } else {
      sync_all();
      if (gpu && cur_prefill) {
        float a_ms = 0, r_ms = 0;
        use(ranks[0]);
        CHECK_CUDA(cudaEventElapsedTime(&a_ms, ranks[0].ev[0], ranks[0].ev[1]));
        CHECK_CUDA(cudaEventElapsedTime(&r_ms, ranks[0].ev[1], ranks[0].ev[2]));
        prefill_append_ms += a_ms;
        prefill_read_ms += r_ms;
      }
    }
    prev_launched = std::chrono::steady_clock::now();
    layers_s += std::chrono::duration<double>(prev_launched - t1).count() - check_s;
    check_s = 0;
    ++steps;
    peak_pages = std::max(peak_pages, ranks[0].cache->Stats().pages_used);
    // Advance the requests.
    std::vector<int> finished;
    for (const StepEntry& e : entries) {
      for (int id : active) {
        Request& r = reqs[id];
        if (r.seq != e.seq) continue;
        r.stored += e.num_new_tokens;
        if (r.state == Request::kDecode) {
          decode_tokens += e.num_new_tokens;
          if (++r.generated >= r.decode) finished.push_back(id);
        } else {
          prefill_tokens += e.num_new_tokens;
          if (r.stored == r.prompt) r.state = Request::kDecode;
        }
      }
    }
    // Parallel sampling: fork request 0 once its prompt is in.
    if (!forked && reqs[0].state == Request::kDecode &&
        static_cast<int>(active.size()) + f.samples <= S) {
      for (int k = 0; k < f.samples; ++k) {
        Request c;
        c.id = static_cast<int>(reqs.size());
        c.parent = 0;
        c.fork_len = reqs[0].stored;
        c.prompt = reqs[0].prompt;
        c.stored = reqs[0].stored;
        c.decode = std::uniform_int_distribution<int>(f.decode_min, f.decode_max)(rng);
        c.ids.assign(reqs[0].ids.begin(), reqs[0].ids.begin() + c.fork_len);
        random_ids(c.decode, &c.ids);  // its own samples
        KeyTokens(c);
        c.state = Request::kDecode;
        absl::StatusOr<SequenceId> child = on_all(
            "ForkSequence", [&](Rank& k) { return k.cache->ForkSequence(reqs[0].seq); }, text);
        CHECK_OK(child.status());
        c.seq = *child;
        reqs.push_back(c);
        active.push_back(c.id);
      }
      forked = true;
    }
    if (!overlap) sync_all();
    for (int id : finished) {
      if (err.seqs < f.error_seqs) measure(reqs[id]);
      CHECK_OK(on_all(
          "ReleaseSequence", [&](Rank& k) { return k.cache->ReleaseSequence(reqs[id].seq); },
          text));
      reqs[id].state = Request::kDone;
      active.erase(std::find(active.begin(), active.end(), id));
      ++done;
    }
    if (TP > 1) {
      // The step's sequences and the active ones: pages, Stats counts, KV
      // events, and what the next waiting prompt would reuse.
      std::vector<SequenceId> ids;
      for (const StepEntry& e : entries) ids.push_back(e.seq);
      for (int id : active) ids.push_back(reqs[id].seq);
      on_all(
          "Stats / SequencePages", [&](Rank& k) { return StateText(*k.cache, ids); }, text);
      on_all(
          "TakeEvents", [&](Rank& k) { return k.cache->TakeEvents(); }, text);
      if (f.prefix_cache != 0 && !waiting.empty()) {
        const Request& w = reqs[waiting.front()];
        on_all(
            "MatchPrefix",
            [&](Rank& k) {
              return k.cache->MatchPrefix(absl::Span<const int32_t>(w.ids.data(), w.prompt));
            },
            text);
      }
    }
    if (steps % 50 == 0) {
      const fp4kv::KVCacheStats st = ranks[0].cache->Stats();
      std::printf(
          "step %5lld: %3zu active, %3zu waiting, pages %lld/%lld in use (%lld shared), "
          "%lld tokens stored, %lld wasted slots\n",
          static_cast<long long>(steps), active.size(), waiting.size(),
          static_cast<long long>(st.pages_used), static_cast<long long>(st.pages_total),
          static_cast<long long>(st.pages_shared), static_cast<long long>(st.tokens_stored),
          static_cast<long long>(st.wasted_slots));
    }
  }
  sync_all();
  if (gpu && overlap && have_prev) {  // the last step's device time
    use(ranks[0]);
    float a_ms = 0, r_ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&a_ms, ranks[0].slot_ev[prev_slot][0],
                                    ranks[0].slot_ev[prev_slot][1]));
    CHECK_CUDA(cudaEventElapsedTime(&r_ms, ranks[0].slot_ev[prev_slot][1],
                                    ranks[0].slot_ev[prev_slot][2]));
    if (prev_replay) {
      decode_append_ms += a_ms;
      decode_read_ms += r_ms;
    } else if (prev_prefill) {
      prefill_append_ms += a_ms;
      prefill_read_ms += r_ms;
    }
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  const fp4kv::KVCacheStats st = ranks[0].cache->Stats();
  std::printf(
      "done: %d requests (%d forked samples) in %.2f s, %lld steps (%lld replayed from one CUDA "
      "graph), %lld preemptions\n",
      done, static_cast<int>(reqs.size()) - f.requests, secs, static_cast<long long>(steps),
      static_cast<long long>(replays), static_cast<long long>(preemptions));
  std::printf(
      "tokens: %lld appended in every layer, %.0f tokens/s (prefill %lld, decode %lld: "
      "%.0f decode tokens/s)%s\n",
      static_cast<long long>(prefill_tokens + decode_tokens),
      (prefill_tokens + decode_tokens) / secs, static_cast<long long>(prefill_tokens),
      static_cast<long long>(decode_tokens), decode_tokens / secs,
      gpu ? "" : " [CPU reference speed]");
  std::printf(
      "time: %.3f s in PrepareStep (%.1f us/step), %.3f s in the layers' append + reads "
      "(%.0f tokens/s); the rest is making the synthetic K/V rows\n",
      prepare_s, 1e6 * prepare_s / std::max<int64_t>(1, steps), layers_s,
      (prefill_tokens + decode_tokens) / std::max(1e-9, layers_s));
  if (replays > 0) {
    std::printf(
        "decode step (%d layers, graph replay, mean of %lld steps%s): append %.1f us, %s %.1f us\n",
        L, static_cast<long long>(replays), TP > 1 ? ", rank 0" : "",
        1000.0 * decode_append_ms / replays, attend ? "attention" : "materialize",
        1000.0 * decode_read_ms / replays);
  }
  if (attend && prefill_steps > 0) {
    const double ms = prefill_append_ms + prefill_read_ms;
    std::printf(
        "prefill steps (%d layers, eager, %lld steps with prefill chunks%s): %lld prefill tokens "
        "attended of %lld appended (%lld in %lld chunks after a prefix hit); append %.1f us, "
        "attention %.1f us per step; %.0f prefill tokens/s in the layers' append + attention%s\n",
        L, static_cast<long long>(prefill_steps), TP > 1 ? ", rank 0" : "",
        static_cast<long long>(prefill_attended), static_cast<long long>(prefill_tokens),
        static_cast<long long>(prefill_attended_hit), static_cast<long long>(hit_chunks),
        1000.0 * prefill_append_ms / prefill_steps, 1000.0 * prefill_read_ms / prefill_steps,
        prefill_attended / std::max(1e-9, ms / 1000.0), gpu ? "" : " [CPU reference speed]");
  }
  if (checked_steps > 0) {
    std::printf(
        "check: %lld prefill steps, layer 0%s: all %lld new tokens' attention rows written; the "
        "last token's row of each of %lld entries (%lld chunks after a prefix hit) equals the "
        "max_q_len 1 op's bit for bit\n",
        static_cast<long long>(checked_steps), TP > 1 ? ", every rank" : "",
        static_cast<long long>(checked_rows), static_cast<long long>(checked_last),
        static_cast<long long>(checked_hit_chunks));
  }
  if (attend && prefill_attended != prefill_tokens) {
    std::fprintf(stderr, "prefill tokens attended (%lld) != prefill tokens appended (%lld)\n",
                 static_cast<long long>(prefill_attended), static_cast<long long>(prefill_tokens));
    return 1;
  }
  if (overlap) {
    const double n = static_cast<double>(std::max<int64_t>(1, overlapped_steps));
    std::printf(
        "overlap: %lld steps prepared while the previous one ran: host time between launches "
        "%.1f us/step, device step %.1f us/step, host time hidden %.1f us/step (%.0f%%)%s\n",
        static_cast<long long>(overlapped_steps), 1e6 * host_between_s / n,
        1e6 * device_step_s / n, 1e6 * hidden_s / n,
        host_between_s > 0 ? 100.0 * hidden_s / host_between_s : 0.0,
        gpu ? "" : " [CPU device: every op runs inside its call, nothing can be hidden]");
  }
  uint64_t events[4] = {0, 0, 0, 0};
  for (Rank& k : ranks) {  // all ranks' blocks
    use(k);
    for (int l = 0; l < L; ++l) {
      absl::StatusOr<fp4kv::ScaleEventCounts> c = k.cache->ReadScaleEvents(l, k.stream);
      CHECK_OK(c.status());
      events[0] += c->k_saturated;
      events[1] += c->k_underflow;
      events[2] += c->v_saturated;
      events[3] += c->v_underflow;
    }
  }
  use(ranks[0]);
  absl::StatusOr<fp4kv::LayerScales> sc0 = ranks[0].cache->ReadScales(0, ranks[0].stream);
  CHECK_OK(sc0.status());
  std::printf(
      "scales: calibrated from each layer's first rows (%slayer 0: K %.3g, V %.3g); blocks "
      "saturated K %llu / V %llu, underflowed K %llu / V %llu (all layers)\n",
      TP > 1 ? "rank 0, " : "", sc0->k, sc0->v, static_cast<unsigned long long>(events[0]),
      static_cast<unsigned long long>(events[2]), static_cast<unsigned long long>(events[1]),
      static_cast<unsigned long long>(events[3]));
  std::printf("pages: peak %lld of %lld in use, %lld copied on write; now %lld in use%s\n",
              static_cast<long long>(peak_pages), static_cast<long long>(st.pages_total),
              static_cast<long long>(copies), static_cast<long long>(st.pages_used),
              st.pages_retiring > 0
                  ? absl::StrCat(" (", st.pages_retiring,
                                 " retiring: released during the last two steps, free two steps after their release)")
                        .c_str()
                  : "");
  if (f.prefix_cache != 0) {
    std::printf(
        "prefix cache: %lld admissions (%lld follow-up turns, %d system prompts), hit rate "
        "%.1f%% of prompt tokens; %lld prefill tokens saved (%.1f%% of the prefill work); "
        "%lld pages cached now, %lld evictions\n",
        static_cast<long long>(st.prefix_queries), static_cast<long long>(follow_up_requests),
        static_cast<int>(system.size()), 100.0 * st.prefix_hit_rate,
        static_cast<long long>(prefill_saved),
        100.0 * prefill_saved / std::max<int64_t>(1, prefill_saved + prefill_tokens),
        static_cast<long long>(st.pages_cached), static_cast<long long>(st.evictions));
    if (st.host_prefix_pages_total > 0) {
      const double q = static_cast<double>(std::max<int64_t>(1, st.prefix_query_tokens));
      std::printf(
          "prefix host tier: %lld pages (%.1f MiB); hit rate %.1f%% on the GPU, %.1f%% on the "
          "host; %lld demotions, %lld promotions, %lld host evictions, %lld pages there now\n",
          static_cast<long long>(st.host_prefix_pages_total), st.host_prefix_bytes / 1048576.0,
          100.0 * (st.prefix_hit_tokens - st.prefix_hit_tokens_host) / q,
          100.0 * st.prefix_hit_tokens_host / q, static_cast<long long>(st.host_prefix_demotions),
          static_cast<long long>(st.host_prefix_promotions),
          static_cast<long long>(st.host_prefix_evictions),
          static_cast<long long>(st.host_prefix_pages_cached));
    }
  }
  if (err.seqs > 0) {
    std::printf(
        "dequantized vs original (%d sequences, layers 0 and %d, %lld rows): "
        "K rel-RMS %.2f%%, V rel-RMS %.2f%%; max |err| %.3f (K) / %.3f (V) of the block amax\n",
        err.seqs, L - 1, static_cast<long long>(err.rows),
        100 * std::sqrt(err.err2[0] / err.sig2[0]), 100 * std::sqrt(err.err2[1] / err.sig2[1]),
        err.max_rel[0], err.max_rel[1]);
  }
  if (TP > 1) {
    std::printf("tp=%d: %lld steps, every host decision agreed across ranks\n", TP,
                static_cast<long long>(steps));
  }
  for (Rank& k : ranks) {
    if (!gpu) continue;
    use(k);
    if (k.graph_append) CHECK_CUDA(cudaGraphExecDestroy(k.graph_append));
    if (k.graph_read) CHECK_CUDA(cudaGraphExecDestroy(k.graph_read));
    for (void* p : k.in_ptr) CHECK_CUDA(cudaFree(p));
    for (void* p : k.device_buffers) CHECK_CUDA(cudaFree(p));
    for (cudaEvent_t e : k.ev) CHECK_CUDA(cudaEventDestroy(e));
    CHECK_CUDA(cudaStreamDestroy(k.cs));
  }
  return 0;
}
