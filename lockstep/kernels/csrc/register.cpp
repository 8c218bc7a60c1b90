// The one registration file: every op of ops.h, callable from Python without the GIL.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

namespace {
template <class F>
void def(pybind11::module_& mod, const char* name, F f) {
  mod.def(name, f, pybind11::call_guard<pybind11::gil_scoped_release>());
}
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  using namespace lockstep;
  def(mod, "linear", &linear);
  def(mod, "linear_parts", &linear_parts);
  def(mod, "embedding", &embedding);
  def(mod, "linear_int8", &linear_int8);
  def(mod, "linear_int8_parts", &linear_int8_parts);
  def(mod, "quantize_int8", &quantize_int8);
  def(mod, "decode_attention", &decode_attention);
  def(mod, "argmax_rows", &argmax_rows);
  def(mod, "rms_norm", &rms_norm);
  def(mod, "add_rms_norm", &add_rms_norm);
  def(mod, "qk_norm_rope", &qk_norm_rope);
  def(mod, "act_and_mul", &act_and_mul);
  def(mod, "decoder_layer", &decoder_layer);
#ifdef LOCKSTEP_AVX512
  def(mod, "linear_amx_bf16", &linear_amx_bf16);
#endif
}
