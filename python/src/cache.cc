// fp4kv._core: KVCache: its option and result structs, its bound ops and the cache itself.
#include "binding.h"

namespace fp4kv {
namespace python {

namespace {

// KVCache.attention: its arguments are the fields of CacheAttentionOptions, in order.
template <auto... Fields>
CacheAttention AttentionFrom(const KVCache& c, FieldType<Fields>... values) {
  return Take(c.attention(OptionsOf<Fields...>(std::move(values)...)));
}

}  // namespace

void RegisterCache(nb::module_& m) {
  using AtO = CacheAttentionOptions;

  // ---- KVCache option and result structs
  nb::class_<PrefixCacheOptions>(m, "PrefixCacheOptions")
      .def(nb::init<>())
      .def_rw("enabled", &PrefixCacheOptions::enabled)
      .def_rw("max_pending_events", &PrefixCacheOptions::max_pending_events)
      .def_rw("host_bytes", &PrefixCacheOptions::host_bytes);
  nb::class_<HostTierOptions>(m, "HostTierOptions")
      .def(nb::init<>())
      .def_rw("host_pages", &HostTierOptions::host_pages)
      .def_rw("host_bytes", &HostTierOptions::host_bytes);
  nb::class_<KVCacheOptions>(m, "KVCacheOptions", "Options of KVCache (kv_cache.h documents each).")
      .def(nb::init<>())
      .def_rw("num_layers", &KVCacheOptions::num_layers)
      .def_rw("geometry", &KVCacheOptions::geometry)
      .def_rw("memory_budget_bytes", &KVCacheOptions::memory_budget_bytes)
      .def_rw("device", &KVCacheOptions::device)
      .def_rw("recipe", &KVCacheOptions::recipe)
      .def_rw("k_global_scales", &KVCacheOptions::k_global_scales)
      .def_rw("v_global_scales", &KVCacheOptions::v_global_scales)
      .def_rw("calibration_headroom", &KVCacheOptions::calibration_headroom)
      .def_rw("count_scale_events", &KVCacheOptions::count_scale_events)
      .def_rw("max_seqs_per_step", &KVCacheOptions::max_seqs_per_step)
      .def_rw("max_tokens_per_step", &KVCacheOptions::max_tokens_per_step)
      .def_rw("max_pages_per_seq", &KVCacheOptions::max_pages_per_seq)
      .def_rw("step_slots", &KVCacheOptions::step_slots)
      .def_rw("prefix_cache", &KVCacheOptions::prefix_cache)
      .def_rw("host_tier", &KVCacheOptions::host_tier);

  nb::class_<StepEntry>(m, "StepEntry", "One sequence of a step (prepare_step also takes tuples).")
      .def(nb::init<>())
      .def_rw("seq", &StepEntry::seq)
      .def_rw("num_new_tokens", &StepEntry::num_new_tokens);
  nb::class_<StepInfo>(m, "StepInfo")
      .def_ro("slot", &StepInfo::slot)
      .def_ro("num_seqs", &StepInfo::num_seqs)
      .def_ro("num_tokens", &StepInfo::num_tokens)
      .def_ro("max_seq_len", &StepInfo::max_seq_len)
      .def_ro("num_pages", &StepInfo::num_pages)
      .def_ro("fp8_workspace_pages", &StepInfo::fp8_workspace_pages)
      .def_ro("pages_allocated", &StepInfo::pages_allocated)
      .def_ro("pages_copied", &StepInfo::pages_copied)
      .def_ro("pages_evicted", &StepInfo::pages_evicted);
  nb::class_<StepPlan>(m, "StepPlan")
      .def_ro("fits", &StepPlan::fits)
      .def_ro("pages_needed", &StepPlan::pages_needed)
      .def_ro("pages_copied", &StepPlan::pages_copied)
      .def_ro("pages_free", &StepPlan::pages_free)
      .def_ro("pages_evictable", &StepPlan::pages_evictable)
      .def_ro("pages_evicted", &StepPlan::pages_evicted)
      .def_ro("pages_swap_pending", &StepPlan::pages_swap_pending)
      .def_ro("pages_retiring", &StepPlan::pages_retiring)
      .def_ro("pages_left", &StepPlan::pages_left)
      .def_ro("tokens_left", &StepPlan::tokens_left);
  nb::class_<PrefixMatch>(m, "PrefixMatch")
      .def_ro("tokens", &PrefixMatch::tokens)
      .def_ro("pages", &PrefixMatch::pages)
      .def_ro("pages_evictable", &PrefixMatch::pages_evictable)
      .def_ro("tokens_gpu", &PrefixMatch::tokens_gpu)
      .def_ro("tokens_host", &PrefixMatch::tokens_host)
      .def_ro("pages_host", &PrefixMatch::pages_host);
  nb::class_<PrefixSequence>(m, "PrefixSequence")
      .def_ro("seq", &PrefixSequence::seq)
      .def_ro("cached_tokens", &PrefixSequence::cached_tokens)
      .def_ro("host_tokens", &PrefixSequence::host_tokens);
  nb::class_<LayerScales>(m, "LayerScales")
      .def_ro("k", &LayerScales::k)
      .def_ro("v", &LayerScales::v)
      .def_ro("k_fp8", &LayerScales::k_fp8)
      .def_ro("v_fp8", &LayerScales::v_fp8)
      .def_ro("k_calibrated", &LayerScales::k_calibrated)
      .def_ro("v_calibrated", &LayerScales::v_calibrated);
  nb::class_<ScaleEventCounts>(m, "ScaleEventCounts")
      .def_ro("k_saturated", &ScaleEventCounts::k_saturated)
      .def_ro("k_underflow", &ScaleEventCounts::k_underflow)
      .def_ro("v_saturated", &ScaleEventCounts::v_saturated)
      .def_ro("v_underflow", &ScaleEventCounts::v_underflow);
  nb::class_<BlockHash>(m, "BlockHash")
      .def_ro("high", &BlockHash::high)
      .def_ro("low", &BlockHash::low)
      .def("hex", &BlockHash::ToHex)
      .def("__eq__", [](const BlockHash& a, const BlockHash& b) { return a == b; })
      .def("__hash__",
           [](const BlockHash& h) { return static_cast<Py_hash_t>(h.low ^ (h.high * 31)); })
      .def("__repr__", [](const BlockHash& h) { return "BlockHash('" + h.ToHex() + "')"; });
  nb::class_<KVEvent>(m, "KVEvent")
      .def_ro("type", &KVEvent::type)
      .def_ro("block_hashes", &KVEvent::block_hashes)
      .def_ro("has_parent", &KVEvent::has_parent)
      .def_ro("parent_block_hash", &KVEvent::parent_block_hash)
      .def_ro("token_ids", &KVEvent::token_ids)
      .def_ro("block_size", &KVEvent::block_size)
      .def_ro("extra_key", &KVEvent::extra_key)
      .def_ro("medium", &KVEvent::medium);
  nb::class_<KVEventBatch>(m, "KVEventBatch")
      .def_ro("events", &KVEventBatch::events)
      .def_ro("dropped", &KVEventBatch::dropped);

  nb::class_<KVCacheStats> stats(m, "KVCacheStats");
#define FP4KV_STAT(field) stats.def_ro(#field, &KVCacheStats::field)
  FP4KV_STAT(pages_total);
  FP4KV_STAT(pages_free);
  FP4KV_STAT(pages_used);
  FP4KV_STAT(pages_shared);
  FP4KV_STAT(num_sequences);
  FP4KV_STAT(tokens_stored);
  FP4KV_STAT(tokens_resident);
  FP4KV_STAT(wasted_slots);
  FP4KV_STAT(bytes_per_token);
  FP4KV_STAT(pool_bytes);
  FP4KV_STAT(memory_available_at_create);
  FP4KV_STAT(memory_budget_clamped);
  FP4KV_STAT(sequence_lengths);
  FP4KV_STAT(pages_cached);
  FP4KV_STAT(pages_indexed);
  FP4KV_STAT(evictions);
  FP4KV_STAT(prefix_queries);
  FP4KV_STAT(prefix_query_tokens);
  FP4KV_STAT(prefix_hit_tokens);
  FP4KV_STAT(prefix_hit_rate);
  FP4KV_STAT(host_prefix_pages_total);
  FP4KV_STAT(host_prefix_pages_cached);
  FP4KV_STAT(host_prefix_bytes);
  FP4KV_STAT(host_prefix_demotions);
  FP4KV_STAT(host_prefix_promotions);
  FP4KV_STAT(host_prefix_evictions);
  FP4KV_STAT(prefix_hit_tokens_host);
  FP4KV_STAT(events_pending);
  FP4KV_STAT(events_dropped);
  FP4KV_STAT(pages_reserved);
  FP4KV_STAT(reservations);
  FP4KV_STAT(bytes_exported);
  FP4KV_STAT(bytes_imported);
  FP4KV_STAT(host_pages_total);
  FP4KV_STAT(host_pages_free);
  FP4KV_STAT(host_pages_used);
  FP4KV_STAT(host_bytes);
  FP4KV_STAT(sequences_swapped);
  FP4KV_STAT(swaps_in_flight);
  FP4KV_STAT(pages_retiring);
  FP4KV_STAT(token_ids_pending);
  FP4KV_STAT(token_ids_dropped);
  FP4KV_STAT(pages_swap_pending);
  FP4KV_STAT(bytes_swapped_out);
  FP4KV_STAT(bytes_swapped_in);
#undef FP4KV_STAT

  nb::class_<SequenceImageHeader>(m, "SequenceImageHeader", "A parsed sequence image header.")
      .def_ro("version", &SequenceImageHeader::version)
      .def_ro("image_bytes", &SequenceImageHeader::image_bytes)
      .def_ro("length", &SequenceImageHeader::length)
      .def_ro("num_layers", &SequenceImageHeader::num_layers)
      .def_ro("geometry", &SequenceImageHeader::geometry)
      .def_ro("recipe", &SequenceImageHeader::recipe)
      .def_ro("num_pages", &SequenceImageHeader::num_pages)
      .def_ro("flags", &SequenceImageHeader::flags)
      .def_prop_ro("has_tokens", &SequenceImageHeader::has_tokens);
  m.def(
      "parse_sequence_image_header",
      [](nb::handle image) {
        const TensorView v = In(image, "image");
        if (v.device.is_cuda()) ThrowInvalid("image: expected host memory, got a CUDA tensor");
        const Bytes b = BytesOf(v, "image");
        return Take(ParseSequenceImageHeader(b.data, b.size));
      },
      "image"_a, "Parses and validates the header at the start of a host image.");
  nb::class_<ImportReservation>(m, "ImportReservation",
                                "Pages of a KVCache set aside for one image.")
      .def_prop_ro("id", &ImportReservation::id)
      .def_prop_ro("header", &ImportReservation::header);

  // ---- bound ops
  nb::class_<CacheAppender>(m, "CacheAppender", "The appender of a KVCache (keeps it alive).")
      .def(
          "run",
          [](const CacheAppender& op, int layer, nb::handle key, nb::handle value,
             uintptr_t stream) {
            const TensorView k = In(key, "key"), v = In(value, "value");
            Check(op.Run(layer, k, v, StreamOf(stream)));
          },
          "layer"_a, "key"_a, "value"_a, "stream"_a = 0,
          "Quantizes the step's new rows key [R, H, Dk], value [R, H, Dv] into layer `layer`.")
      .def("for_slot", Checked<&CacheAppender::ForSlot>, "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheAppender::slot);
  nb::class_<CacheMaterializer>(m, "CacheMaterializer",
                                "The materializer of a KVCache (keeps it alive).")
      .def(
          "run",
          [](const CacheMaterializer& op, int layer, nb::handle out, uintptr_t stream) {
            const TensorView o = Out(out, "out");
            Check(op.Run(layer, o, StreamOf(stream)));
          },
          "layer"_a, "out"_a, "stream"_a = 0)
      .def("for_slot", Checked<&CacheMaterializer::ForSlot>, "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheMaterializer::slot);
  nb::class_<CacheDequantizer>(m, "CacheDequantizer",
                               "The dequantizer of a KVCache (keeps it alive).")
      .def(
          "run",
          [](const CacheDequantizer& op, int layer, nb::handle k_out, nb::handle v_out,
             uintptr_t stream) {
            const TensorView k = Out(k_out, "k_out"), v = Out(v_out, "v_out");
            Check(op.Run(layer, k, v, StreamOf(stream)));
          },
          "layer"_a, "k_out"_a, "v_out"_a, "stream"_a = 0)
      .def("for_slot", Checked<&CacheDequantizer::ForSlot>, "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheDequantizer::slot);
  nb::class_<CacheAttention>(m, "CacheAttention",
                             "Attention over a KVCache's step (keeps it alive).")
      .def(
          "run",
          [](const CacheAttention& op, int layer, nb::handle q, nb::handle out,
             nb::handle workspace, uintptr_t stream, nb::handle lse, nb::handle sinks) {
            const TensorView qv = In(q, "q"), o = Out(out, "out"), l = OutOpt(lse, "lse"),
                             s = InOpt(sinks, "sinks");
            const Bytes w = OutBytes(workspace, "workspace");
            Check(op.Run(layer, qv, o, w.data, w.size, StreamOf(stream), l, s));
          },
          "layer"_a, "q"_a, "out"_a, "workspace"_a = nb::none(), "stream"_a = 0,
          "lse"_a = nb::none(), "sinks"_a = nb::none(),
          "Attention of the step's query rows q [R, Hq, Dk] into out [R, Hq, Dv].")
      .def_prop_ro("workspace_bytes", &CacheAttention::WorkspaceBytes)
      .def("for_slot", Checked<&CacheAttention::ForSlot>, "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheAttention::slot);

  // ---- KVCache
  nb::class_<KVCache>(m, "KVCache", nb::is_weak_referenceable(),
                      "The stateful NVFP4 KV cache of a whole model (kv_cache.h). Views and "
                      "bound ops keep it alive.")
      .def(
          "__init__",
          [](KVCache* self, const KVCacheOptions& o) {
            new (self) KVCache(Take(KVCache::Create(o)));
          },
          "options"_a)
      // sequences
      .def("create_sequence", Checked<&KVCache::CreateSequence>)
      .def(
          "create_sequence_from_prefix",
          [](KVCache& c, nb::handle prompt, const std::string& extra_key) {
            Ids ids;
            IdsOf(prompt, "prompt", ids);
            return Take(c.CreateSequenceFromPrefix(ids.span, extra_key));
          },
          "prompt"_a, "extra_key"_a = "")
      .def(
          "match_prefix",
          [](const KVCache& c, nb::handle prompt, const std::string& extra_key) {
            Ids ids;
            IdsOf(prompt, "prompt", ids);
            return c.MatchPrefix(ids.span, extra_key);
          },
          "prompt"_a, "extra_key"_a = "")
      .def("fork_sequence", Checked<&KVCache::ForkSequence>, "parent"_a)
      .def("truncate", Checked<&KVCache::Truncate>, "seq"_a, "new_len"_a)
      .def("release_sequence", Checked<&KVCache::ReleaseSequence>, "seq"_a)
      .def(
          "import_half_pages",
          [](KVCache& c, const std::vector<const PyHalfPagedCache*>& layers, nb::handle src_pages,
             int64_t length, uintptr_t stream) {
            std::vector<HalfPagedCache> l;
            for (const PyHalfPagedCache* p : layers) {
              if (p == nullptr) ThrowInvalid("layers: expected HalfPagedCache objects, got None");
              l.push_back(p->cache);
            }
            Ids ids;
            IdsOf(src_pages, "src_pages", ids);
            return Take(c.ImportHalfPages(l, ids.span, length, StreamOf(stream)));
          },
          "layers"_a, "src_pages"_a, "length"_a, "stream"_a = 0)
      .def("sequence_length", Checked<&KVCache::SequenceLength>, "seq"_a)
      .def(
          "sequence_pages",
          [](const KVCache& c, SequenceId s) { return ToVector(Take(c.SequencePages(s))); },
          "seq"_a)
      .def("page_ref_count", Checked<&KVCache::PageRefCount>, "page"_a)
      .def("set_retention_priority", Checked<&KVCache::SetRetentionPriority>, "seq"_a, "priority"_a)
      .def(
          "read_sequence",
          [](const KVCache& c, int layer, SequenceId seq, nb::handle k_out, nb::handle v_out,
             uintptr_t stream) {
            const TensorView k = Out(k_out, "k_out"), v = Out(v_out, "v_out");
            Check(c.ReadSequence(layer, seq, k, v, StreamOf(stream)));
          },
          "layer"_a, "seq"_a, "k_out"_a, "v_out"_a, "stream"_a = 0)
      // export / import
      .def("exported_bytes", Checked<&KVCache::ExportedBytes>, "seq"_a)
      .def(
          "export_sequence",
          [](const KVCache& c, SequenceId s, nb::handle dst, uintptr_t stream) {
            const Bytes b = BytesOf(Out(dst, "dst"), "dst");
            Check(c.ExportSequence(s, b.data, b.size, StreamOf(stream)));
          },
          "seq"_a, "dst"_a, "stream"_a = 0)
      .def("reserve_import", Checked<&KVCache::ReserveImport>, "header"_a)
      .def(
          "commit_import",
          [](KVCache& c, ImportReservation& r, nb::handle image, StoredTokens on_mismatch,
             uintptr_t stream) {
            const Bytes b = BytesOf(In(image, "image"), "image");
            ImportOptions o;
            o.on_scale_mismatch = on_mismatch;
            return Take(c.CommitImport(std::move(r), b.data, b.size, o, StreamOf(stream)));
          },
          "reservation"_a, "image"_a, "on_scale_mismatch"_a = StoredTokens::kRefuse, "stream"_a = 0)
      .def(
          "cancel_import",
          [](KVCache& c, ImportReservation& r) { Check(c.CancelImport(std::move(r))); },
          "reservation"_a)
      .def(
          "import_sequence",
          [](KVCache& c, nb::handle image, StoredTokens on_mismatch, uintptr_t stream) {
            const Bytes b = BytesOf(In(image, "image"), "image");
            ImportOptions o;
            o.on_scale_mismatch = on_mismatch;
            return Take(c.ImportSequence(b.data, b.size, o, StreamOf(stream)));
          },
          "image"_a, "on_scale_mismatch"_a = StoredTokens::kRefuse, "stream"_a = 0)
      // host tier
      .def("swap_out", Checked<&KVCache::SwapOut>, "seq"_a, "stream"_a = 0)
      .def("swap_in", Checked<&KVCache::SwapIn>, "seq"_a, "stream"_a = 0)
      .def("is_swapped_out", Checked<&KVCache::IsSwappedOut>, "seq"_a)
      .def("synchronize_swaps", Checked<&KVCache::SynchronizeSwaps>)
      // steps
      .def(
          "prepare_step",
          [](KVCache& c, nb::handle entries, uintptr_t stream) {
            std::vector<Ids> ids;
            std::vector<StepEntry> e = EntriesOf(entries, ids);
            return Take(c.PrepareStep(e, StreamOf(stream)));
          },
          "entries"_a, "stream"_a = 0,
          "entries: (seq, num_new_tokens) or (seq, num_new_tokens, token_ids) tuples, or "
          "StepEntry.")
      .def(
          "plan_step",
          [](const KVCache& c, nb::handle entries) {
            std::vector<Ids> ids;
            std::vector<StepEntry> e = EntriesOf(entries, ids);
            return Take(c.PlanStep(e));
          },
          "entries"_a)
      .def_prop_ro("step", [](const KVCache& c) { return c.step(); })
      .def(
          "step_info", [](const KVCache& c, int slot) { return c.step(slot); }, "slot"_a)
      .def(
          "step_views",
          [](nb::handle self, int slot) {
            const KVCache& c = Self(self);
            return StepViewsDict(slot < 0 ? c.step_views() : c.step_views(slot), self);
          },
          "slot"_a = -1,
          "Read-only DLPack views of the step buffers (fixed addresses): slot_mapping, "
          "block_tables, seq_lens, kv_page_indptr, token_indptr, fp8_block_tables.")
      .def_prop_ro("host_slot_mapping",
                   [](const KVCache& c) { return ToVector(c.host_slot_mapping()); })
      .def_prop_ro("host_seq_lens", [](const KVCache& c) { return ToVector(c.host_seq_lens()); })
      .def_prop_ro("host_kv_page_indptr",
                   [](const KVCache& c) { return ToVector(c.host_kv_page_indptr()); })
      .def_prop_ro("host_token_indptr",
                   [](const KVCache& c) { return ToVector(c.host_token_indptr()); })
      .def(
          "host_block_table",
          [](const KVCache& c, int row) { return ToVector(c.host_block_table(row)); }, "row"_a)
      // ops
      .def("appender", Checked<&KVCache::appender>, "input_dtype"_a = DType::kBF16,
           nb::keep_alive<0, 1>())
      .def("materializer", Checked<&KVCache::materializer>, nb::keep_alive<0, 1>())
      .def("dequantizer", Checked<&KVCache::dequantizer>, "output_dtype"_a = DType::kBF16,
           nb::keep_alive<0, 1>())
      .def("attention",
           &AttentionFrom<&AtO::num_qo_heads, &AtO::dtype, &AtO::max_q_len, &AtO::sm_scale,
                          &AtO::logits_soft_cap, &AtO::window_left, &AtO::has_sinks,
                          &AtO::write_lse>,
           "num_qo_heads"_a, "dtype"_a = DType::kBF16, "max_q_len"_a = 1, "sm_scale"_a = 0.0f,
           "logits_soft_cap"_a = 0.0f, "window_left"_a = -1, "has_sinks"_a = false,
           "write_lse"_a = false, nb::keep_alive<0, 1>())
      .def("fp8_workspace_pages_at_capacity", &KVCache::Fp8WorkspacePagesAtCapacity)
      .def("fp8_workspace_shape", &KVCache::Fp8WorkspaceShape, "pages"_a)
      // prefix cache
      .def(
          "set_token_ids",
          [](KVCache& c, SequenceId seq, int64_t first, nb::handle ids, uintptr_t stream) {
            RoArray a;
            if (!PyList_Check(ids.ptr()) && !PyTuple_Check(ids.ptr()) &&
                nb::try_cast(ids, a, false)) {
              if (a.device_type() == nb::device::cuda::value) {
                Check(c.SetTokenIds(seq, first, ViewOf(a, "ids"), StreamOf(stream)));
                return;
              }
            }
            Ids i;
            IdsOf(ids, "ids", i);
            Check(c.SetTokenIds(seq, first, i.span));
          },
          "seq"_a, "first_position"_a, "ids"_a, "stream"_a = 0,
          "ids: a list or CPU int32 array (applied now) or a CUDA int32 tensor (copied on "
          "`stream`).")
      .def("take_events", &KVCache::TakeEvents)
      .def("reset_prefix_cache", &KVCache::ResetPrefixCache)
      .def("check_invariants", Checked<&KVCache::CheckInvariants>)
      // scales
      .def(
          "update_global_scales",
          [](KVCache& c, int layer, float k, float v, uintptr_t stream, StoredTokens stored) {
            Check(c.UpdateGlobalScales(layer, k, v, StreamOf(stream), stored));
          },
          "layer"_a, "k_scale"_a, "v_scale"_a, "stream"_a = 0, "stored"_a = StoredTokens::kRefuse)
      .def(
          "update_all_global_scales",
          [](KVCache& c, const std::vector<float>& k, const std::vector<float>& v, uintptr_t stream,
             StoredTokens stored) { Check(c.UpdateGlobalScales(k, v, StreamOf(stream), stored)); },
          "k_scales"_a, "v_scales"_a, "stream"_a = 0, "stored"_a = StoredTokens::kRefuse)
      .def(
          "calibrate_global_scales",
          [](KVCache& c, int layer, nb::handle k, nb::handle v, Calibrator& cal, uintptr_t stream,
             StoredTokens stored) {
            Check(c.CalibrateGlobalScales(layer, In(k, "k"), In(v, "v"), cal, StreamOf(stream),
                                          stored));
          },
          "layer"_a, "k"_a, "v"_a, "calibrator"_a, "stream"_a = 0,
          "stored"_a = StoredTokens::kRefuse)
      .def("read_scales", Checked<&KVCache::ReadScales>, "layer"_a, "stream"_a = 0)
      .def("layer_tokens", Checked<&KVCache::LayerTokens>, "layer"_a)
      .def("read_scale_events", Checked<&KVCache::ReadScaleEvents>, "layer"_a, "stream"_a = 0)
      .def("reset_scale_events", Checked<&KVCache::ResetScaleEvents>, "stream"_a = 0)
      .def(
          "global_scale_ptr",
          [](const KVCache& c, int layer, int kv) {
            return reinterpret_cast<uintptr_t>(c.global_scale_ptr(layer, kv));
          },
          "layer"_a, "kv"_a,
          "Device address of layer's K (kv=0) or V (kv=1) global scale; 0 out of range.")
      .def(
          "fp8_scale_ptr",
          [](const KVCache& c, int layer, int kv) {
            return reinterpret_cast<uintptr_t>(c.fp8_scale_ptr(layer, kv));
          },
          "layer"_a, "kv"_a)
      .def(
          "layer_cache",
          [](nb::handle self, int layer) {
            const KVCache& c = Self(self);
            if (layer < 0 || layer >= c.num_layers()) {
              Throw(absl::InvalidArgumentError("layer: expected 0 <= layer < " +
                                               std::to_string(c.num_layers()) + ", got " +
                                               std::to_string(layer)));
            }
            const PagedCache pc = c.LayerCache(layer);
            PyPagedCache p;
            p.cache = pc;
            p.read_only = true;
            p.arrays = {Export(pc.k_data, self, true), Export(pc.v_data, self, true),
                        Export(pc.k_scales, self, true), Export(pc.v_scales, self, true)};
            return p;
          },
          "layer"_a,
          "Layer `layer`'s pools as a read-only PagedCache (DLPack views that keep the cache "
          "alive).")
      // properties
      .def_prop_ro("options", &KVCache::options)
      .def_prop_ro("geometry", &KVCache::geometry)
      .def_prop_ro("num_layers", &KVCache::num_layers)
      .def_prop_ro("device", &KVCache::device)
      .def("stats", &KVCache::Stats);
}

}  // namespace python
}  // namespace fp4kv
