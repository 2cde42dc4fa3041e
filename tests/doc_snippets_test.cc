// The C++ snippets of README.md and docs/*.md, compiled as written: every
// ```c++ block of those files must appear verbatim (up to leading
// indentation) between a "// snippet:" marker and "// end snippet" in this
// file, where it is compiled inside a function that declares what it uses.
// The snippets that can run on the CPU device are also run and checked.
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "fp4kv/attention.h"
#include "fp4kv/calibrate.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/recipe.h"
#include "gtest/gtest.h"

namespace fp4kv_doc_snippets {

// README.md, "KVCache".
absl::Status ReadmeKvCache(const fp4kv::KVCacheOptions& options, int32_t num_new_tokens,
                           const fp4kv::TensorView& k_new, const fp4kv::TensorView& v_new,
                           const fp4kv::TensorView& q, const fp4kv::TensorView& out,
                           void* workspace, int64_t workspace_bytes, fp4kv::Stream stream) {
  // snippet: README.md
  // options: num_layers, geometry, num_pages or a byte budget, device, recipe,
  // optional per-layer K/V global scales, step capacities
  absl::StatusOr<fp4kv::KVCache> cache = fp4kv::KVCache::Create(options);
  if (!cache.ok()) return cache.status();
  absl::StatusOr<fp4kv::SequenceId> seq = cache->CreateSequence();
  if (!seq.ok()) return seq.status();
  absl::StatusOr<fp4kv::StepInfo> step =
      cache->PrepareStep({{*seq, num_new_tokens}}, stream);  // pages, tables, one upload
  if (!step.ok()) return step.status();
  absl::StatusOr<fp4kv::CacheAppender> append = cache->appender(fp4kv::DType::kBF16);
  absl::StatusOr<fp4kv::CacheAttention> attend = cache->attention({/*num_qo_heads=*/32});
  if (!append.ok() || !attend.ok()) return absl::InternalError("op objects");
  for (int layer = 0; layer < cache->num_layers(); ++layer) {  // capture once, replay every step
    absl::Status s = append->Run(layer, k_new, v_new, stream);
    if (s.ok()) s = attend->Run(layer, q, out, workspace, workspace_bytes, stream);
    if (!s.ok()) return s;
  }
  // end snippet
  return absl::OkStatus();
}

// README.md, "Key formats": a K8V4 cache on the CPU, run and checked.
double ReadmeKeyFormats() {
  // snippet: README.md
  fp4kv::KVCacheOptions o;
  o.num_layers = 1;
  o.geometry.num_kv_heads = 8;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 128;
  o.geometry.page_size = 16;
  o.geometry.num_pages = 64;
  o.geometry.key_format = fp4kv::KeyFormat::kFp8;  // FP8 E4M3 keys, NVFP4 values ("K8V4")
  absl::StatusOr<fp4kv::KVCache> cache = fp4kv::KVCache::Create(o);
  // cache->Stats().bytes_per_token == 8 * (128 + 64 + 8) = 1600 (NVFP4 K+V: 1152)
  // end snippet
  return cache.ok() ? cache->Stats().bytes_per_token : -1.0;
}

// docs/kv_cache.md, "Creating one" (compiled only: it asks for 40 GiB on a GPU).
absl::StatusOr<fp4kv::KVCache> KvCacheCreate() {
  // snippet: docs/kv_cache.md
  fp4kv::KVCacheOptions o;
  o.num_layers = 32;
  o.geometry.num_kv_heads = 8;
  o.geometry.head_dim_k = o.geometry.head_dim_v = 128;
  o.geometry.page_size = 16;
  o.geometry.layout = fp4kv::Layout::kNHD;
  o.memory_budget_bytes = 40ll << 30;   // or geometry.num_pages (exactly one of the two)
  o.device = fp4kv::Device::Cuda(0);    // or Device::Cpu()
  // o.k_global_scales / v_global_scales: optional [num_layers] decode scales (e.g. from a
  // checkpoint); left empty, each layer calibrates from its first nonzero rows.
  o.max_seqs_per_step = 256;            // step capacities: they fix the step buffers' shapes
  o.max_tokens_per_step = 8192;
  o.max_pages_per_seq = 8192 / 16;      // the longest sequence, in pages
  absl::StatusOr<fp4kv::KVCache> cache = fp4kv::KVCache::Create(o);
  // end snippet
  return cache;
}

// docs/kv_cache.md, "A step".
absl::Status KvCacheStep(fp4kv::KVCache& cache, const fp4kv::CacheAppender& appender,
                         const fp4kv::CacheAttention& attention, fp4kv::SequenceId seq_a,
                         fp4kv::SequenceId seq_b, fp4kv::SequenceId seq_c,
                         const std::vector<fp4kv::TensorView>& k_new,
                         const std::vector<fp4kv::TensorView>& v_new,
                         const std::vector<fp4kv::TensorView>& q,
                         const std::vector<fp4kv::TensorView>& out, void* workspace,
                         int64_t workspace_bytes, fp4kv::Stream stream) {
  // snippet: docs/kv_cache.md
  absl::StatusOr<fp4kv::StepInfo> step =
      cache.PrepareStep({{seq_a, 1}, {seq_b, 1}, {seq_c, 1}}, stream);  // host work + upload
  if (!step.ok()) return step.status();
  for (int l = 0; l < cache.num_layers(); ++l) {  // the part to capture once
    // k_new[l], v_new[l]: [max_tokens_per_step, H, D] bf16 buffers of the new rows
    absl::Status s = appender.Run(l, k_new[l], v_new[l], stream);
    // q[l], out[l]: [max_seqs_per_step, Hq, D]; reads the NVFP4 pages directly
    if (s.ok()) s = attention.Run(l, q[l], out[l], workspace, workspace_bytes, stream);
    if (!s.ok()) return s;
  }
  // end snippet
  return absl::OkStatus();
}

// docs/kv_cache.md, "Prefix caching".
absl::Status KvCachePrefix(fp4kv::KVCache& cache, const std::vector<int32_t>& prompt,
                           absl::string_view extra_key, const int32_t& sampled_id,
                           fp4kv::Stream stream, fp4kv::KVEventBatch* events_out) {
  // snippet: docs/kv_cache.md
  // At Create: o.prefix_cache.enabled = true;
  //            o.prefix_cache.max_pending_events = 1 << 16;   // 0: no KV events
  // Admission: share the longest cached prefix of the prompt, prefill the rest.
  absl::StatusOr<fp4kv::PrefixSequence> s = cache.CreateSequenceFromPrefix(prompt, extra_key);
  if (!s.ok()) return s.status();
  const int64_t done = s->cached_tokens;  // whole pages, at most prompt.size() - 1
  const int32_t n = static_cast<int32_t>(prompt.size() - done);
  absl::StatusOr<fp4kv::StepInfo> prefill =  // token ids go with the step
      cache.PrepareStep({{s->seq, n, {prompt.data() + done, static_cast<size_t>(n)}}}, stream);
  if (!prefill.ok()) return prefill.status();
  // ... the layers' appends; then each decode step passes the new token's id:
  absl::StatusOr<fp4kv::StepInfo> decode = cache.PrepareStep({{s->seq, 1, {&sampled_id, 1}}}, stream);
  if (!decode.ok()) return decode.status();
  fp4kv::KVEventBatch events = cache.TakeEvents();  // for a KV-aware router
  // end snippet
  *events_out = std::move(events);
  return absl::OkStatus();
}

// docs/kv_cache.md, "Two steps in flight" (compiled only).
absl::Status KvCacheOverlap(fp4kv::KVCache& cache, const std::vector<fp4kv::StepEntry>& entries,
                            const std::function<absl::Status(int)>& launch_graph,
                            fp4kv::SequenceId seq, int64_t first_position,
                            const fp4kv::TensorView& sampled_ids, fp4kv::Stream stream) {
  // snippet: docs/kv_cache.md
  // At Create: o.step_slots = 2. Per slot: appender.ForSlot(slot), attention.ForSlot(slot),
  // captured once as the slot's graph.
  absl::StatusOr<fp4kv::StepInfo> next = cache.PrepareStep(entries, stream);  // while step N runs
  if (!next.ok()) return next.status();
  absl::Status launched = launch_graph(next->slot);  // step N+1 queues behind step N
  if (!launched.ok()) return launched;
  // The ids step N sampled, still on the device ([n] i32): copied back, no sync.
  absl::Status ids = cache.SetTokenIds(seq, first_position, sampled_ids, stream);
  if (!ids.ok()) return ids;
  // end snippet
  return absl::OkStatus();
}

// docs/recipes.md, "The nine recipes".
void RecipeNameAndCode(std::string* name_out, int64_t* code_out) {
  // snippet: docs/recipes.md
  fp4kv::Recipe r = fp4kv::Recipe::FourOverSix(256, fp4kv::ErrorMetric::kMse);
  std::string name = fp4kv::RecipeName(r);  // "4over6-mse-256"
  int64_t code = *fp4kv::RecipeToCode(r);   // 0x0000010000010101
  // end snippet
  *name_out = name;
  *code_out = code;
}

// docs/recipes.md, "Calibration without a host sync" (compiled only: CUDA).
absl::Status RecipesCalibrate(int64_t n, const fp4kv::Recipe& cache_recipe,
                              const fp4kv::TensorView& k_view, float* d_k_amax, float* d_k_scale,
                              fp4kv::Stream stream) {
  // snippet: docs/recipes.md
  absl::StatusOr<fp4kv::Calibrator> cal = fp4kv::Calibrator::Create(
      {/*max_elements=*/n, fp4kv::DType::kBF16, fp4kv::Device::Cuda(0), cache_recipe});
  if (!cal.ok()) return cal.status();
  // d_k_scale: the device float the cache's ops read via GlobalScale::Pointer.
  return cal->Run(k_view, d_k_amax /* or nullptr */, d_k_scale, stream);
  // end snippet
}

// docs/kv_cache.md, "Export and import" (run on the CPU device below).
absl::StatusOr<fp4kv::SequenceId> KvCacheExportImport(const fp4kv::KVCache& src,
                                                      fp4kv::SequenceId seq,
                                                      fp4kv::KVCache& dst_cache,
                                                      fp4kv::Stream stream) {
  // snippet: docs/kv_cache.md
  // Source: the image into caller-owned memory (device, pinned or pageable host).
  absl::StatusOr<int64_t> bytes = src.ExportedBytes(seq);
  if (!bytes.ok()) return bytes.status();
  std::vector<uint8_t> image(*bytes + 16);
  void* dst = image.data() + (16 - reinterpret_cast<uintptr_t>(image.data()) % 16) % 16;
  absl::Status exported = src.ExportSequence(seq, dst, *bytes, stream);
  if (!exported.ok()) return exported;
  // Target: reserve the pages first (the header is host-known), then fill them.
  absl::StatusOr<fp4kv::SequenceImageHeader> header =
      fp4kv::ParseSequenceImageHeader(dst, *bytes);
  if (!header.ok()) return header.status();
  absl::StatusOr<fp4kv::ImportReservation> reserved = dst_cache.ReserveImport(*header);
  if (!reserved.ok()) return reserved.status();
  absl::StatusOr<fp4kv::SequenceId> copy =
      dst_cache.CommitImport(*std::move(reserved), dst, *bytes, {}, stream);
  // end snippet
  return copy;
}

}  // namespace fp4kv_doc_snippets

