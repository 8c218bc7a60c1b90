// The one registration file: every op of ops.h, callable from Python without the GIL, and the named
// constants of the one-call decoder layer (LayerConsts), built from keyword arguments.
#include <torch/csrc/utils/pybind.h>

#include <utility>

#include "ops.h"

namespace {
namespace py = pybind11;
using lockstep::PartKind;

template <class F, class... Extra>
void def(py::module_& mod, const char* name, F f, const Extra&... extra) {
  mod.def(name, f, extra..., py::call_guard<py::gil_scoped_release>());
}

// the weight plan's kinds (layers/block_weight.Kind values) the layer multiplies by
const std::pair<const char*, PartKind> kPartKinds[] = {
    {"exact", PartKind::kExact}, {"int8", PartKind::kInt8}, {"float", PartKind::kFloat}};

PartKind part_kind(const std::string& name) {
  for (const auto& [n, kind] : kPartKinds)
    if (name == n) return kind;
  throw py::value_error("LayerConsts: no part kind '" + name + "' in the one-call layer");
}

// field `name` of the keyword arguments, removed from `left` (what remains is unknown)
template <class T>
void take(py::dict& left, const char* name, T& out) {
  if (!left.contains(name)) throw py::type_error(std::string("LayerConsts: missing field '") + name + "'");
  out = left[name].cast<T>();
  PyDict_DelItemString(left.ptr(), name);
}

void take(py::dict& left, const char* name, std::vector<PartKind>& out) {
  std::vector<std::string> names;
  take(left, name, names);
  for (const auto& n : names) out.push_back(part_kind(n));
}

lockstep::LayerConsts layer_consts(const py::kwargs& kw) {
  py::dict left;
  for (auto item : kw) left[item.first] = item.second;
  lockstep::LayerConsts c;
#define LOCKSTEP_TAKE(type, name) take(left, #name, c.name);
  LOCKSTEP_LAYER_CONSTS(LOCKSTEP_TAKE)
#undef LOCKSTEP_TAKE
  if (py::len(left)) throw py::type_error("LayerConsts: unknown field(s) " + py::str(left.attr("keys")()).cast<std::string>());
  lockstep::finish_layer_consts(c);
  return c;
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
  def(mod, "lora_sgmv", &lora_sgmv);
  // module_local: the AVX2 and AVX-512 builds each register their own (tests load both in one process)
  py::class_<LayerConsts> consts(mod, "LayerConsts", py::module_local());
  consts.def(py::init(&layer_consts));
  py::list fields, kinds;
#define LOCKSTEP_NAME(type, name) fields.append(#name);
  LOCKSTEP_LAYER_CONSTS(LOCKSTEP_NAME)
#undef LOCKSTEP_NAME
  for (const auto& [name, kind] : kPartKinds) kinds.append(name);
  consts.attr("fields") = py::tuple(fields);  // what the Python side's names are checked against
  consts.attr("part_kinds") = py::tuple(kinds);
  def(mod, "decoder_layer", &decoder_layer, py::arg("h"), py::arg("consts"), py::arg("cos"), py::arg("sin"),
      py::arg("k_buf"), py::arg("v_buf"), py::arg("loc"), py::arg("kv_slots"), py::arg("starts"), py::arg("lens"),
      py::arg("lora_slots") = py::none());
#ifdef LOCKSTEP_AVX512
  def(mod, "linear_amx_bf16", &linear_amx_bf16);
#endif
}
