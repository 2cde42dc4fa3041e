// fp4kv._core: The plain types: enums, Device, Recipe, the format helpers and CacheGeometry.
#include "binding.h"

namespace fp4kv {
namespace python {

void RegisterTypes(nb::module_& m) {
  // ---- enums
  nb::enum_<DType>(m, "DType", "Element types of tensors.")
      .value("f16", DType::kF16)
      .value("bf16", DType::kBF16)
      .value("f32", DType::kF32)
      .value("u8", DType::kU8)
      .value("e4m3", DType::kE4M3)
      .value("i32", DType::kI32)
      .value("i64", DType::kI64);
  nb::enum_<DeviceType>(m, "DeviceType")
      .value("cpu", DeviceType::kCPU)
      .value("cuda", DeviceType::kCUDA);
  nb::enum_<Layout>(m, "Layout",
                    "Where a page keeps its rows: NHD [P, S, H, D] or HND [P, H, S, D].")
      .value("NHD", Layout::kNHD)
      .value("HND", Layout::kHND);
  nb::enum_<KeyFormat>(m, "KeyFormat", "How a cache stores its keys (values are always NVFP4).")
      .value("nvfp4", KeyFormat::kNvfp4)
      .value("fp8", KeyFormat::kFp8);
  nb::enum_<RecipeKind>(m, "RecipeKind")
      .value("standard", RecipeKind::kStandard)
      .value("four_over_six", RecipeKind::kFourOverSix);
  nb::enum_<ErrorMetric>(m, "ErrorMetric")
      .value("mae", ErrorMetric::kMae)
      .value("mse", ErrorMetric::kMse);
  nb::enum_<AppendIndexing>(m, "AppendIndexing")
      .value("paged", AppendIndexing::kPaged)
      .value("slot", AppendIndexing::kSlot);
  nb::enum_<StoredTokens>(m, "StoredTokens", "What a scale change does to stored tokens.")
      .value("refuse", StoredTokens::kRefuse)
      .value("reencode", StoredTokens::kReencode);
  nb::enum_<KVEventType>(m, "KVEventType")
      .value("block_stored", KVEventType::kBlockStored)
      .value("block_removed", KVEventType::kBlockRemoved)
      .value("all_blocks_cleared", KVEventType::kAllBlocksCleared);
  nb::enum_<KVMedium>(m, "KVMedium").value("gpu", KVMedium::kGpu).value("host", KVMedium::kHost);

  // ---- Device
  nb::class_<Device>(m, "Device",
                     "A device: Device.cpu() or Device.cuda(ordinal); also made from "
                     "'cpu', 'cuda' or 'cuda:N'.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](Device* d, const std::string& s) {
            if (s == "cpu") {
              new (d) Device(Device::Cpu());
              return;
            }
            if (s == "cuda") {
              new (d) Device(Device::Cuda(0));
              return;
            }
            if (s.rfind("cuda:", 0) == 0) {
              try {
                new (d) Device(Device::Cuda(std::stoi(s.substr(5))));
                return;
              } catch (const std::exception&) {
              }
            }
            ThrowInvalid("device: expected 'cpu', 'cuda' or 'cuda:N', got '" + s + "'");
          },
          "name"_a)
      .def_static("cpu", &Device::Cpu)
      .def_static("cuda", &Device::Cuda, "ordinal"_a = 0)
      .def_rw("type", &Device::type)
      .def_rw("ordinal", &Device::ordinal)
      .def_prop_ro("is_cuda", &Device::is_cuda)
      .def("__eq__", [](const Device& a, const Device& b) { return a == b; })
      .def("__repr__", [](const Device& d) { return "Device('" + d.ToString() + "')"; });
  nb::implicitly_convertible<std::string, Device>();

