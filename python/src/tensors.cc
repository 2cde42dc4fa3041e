// fp4kv._core: Caches over caller tensors: PagedCache and HalfPagedCache.
#include "binding.h"

namespace fp4kv {
namespace python {

void RegisterTensors(nb::module_& m) {
  // ---- PagedCache / HalfPagedCache
  nb::class_<PyPagedCache>(m, "PagedCache",
                           "Paged NVFP4 storage over caller tensors (kept alive): data [P, S, H, "
                           "D/2] u8 and scales [P, S, H, D/16] e4m3/u8 for NHD. Read-only when "
                           "any tensor is (KVCache.layer_cache): ops that write a cache refuse it.")
      .def(
          "__init__",
          [](PyPagedCache* p, nb::handle k_data, nb::handle v_data, nb::handle k_scales,
             nb::handle v_scales, Layout layout) {
            new (p) PyPagedCache(
                MakePagedCache(k_data, v_data, k_scales, v_scales, layout, KeyFormat::kNvfp4));
          },
          "k_data"_a, "v_data"_a, "k_scales"_a, "v_scales"_a, "layout"_a = Layout::kNHD)
      .def_static(
          "fp8_keys",
          [](nb::handle k_data, nb::handle v_data, nb::handle v_scales, Layout layout) {
            return MakePagedCache(k_data, v_data, nb::none(), v_scales, layout, KeyFormat::kFp8);
          },
          "k_data"_a, "v_data"_a, "v_scales"_a, "layout"_a = Layout::kNHD,
          "FP8 E4M3 keys [P, S, H, Dk], NVFP4 values.")
      .def_static(
          "stacked",
          [](nb::handle data, nb::handle scales, Layout layout) {
            PyPagedCache p;
            p.cache = Take(PagedCache::FromStacked(In(data, "data"), In(scales, "scales"), layout));
            p.read_only = !IsWritable(data) || !IsWritable(scales);
            p.arrays = {nb::borrow(data), nb::none(), nb::borrow(scales), nb::none()};
            return p;
          },
          "data"_a, "scales"_a, "layout"_a = Layout::kNHD,
          "Stacked 5-D form: data [P, 2, S, H, D/2], scales [P, 2, S, H, D/16] (NHD).")
      .def_prop_ro("geometry", [](const PyPagedCache& p) { return Take(p.cache.Geometry()); })
      .def_prop_ro("read_only", [](const PyPagedCache& p) { return p.read_only; })
      .def_prop_ro("layout", [](const PyPagedCache& p) { return p.cache.layout; })
      .def_prop_ro("key_format", [](const PyPagedCache& p) { return p.cache.key_format; })
      .def_prop_ro("k_data", [](const PyPagedCache& p) { return p.arrays[0]; })
      .def_prop_ro("v_data", [](const PyPagedCache& p) { return p.arrays[1]; })
      .def_prop_ro("k_scales", [](const PyPagedCache& p) { return p.arrays[2]; })
      .def_prop_ro("v_scales", [](const PyPagedCache& p) { return p.arrays[3]; });

  nb::class_<PyHalfPagedCache>(m, "HalfPagedCache",
                               "An unquantized f16/bf16 paged cache: k [P, S, H, Dk], v [P, S, H, "
                               "Dv] (NHD) or [P, H, S, D] (HND).")
      .def(
          "__init__",
          [](PyHalfPagedCache* p, nb::handle k, nb::handle v, Layout layout) {
            new (p) PyHalfPagedCache();
            p->cache = HalfPagedCache::FromTuple(In(k, "k"), In(v, "v"), layout);
            p->arrays = {nb::borrow(k), nb::borrow(v)};
          },
          "k"_a, "v"_a, "layout"_a = Layout::kNHD)
      .def_static(
          "stacked",
          [](nb::handle kv, Layout layout) {
            PyHalfPagedCache p;
            p.cache = Take(HalfPagedCache::FromStacked(In(kv, "kv"), layout));
            p.arrays = {nb::borrow(kv)};
            return p;
          },
          "kv"_a, "layout"_a = Layout::kNHD, "[P, 2, S, H, D] (NHD) or [P, 2, H, S, D] (HND).")
      .def_prop_ro("layout", [](const PyHalfPagedCache& p) { return p.cache.layout; });

}

}  // namespace python
}  // namespace fp4kv
