// fp4kv._core: The functional ops on caller memory: the validate-once op objects and the
// create + run functions.
#include "binding.h"

namespace fp4kv {
namespace python {

namespace {

// The arguments that Dequantizer.run and dequantize_paged share, converted in
// this order (the first bad one is the one reported).
DequantArgs DequantArgsOf(nb::handle block_tables, nb::handle seq_lens, nb::handle k_out,
                          nb::handle v_out, nb::handle k_scale, nb::handle v_scale) {
  DequantArgs a;
  a.block_tables = In(block_tables, "block_tables");
  a.seq_lens = In(seq_lens, "seq_lens");
  a.k_out = Out(k_out, "k_out");
  a.v_out = Out(v_out, "v_out");
  a.k_scale = ScaleOf(k_scale, "k_scale");
  a.v_scale = ScaleOf(v_scale, "v_scale");
  return a;
}

// Likewise for Materializer.run and materialize_fp8.
MaterializeArgs MaterializeArgsOf(nb::handle block_tables, nb::handle seq_lens,
                                  nb::handle kv_page_indptr, nb::handle out,
                                  nb::handle fp8_block_tables, nb::handle k_scale,
                                  nb::handle v_scale, nb::handle k_fp8_scale,
                                  nb::handle v_fp8_scale) {
  MaterializeArgs a;
  a.block_tables = In(block_tables, "block_tables");
  a.seq_lens = In(seq_lens, "seq_lens");
  a.kv_page_indptr = In(kv_page_indptr, "kv_page_indptr");
  a.out = Out(out, "out");
  a.fp8_block_tables = Out(fp8_block_tables, "fp8_block_tables");
  a.k_scale = ScaleOf(k_scale, "k_scale");
  a.v_scale = ScaleOf(v_scale, "v_scale");
  a.k_fp8_scale = ScaleOf(k_fp8_scale, "k_fp8_scale");
  a.v_fp8_scale = ScaleOf(v_fp8_scale, "v_fp8_scale");
  return a;
}

}  // namespace

void RegisterOps(nb::module_& m) {
  using AO = Appender::Options;
  using DO = Dequantizer::Options;
  using MO = Materializer::Options;
  using LO = LinearQuantizer::Options;
  using QO = PagedCacheQuantizer::Options;
  using AtO = DecodeAttention::Options;
  using CO = Calibrator::Options;

  // ---- functional op objects
  nb::class_<Appender>(m, "Appender", "Quantize f16/bf16 rows and scatter them into a paged cache.")
      .def("__init__",
           &CreateFrom<Appender, &AO::geometry, &AO::input_dtype, &AO::indexing, &AO::recipe,
                       &AO::device, &AO::count_scale_events>,
           "geometry"_a, "input_dtype"_a = DType::kBF16, "indexing"_a = AppendIndexing::kPaged,
           "recipe"_a = Recipe(), "device"_a = Device::Cpu(), "count_scale_events"_a = false)
      .def(
          "run",
          [](const Appender& op, const PyPagedCache& cache, nb::handle key, nb::handle value,
             nb::handle slot_mapping, nb::handle batch_indices, nb::handle positions,
             nb::handle kv_indices, nb::handle kv_indptr, nb::handle kv_last_page_len,
             nb::handle k_scale, nb::handle v_scale, nb::handle scale_events, uintptr_t stream) {
            AppendArgs a;
            a.key = In(key, "key");
            a.value = In(value, "value");
            a.slot_mapping = InOpt(slot_mapping, "slot_mapping");
            a.batch_indices = InOpt(batch_indices, "batch_indices");
            a.positions = InOpt(positions, "positions");
            a.kv_indices = InOpt(kv_indices, "kv_indices");
            a.kv_indptr = InOpt(kv_indptr, "kv_indptr");
            a.kv_last_page_len = InOpt(kv_last_page_len, "kv_last_page_len");
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            if (!scale_events.is_none()) {
              TensorView e = Out(scale_events, "scale_events");
              if ((e.dtype != DType::kI64) || e.numel() < 4) {
                ThrowInvalid("scale_events: expected an int64/uint64 tensor of 4 elements, got " +
                             std::string(DTypeName(e.dtype)) + " " + e.ShapeString());
              }
              a.scale_events = static_cast<uint64_t*>(e.data);
            }
            const PagedCache& c = WritableCache(cache);
            RunWithoutGil([&] { return op.Run(a, c, StreamOf(stream)); });
          },
          "cache"_a, "key"_a, "value"_a, nb::kw_only(), "slot_mapping"_a = nb::none(),
          "batch_indices"_a = nb::none(), "positions"_a = nb::none(), "kv_indices"_a = nb::none(),
          "kv_indptr"_a = nb::none(), "kv_last_page_len"_a = nb::none(), "k_scale"_a = 1.0f,
          "v_scale"_a = 1.0f, "scale_events"_a = nb::none(), "stream"_a = 0);

  nb::class_<Dequantizer>(m, "Dequantizer",
                          "Gather a paged cache into contiguous [B, T, H, D] f16/bf16.")
      .def(
          "__init__",
          &CreateFrom<Dequantizer, &DO::geometry, &DO::output_dtype, &DO::table_dtype, &DO::device>,
          "geometry"_a, "output_dtype"_a = DType::kBF16, "table_dtype"_a = DType::kI32,
          "device"_a = Device::Cpu())
      .def(
          "run",
          [](const Dequantizer& op, const PyPagedCache& cache, nb::handle block_tables,
             nb::handle seq_lens, nb::handle k_out, nb::handle v_out, nb::handle k_scale,
             nb::handle v_scale, uintptr_t stream) {
            const DequantArgs a =
                DequantArgsOf(block_tables, seq_lens, k_out, v_out, k_scale, v_scale);
            RunWithoutGil([&] { return op.Run(a, cache.cache, StreamOf(stream)); });
          },
          "cache"_a, "block_tables"_a, "seq_lens"_a, "k_out"_a, "v_out"_a, nb::kw_only(),
          "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "stream"_a = 0);

  nb::class_<Materializer>(m, "Materializer", "Write the active pages as FP8 E4M3 pages.")
      .def("__init__",
           &CreateFrom<Materializer, &MO::geometry, &MO::table_dtype, &MO::separate_kv_tables,
                       &MO::device>,
           "geometry"_a, "table_dtype"_a = DType::kI32, "separate_kv_tables"_a = false,
           "device"_a = Device::Cpu())
      .def(
          "run",
          [](const Materializer& op, const PyPagedCache& cache, nb::handle block_tables,
             nb::handle seq_lens, nb::handle kv_page_indptr, nb::handle out,
             nb::handle fp8_block_tables, nb::handle k_scale, nb::handle v_scale,
             nb::handle k_fp8_scale, nb::handle v_fp8_scale, uintptr_t stream) {
            const MaterializeArgs a =
                MaterializeArgsOf(block_tables, seq_lens, kv_page_indptr, out, fp8_block_tables,
                                  k_scale, v_scale, k_fp8_scale, v_fp8_scale);
            RunWithoutGil([&] { return op.Run(a, cache.cache, StreamOf(stream)); });
          },
          "cache"_a, "block_tables"_a, "seq_lens"_a, "kv_page_indptr"_a, "out"_a,
          "fp8_block_tables"_a, nb::kw_only(), "k_scale"_a, "v_scale"_a, "k_fp8_scale"_a,
          "v_fp8_scale"_a, "stream"_a = 0);

  nb::class_<LinearQuantizer>(m, "LinearQuantizer",
                              "[M, K] f16/bf16 <-> packed [M, K/2] u8 + scales [M, K/16] e4m3.")
      .def("__init__", &CreateFrom<LinearQuantizer, &LO::dtype, &LO::recipe, &LO::device>,
           "dtype"_a = DType::kBF16, "recipe"_a = Recipe(), "device"_a = Device::Cpu())
      .def(
          "quantize",
          [](const LinearQuantizer& op, nb::handle input, nb::handle packed, nb::handle scales,
             nb::handle global_scale, uintptr_t stream) {
            const TensorView i = In(input, "input"), p = Out(packed, "packed"),
                             s = Out(scales, "scales");
            const GlobalScale g = ScaleOf(global_scale, "global_scale");
            RunWithoutGil([&] { return op.Quantize(i, p, s, g, StreamOf(stream)); });
          },
          "input"_a, "packed"_a, "scales"_a, "global_scale"_a, "stream"_a = 0)
      .def(
          "dequantize",
          [](const LinearQuantizer& op, nb::handle packed, nb::handle scales, nb::handle output,
             nb::handle global_scale, uintptr_t stream) {
            const TensorView p = In(packed, "packed"), s = In(scales, "scales"),
                             o = Out(output, "output");
            const GlobalScale g = ScaleOf(global_scale, "global_scale");
            RunWithoutGil([&] { return op.Dequantize(p, s, o, g, StreamOf(stream)); });
          },
          "packed"_a, "scales"_a, "output"_a, "global_scale"_a, "stream"_a = 0);

  nb::class_<PagedCacheQuantizer>(
      m, "PagedCacheQuantizer",
      "Quantize a whole f16/bf16 paged cache (or listed pages) into NVFP4 pages.")
      .def("__init__",
           &CreateFrom<PagedCacheQuantizer, &QO::geometry, &QO::source_layout, &QO::input_dtype,
                       &QO::recipe, &QO::device, &QO::compute_scales, &QO::headroom>,
           "geometry"_a, "source_layout"_a = Layout::kNHD, "input_dtype"_a = DType::kBF16,
           "recipe"_a = Recipe(), "device"_a = Device::Cpu(), "compute_scales"_a = false,
           "headroom"_a = 1.0f)
      .def(
          "run",
          [](const PagedCacheQuantizer& op, const PyHalfPagedCache& source,
             const PyPagedCache& cache, nb::handle src_pages, nb::handle dst_pages,
             int64_t num_tokens, nb::handle k_scale, nb::handle v_scale, nb::handle k_scale_out,
             nb::handle v_scale_out, uintptr_t stream) {
            QuantizeCacheArgs a;
            a.source = source.cache;
            a.src_pages = InOpt(src_pages, "src_pages");
            a.dst_pages = InOpt(dst_pages, "dst_pages");
            a.num_tokens = num_tokens;
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            a.k_scale_out = FloatOut(k_scale_out, "k_scale_out");
            a.v_scale_out = FloatOut(v_scale_out, "v_scale_out");
            const PagedCache& c = WritableCache(cache);
            RunWithoutGil([&] { return op.Run(a, c, StreamOf(stream)); });
          },
          "source"_a, "cache"_a, nb::kw_only(), "src_pages"_a = nb::none(),
          "dst_pages"_a = nb::none(), "num_tokens"_a = -1, "k_scale"_a = 1.0f, "v_scale"_a = 1.0f,
          "k_scale_out"_a = nb::none(), "v_scale_out"_a = nb::none(), "stream"_a = 0);

  nb::class_<DecodeAttention>(
      m, "DecodeAttention", "Attention straight from NVFP4 pages (decode rows and prefill chunks).")
      .def("__init__",
           &CreateFrom<DecodeAttention, &AtO::geometry, &AtO::num_qo_heads, &AtO::dtype,
                       &AtO::table_dtype, &AtO::max_batch, &AtO::max_pages_per_seq, &AtO::max_q_len,
                       &AtO::sm_scale, &AtO::logits_soft_cap, &AtO::window_left, &AtO::has_sinks,
                       &AtO::write_lse, &AtO::device>,
           "geometry"_a, "num_qo_heads"_a, "dtype"_a = DType::kBF16, "table_dtype"_a = DType::kI32,
           "max_batch"_a, "max_pages_per_seq"_a, "max_q_len"_a = 1, "sm_scale"_a = 0.0f,
           "logits_soft_cap"_a = 0.0f, "window_left"_a = -1, "has_sinks"_a = false,
           "write_lse"_a = false, "device"_a = Device::Cpu())
      .def_prop_ro("workspace_bytes", &DecodeAttention::WorkspaceBytes)
      .def(
          "run",
          [](const DecodeAttention& op, const PyPagedCache& cache, nb::handle q,
             nb::handle block_tables, nb::handle seq_lens, nb::handle out, nb::handle q_indptr,
             nb::handle lse, nb::handle sinks, nb::handle k_scale, nb::handle v_scale,
             nb::handle workspace, uintptr_t stream) {
            DecodeAttentionArgs a;
            a.q = In(q, "q");
            a.q_indptr = InOpt(q_indptr, "q_indptr");
            a.block_tables = In(block_tables, "block_tables");
            a.seq_lens = In(seq_lens, "seq_lens");
            a.out = Out(out, "out");
            a.lse = OutOpt(lse, "lse");
            a.sinks = InOpt(sinks, "sinks");
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            const Bytes w = OutBytes(workspace, "workspace");
            RunWithoutGil([&] { return op.Run(a, cache.cache, w.data, w.size, StreamOf(stream)); });
          },
          "cache"_a, "q"_a, "block_tables"_a, "seq_lens"_a, "out"_a, nb::kw_only(),
          "q_indptr"_a = nb::none(), "lse"_a = nb::none(), "sinks"_a = nb::none(),
          "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "workspace"_a = nb::none(), "stream"_a = 0);

  nb::class_<Calibrator>(m, "Calibrator", "Device amax reduction and global scale, no host sync.")
      .def("__init__",
           &CreateFrom<Calibrator, &CO::max_elements, &CO::dtype, &CO::device, &CO::recipe>,
           "max_elements"_a, "dtype"_a = DType::kBF16, "device"_a = Device::Cpu(),
           "recipe"_a = Recipe())
      .def(
          "run",
          [](Calibrator& c, nb::handle input, nb::handle global_scale, nb::handle amax,
             nb::handle fp8_scale, bool fp8_key, uintptr_t stream) {
            const TensorView i = In(input, "input");
            float* g = FloatOut(global_scale, "global_scale");
            float* a = FloatOut(amax, "amax");
            float* f = FloatOut(fp8_scale, "fp8_scale");
            RunWithoutGil([&] {
              return fp8_key ? c.RunFp8Key(i, a, g, StreamOf(stream), f)
                             : c.Run(i, a, g, StreamOf(stream), f);
            });
          },
          "input"_a, "global_scale"_a, nb::kw_only(), "amax"_a = nb::none(),
          "fp8_scale"_a = nb::none(), "fp8_key"_a = false, "stream"_a = 0,
          "Writes the global scale (and amax, the FP8 scale) of `input` into fp32 tensors.");

  // ---- functional API
  m.def(
      "quantize_append_paged",
      [](nb::handle key, nb::handle value, nb::handle batch_indices, nb::handle positions,
         const PyPagedCache& cache, nb::handle kv_indices, nb::handle kv_indptr,
         nb::handle kv_last_page_len, nb::handle k_scale, nb::handle v_scale, const Recipe& recipe,
         uintptr_t stream) {
        const TensorView k = In(key, "key"), v = In(value, "value"),
                         b = In(batch_indices, "batch_indices"), p = In(positions, "positions"),
                         ki = In(kv_indices, "kv_indices"), kp = In(kv_indptr, "kv_indptr"),
                         kl = In(kv_last_page_len, "kv_last_page_len");
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale");
        const PagedCache& c = WritableCache(cache);
        RunWithoutGil([&] {
          return QuantizeAppendPaged(k, v, b, p, c, ki, kp, kl, ks, vs, recipe, StreamOf(stream));
        });
      },
      "key"_a, "value"_a, "batch_indices"_a, "positions"_a, "cache"_a, "kv_indices"_a,
      "kv_indptr"_a, "kv_last_page_len"_a, "k_scale"_a, "v_scale"_a, "recipe"_a = Recipe(),
      "stream"_a = 0);
  m.def(
      "quantize_append_by_slot",
      [](nb::handle key, nb::handle value, nb::handle slot_mapping, const PyPagedCache& cache,
         nb::handle k_scale, nb::handle v_scale, const Recipe& recipe, uintptr_t stream) {
        const TensorView k = In(key, "key"), v = In(value, "value"),
                         s = In(slot_mapping, "slot_mapping");
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale");
        const PagedCache& c = WritableCache(cache);
        RunWithoutGil(
            [&] { return QuantizeAppendBySlot(k, v, s, c, ks, vs, recipe, StreamOf(stream)); });
      },
      "key"_a, "value"_a, "slot_mapping"_a, "cache"_a, "k_scale"_a, "v_scale"_a,
      "recipe"_a = Recipe(), "stream"_a = 0);
  m.def(
      "dequantize_paged",
      [](const PyPagedCache& cache, nb::handle block_tables, nb::handle seq_lens, nb::handle k_out,
         nb::handle v_out, nb::handle k_scale, nb::handle v_scale, uintptr_t stream) {
        const DequantArgs a = DequantArgsOf(block_tables, seq_lens, k_out, v_out, k_scale, v_scale);
        RunWithoutGil([&] {
          return DequantizePaged(cache.cache, a.block_tables, a.seq_lens, a.k_out, a.v_out,
                                 a.k_scale, a.v_scale, StreamOf(stream));
        });
      },
      "cache"_a, "block_tables"_a, "seq_lens"_a, "k_out"_a, "v_out"_a, "k_scale"_a, "v_scale"_a,
      "stream"_a = 0);
  m.def(
      "materialize_fp8",
      [](const PyPagedCache& cache, nb::handle block_tables, nb::handle seq_lens,
         nb::handle kv_page_indptr, nb::handle out, nb::handle fp8_block_tables, nb::handle k_scale,
         nb::handle v_scale, nb::handle k_fp8_scale, nb::handle v_fp8_scale, uintptr_t stream) {
        const MaterializeArgs a =
            MaterializeArgsOf(block_tables, seq_lens, kv_page_indptr, out, fp8_block_tables,
                              k_scale, v_scale, k_fp8_scale, v_fp8_scale);
        RunWithoutGil([&] {
          return MaterializeFp8(cache.cache, a.block_tables, a.seq_lens, a.kv_page_indptr, a.out,
                                a.fp8_block_tables, a.k_scale, a.v_scale, a.k_fp8_scale,
                                a.v_fp8_scale, StreamOf(stream));
        });
      },
      "cache"_a, "block_tables"_a, "seq_lens"_a, "kv_page_indptr"_a, "out"_a, "fp8_block_tables"_a,
      "k_scale"_a, "v_scale"_a, "k_fp8_scale"_a, "v_fp8_scale"_a, "stream"_a = 0);
  m.def(
      "quantize_paged_cache",
      [](const PyHalfPagedCache& source, const PyPagedCache& cache, nb::handle k_scale,
         nb::handle v_scale, nb::handle k_scale_out, nb::handle v_scale_out, const Recipe& recipe,
         uintptr_t stream) {
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale");
        float* ko = FloatOut(k_scale_out, "k_scale_out");
        float* vo = FloatOut(v_scale_out, "v_scale_out");
        const PagedCache& c = WritableCache(cache);
        RunWithoutGil([&] {
          return QuantizePagedCache(source.cache, c, ks, vs, ko, vo, recipe, StreamOf(stream));
        });
      },
      "source"_a, "cache"_a, "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "k_scale_out"_a = nb::none(),
      "v_scale_out"_a = nb::none(), "recipe"_a = Recipe(), "stream"_a = 0);
  m.def(
      "quantize_linear",
      [](nb::handle input, nb::handle packed, nb::handle scales, nb::handle global_scale,
         const Recipe& recipe, uintptr_t stream) {
        const TensorView i = In(input, "input"), p = Out(packed, "packed"),
                         s = Out(scales, "scales");
        const GlobalScale g = ScaleOf(global_scale, "global_scale");
        RunWithoutGil([&] { return QuantizeLinear(i, p, s, g, recipe, StreamOf(stream)); });
      },
      "input"_a, "packed"_a, "scales"_a, "global_scale"_a, "recipe"_a = Recipe(), "stream"_a = 0);
  m.def(
      "dequantize_linear",
      [](nb::handle packed, nb::handle scales, nb::handle output, nb::handle global_scale,
         uintptr_t stream) {
        const TensorView p = In(packed, "packed"), s = In(scales, "scales"),
                         o = Out(output, "output");
        const GlobalScale g = ScaleOf(global_scale, "global_scale");
        RunWithoutGil([&] { return DequantizeLinear(p, s, o, g, StreamOf(stream)); });
      },
      "packed"_a, "scales"_a, "output"_a, "global_scale"_a, "stream"_a = 0);

}

}  // namespace python
}  // namespace fp4kv