  // ---- Recipe
  nb::class_<Recipe>(m, "Recipe",
                     "Quantization recipe: Recipe.standard() or Recipe.four_over_six(...).")
      .def(nb::init<>())
      .def_static("standard", &Recipe::Standard)
      .def_static("four_over_six", &Recipe::FourOverSix, "e4m3_max"_a = 256,
                  "metric"_a = ErrorMetric::kMae, "fast_math"_a = false)
      .def_rw("kind", &Recipe::kind)
      .def_rw("e4m3_max", &Recipe::e4m3_max)
      .def_rw("metric", &Recipe::metric)
      .def_rw("fast_math", &Recipe::fast_math)
      .def_prop_ro("name", [](const Recipe& r) { return RecipeName(r); })
      .def_prop_ro("code", Checked<&RecipeToCode>)
      .def_static("from_code", Checked<&RecipeFromCode>, "code"_a)
      .def("__eq__", [](const Recipe& a, const Recipe& b) { return a == b; })
      .def("__repr__", [](const Recipe& r) { return "Recipe('" + RecipeName(r) + "')"; });
  m.def(
      "all_recipes",
      [] {
        auto a = AllRecipes();
        return std::vector<Recipe>(a.begin(), a.end());
      },
      "Every valid recipe, standard first.");
  m.def("validate_recipe", Checked<&ValidateRecipe>, "recipe"_a);

  // ---- format helpers
  m.def(
      "make_global_scale", [](float amax, const Recipe& r) { return MakeGlobalScale(amax, r); },
      "amax"_a, "recipe"_a = Recipe(), "The global decode scale amax / (6 * e4m3_max).");
  m.def("max_global_scale", [] { return MaxGlobalScale(); });
  m.def(
      "is_valid_global_scale", [](float g) { return IsValidGlobalScale(g); }, "g"_a);
  m.def("min_fp8_scale", Checked<&MinFp8Scale>, "global_scale"_a,
        "The smallest FP8 decode scale under which a cache with global scale g never saturates.");
  m.def(
      "make_fp8_key_scale", [](float amax) { return MakeFp8KeyScale(amax); }, "amax"_a);
  m.attr("BLOCK_SIZE") = kBlockSize;
  m.attr("MAX_ATTENTION_Q_LEN") = kMaxAttentionQLen;
  m.attr("MAX_RETENTION_PRIORITY") = kMaxRetentionPriority;
  m.attr("SEQUENCE_IMAGE_HEADER_BYTES") = kSequenceImageHeaderBytes;

  // ---- CacheGeometry
  nb::class_<CacheGeometry>(m, "CacheGeometry",
                            "Geometry of one paged cache (one layer's K and V).")
      .def(
          "__init__",
          [](CacheGeometry* g, int num_kv_heads, int head_dim_k, int head_dim_v, int page_size,
             int64_t num_pages, Layout layout, KeyFormat key_format) {
            new (g) CacheGeometry();
            g->num_kv_heads = num_kv_heads;
            g->head_dim_k = head_dim_k;
            g->head_dim_v = head_dim_v == 0 ? head_dim_k : head_dim_v;
            g->page_size = page_size;
            g->num_pages = num_pages;
            g->layout = layout;
            g->key_format = key_format;
          },
          "num_kv_heads"_a = 0, "head_dim_k"_a = 0, "head_dim_v"_a = 0, "page_size"_a = 0,
          "num_pages"_a = 0, "layout"_a = Layout::kNHD, "key_format"_a = KeyFormat::kNvfp4,
          "head_dim_v = 0 means head_dim_k.")
      .def_rw("num_kv_heads", &CacheGeometry::num_kv_heads)
      .def_rw("head_dim_k", &CacheGeometry::head_dim_k)
      .def_rw("head_dim_v", &CacheGeometry::head_dim_v)
      .def_rw("page_size", &CacheGeometry::page_size)
      .def_rw("num_pages", &CacheGeometry::num_pages)
      .def_rw("layout", &CacheGeometry::layout)
      .def_rw("key_format", &CacheGeometry::key_format)
      .def("validate", Checked<&CacheGeometry::Validate>)
      .def("data_row_bytes", &CacheGeometry::DataRowBytes, "is_v"_a)
      .def("scale_row_bytes", &CacheGeometry::ScaleRowBytes, "is_v"_a)
      .def("page_bytes", &CacheGeometry::PageBytes)
      .def("bytes_per_token", &CacheGeometry::BytesPerToken)
      .def("__repr__", [](const CacheGeometry& g) {
        return "CacheGeometry(num_kv_heads=" + std::to_string(g.num_kv_heads) +
               ", head_dim_k=" + std::to_string(g.head_dim_k) +
               ", head_dim_v=" + std::to_string(g.head_dim_v) +
               ", page_size=" + std::to_string(g.page_size) +
               ", num_pages=" + std::to_string(g.num_pages) + ", layout=" + LayoutName(g.layout) +
               ", key_format=" + KeyFormatName(g.key_format) + ")";
      });

}

}  // namespace python
}  // namespace fp4kv
