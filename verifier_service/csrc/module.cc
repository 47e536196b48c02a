#include <pybind11/pybind11.h>

#include "kernels.h"

PYBIND11_MODULE(_cpu_kernels, m) {
  m.doc() = "The verifier's CPU kernels (fp32 and bf16): paged attention of short segments, linear layers of a few rows; "
          "batch-invariant attention; RMSNorm; a Llama layer's rotary embedding and SwiGLU; rows' argmax; top-p's nucleus; draws from rows; bf16 linear layers on AMX and on AVX512-BF16";
  using release = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("attends", &speclane::attends);
  m.def("attend", &speclane::attend, release());
  m.def("linear", &speclane::linear, release());
  m.def("attends_invariantly", &speclane::attends_invariantly);
  m.def("attend_invariant", &speclane::attend_invariant, release());
  m.def("rms_norm", &speclane::rms_norm, release());
  m.def("add_rms_norm", &speclane::add_rms_norm, release());
  m.def("rope_store", &speclane::rope_store, release());
  m.def("silu_mul", &speclane::silu_mul, release());
  m.def("row_argmax", &speclane::row_argmax, release());
  m.def("nucleus", &speclane::nucleus, release());
  m.def("draw", &speclane::draw, release());
  m.def("amx_ready", &speclane::amx_ready);
  m.def("amx_linear", &speclane::amx_linear, release());
  m.def("bf16_linear_ready", &speclane::bf16_linear_ready);
  m.def("bf16_linear", &speclane::bf16_linear, release());
}