namespace {

// Lines of the fenced c++ blocks of a markdown file, one string per block.
std::vector<std::string> CppBlocks(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> blocks;
  std::string line, block;
  bool inside = false;
  while (std::getline(in, line)) {
    if (!inside && line.rfind("```c++", 0) == 0) {
      inside = true;
      block.clear();
    } else if (inside && line.rfind("```", 0) == 0) {
      inside = false;
      blocks.push_back(block);
    } else if (inside) {
      block += std::string(absl::StripLeadingAsciiWhitespace(line)) + "\n";
    }
  }
  return blocks;
}

// The marked regions of this file, leading indentation stripped.
std::vector<std::string> CompiledSnippets() {
  std::ifstream in(std::string(FP4KV_SOURCE_DIR) + "/tests/doc_snippets_test.cc");
  std::vector<std::string> out;
  std::string line, block;
  bool inside = false;
  while (std::getline(in, line)) {
    const std::string t(absl::StripLeadingAsciiWhitespace(line));
    if (t.rfind("// snippet:", 0) == 0) {
      inside = true;
      block.clear();
    } else if (t.rfind("// end snippet", 0) == 0) {
      inside = false;
      out.push_back(block);
    } else if (inside) {
      block += t + "\n";
    }
  }
  return out;
}

TEST(DocSnippets, EveryCppBlockIsCompiledHere) {
  const std::vector<std::string> compiled = CompiledSnippets();
  ASSERT_FALSE(compiled.empty());
  std::vector<std::string> files = {"README.md"};
  for (const auto& e : std::filesystem::directory_iterator(std::string(FP4KV_SOURCE_DIR) + "/docs")) {
    if (e.path().extension() == ".md") files.push_back("docs/" + e.path().filename().string());
  }
  int blocks = 0;
  for (const std::string& f : files) {
    for (const std::string& b : CppBlocks(std::string(FP4KV_SOURCE_DIR) + "/" + f)) {
      ++blocks;
      bool found = false;
      for (const std::string& c : compiled) found = found || c == b;
      EXPECT_TRUE(found) << f << ": this c++ block is not compiled by tests/doc_snippets_test.cc:\n"
                         << b;
    }
  }
  EXPECT_GE(blocks, 5);
}

constexpr int kHeads = 2, kDim = 64, kQoHeads = 32;

fp4kv::KVCacheOptions SmallCpuOptions() {
  fp4kv::KVCacheOptions o;
  o.num_layers = 2;
  o.geometry.num_kv_heads = kHeads;
  o.geometry.head_dim_k = o.geometry.head_dim_v = kDim;
  o.geometry.page_size = 16;
  o.geometry.num_pages = 16;
  o.device = fp4kv::Device::Cpu();
  o.max_seqs_per_step = 3;
  o.max_tokens_per_step = 8;
  o.max_pages_per_seq = 4;
  return o;
}

std::vector<uint16_t> Bf16(size_t n, float step) {
  std::vector<uint16_t> v(n);
  for (size_t i = 0; i < n; ++i) {
    v[i] = fp4kv::FloatToBf16Bits(step * static_cast<float>(static_cast<int>(i % 29) - 14));
  }
  return v;
}

fp4kv::TensorView View(std::vector<uint16_t>& v, int64_t rows, int heads) {
  return fp4kv::TensorView::Contiguous(v.data(), fp4kv::DType::kBF16, {rows, heads, kDim});
}

TEST(DocSnippets, ReadmeKvCacheRunsOnTheCpu) {
  std::vector<uint16_t> k = Bf16(8 * kHeads * kDim, 0.1f), v = Bf16(8 * kHeads * kDim, 0.05f);
  std::vector<uint16_t> q = Bf16(3 * kQoHeads * kDim, 0.02f);
  std::vector<uint16_t> out(3 * kQoHeads * kDim, 0xA5A5);
  const absl::Status s = fp4kv_doc_snippets::ReadmeKvCache(
      SmallCpuOptions(), 5, View(k, 8, kHeads), View(v, 8, kHeads), View(q, 3, kQoHeads),
      View(out, 3, kQoHeads), nullptr, 0, nullptr);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_NE(out[0], 0xA5A5) << "row 0 (the sequence) was attended";
  EXPECT_EQ(out[kQoHeads * kDim], 0xA5A5) << "unused rows are not written";
}

TEST(DocSnippets, ReadmeKeyFormatsRunsOnTheCpu) {
  EXPECT_EQ(fp4kv_doc_snippets::ReadmeKeyFormats(), 1600.0);
}

TEST(DocSnippets, KvCacheStepRunsOnTheCpu) {
  absl::StatusOr<fp4kv::KVCache> cache = fp4kv::KVCache::Create(SmallCpuOptions());
  ASSERT_TRUE(cache.ok()) << cache.status();
  absl::StatusOr<fp4kv::CacheAppender> appender = cache->appender(fp4kv::DType::kBF16);
  absl::StatusOr<fp4kv::CacheAttention> attention = cache->attention({kQoHeads});
  ASSERT_TRUE(appender.ok() && attention.ok());
  const fp4kv::SequenceId a = cache->CreateSequence().value(), b = cache->CreateSequence().value(),
                          c = cache->CreateSequence().value();
  std::vector<std::vector<uint16_t>> kb, vb, qb, ob;
  std::vector<fp4kv::TensorView> k, v, q, o;
  for (int l = 0; l < 2; ++l) {
    kb.push_back(Bf16(8 * kHeads * kDim, 0.1f + l));
    vb.push_back(Bf16(8 * kHeads * kDim, 0.2f));
    qb.push_back(Bf16(3 * kQoHeads * kDim, 0.03f));
    ob.push_back(std::vector<uint16_t>(3 * kQoHeads * kDim, 0xA5A5));
  }
  for (int l = 0; l < 2; ++l) {
    k.push_back(View(kb[l], 8, kHeads));
    v.push_back(View(vb[l], 8, kHeads));
    q.push_back(View(qb[l], 3, kQoHeads));
    o.push_back(View(ob[l], 3, kQoHeads));
  }
  for (int step = 0; step < 3; ++step) {
    const absl::Status s = fp4kv_doc_snippets::KvCacheStep(*cache, *appender, *attention, a, b, c,
                                                           k, v, q, o, nullptr, 0, nullptr);
    ASSERT_TRUE(s.ok()) << s;
  }
  EXPECT_EQ(*cache->SequenceLength(c), 3);
  for (int l = 0; l < 2; ++l) {
    for (int row = 0; row < 3; ++row) EXPECT_NE(ob[l][row * kQoHeads * kDim], 0xA5A5);
  }
}

// The second request with the same prompt reuses the first one's full pages.
TEST(DocSnippets, KvCachePrefixRunsOnTheCpu) {
  fp4kv::KVCacheOptions o = SmallCpuOptions();
  o.prefix_cache.enabled = true;
  o.prefix_cache.max_pending_events = 1 << 16;
  o.max_tokens_per_step = 64;
  // Pages are indexed once every layer's scales are set; the snippet leaves
  // out the appends that would calibrate them.
  o.k_global_scales = {0.01f, 0.01f};
  o.v_global_scales = {0.01f, 0.01f};
  absl::StatusOr<fp4kv::KVCache> cache = fp4kv::KVCache::Create(o);
  ASSERT_TRUE(cache.ok()) << cache.status();
  std::vector<int32_t> prompt(40);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(1000 + 7 * i);
  fp4kv::KVEventBatch first, second;
  ASSERT_TRUE(fp4kv_doc_snippets::KvCachePrefix(*cache, prompt, "tenant-a", 5, nullptr, &first).ok());
  EXPECT_FALSE(first.events.empty());
  ASSERT_TRUE(fp4kv_doc_snippets::KvCachePrefix(*cache, prompt, "tenant-a", 6, nullptr, &second).ok());
  EXPECT_EQ(cache->MatchPrefix(prompt, "tenant-a").tokens, 32);  // two full pages of 16
  EXPECT_EQ(cache->MatchPrefix(prompt, "tenant-b").tokens, 0);   // another extra key
}

TEST(DocSnippets, RecipeNameAndCodeAreWhatTheDocSays) {
  std::string name;
  int64_t code = 0;
  fp4kv_doc_snippets::RecipeNameAndCode(&name, &code);
  EXPECT_EQ(name, "4over6-mse-256");
  EXPECT_EQ(code, 0x0000010000010101);
}

}  // namespace

TEST(DocSnippets, KvCacheExportImportRunsOnTheCpu) {
  absl::StatusOr<fp4kv::KVCache> src = fp4kv::KVCache::Create(SmallCpuOptions());
  absl::StatusOr<fp4kv::KVCache> dst = fp4kv::KVCache::Create(SmallCpuOptions());
  ASSERT_TRUE(src.ok() && dst.ok());
  const fp4kv::SequenceId seq = src->CreateSequence().value();
  ASSERT_TRUE(src->PrepareStep({{seq, 7}}).ok());
  absl::StatusOr<fp4kv::SequenceId> copy =
      fp4kv_doc_snippets::KvCacheExportImport(*src, seq, *dst, nullptr);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(*dst->SequenceLength(*copy), 7);
  EXPECT_EQ(dst->Stats().bytes_imported, *src->ExportedBytes(seq));
  EXPECT_TRUE(dst->CheckInvariants().ok());
}
