// Every op the extension exports, one source file each (linear.cpp, int8.cpp, attention.cpp, argmax.cpp,
// fused.cpp, layer.cpp, lora.cpp, amx_bf16.cpp); register.cpp binds them. Block types arrive as GGML type ids (blocks.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <tuple>
#include <vector>

namespace lockstep {

// linear.cpp: the exact path, float32 x against blocks dequantized in registers
at::Tensor linear(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t k);
at::Tensor linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                        const std::vector<int64_t>& types, int64_t k);
at::Tensor embedding(const at::Tensor& ids, const at::Tensor& blocks, int64_t type, int64_t k);
// int8.cpp: x quantized per block of 32, integer dot products (llama.cpp's arithmetic)
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t k);
at::Tensor linear_int8_parts(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                             const std::vector<int64_t>& types, int64_t k);
struct LoraOperands;
// the same, with the adapters' products added (lora.cpp): in the base's parallel region where x is
// few rows (one fork for both), else by lora_sgmv after it
at::Tensor linear_int8_parts_lora(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                                  const std::vector<int64_t>& types, int64_t k, const LoraOperands* lora);
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x);
// attention.cpp: one query per request over the paged KV pool
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                            const at::Tensor& kv_slots, const at::Tensor& start, const at::Tensor& len,
                            double scaling, double softcap, int64_t window);
// argmax.cpp: greedy sampling's first maximum per row
at::Tensor argmax_rows(const at::Tensor& x);
// fused.cpp: row-wise float32 ops of a decoder layer
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const at::Tensor& x,
                                                const c10::optional<at::Tensor>& wx,
                                                const c10::optional<at::Tensor>& wy, double eps);
void qk_norm_rope(const at::Tensor& qkv, int64_t hq, int64_t hk, int64_t dh, const c10::optional<at::Tensor>& qw,
                  const c10::optional<at::Tensor>& kw, const at::Tensor& cos, const at::Tensor& sin, double eps);
at::Tensor act_and_mul(const at::Tensor& gate_up, const std::string& act);
// lora.cpp: every LoRA adapter's low-rank product beside one linear, the whole batch in one call
// (y += B_s A_s x per row, s the row's slot; y in place)
void lora_sgmv(const at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& scales, const at::Tensor& ranks, const at::Tensor& slots,
               const std::vector<int64_t>& splits);
// One linear's adapter slots (lora_sgmv's operands but the rows), checked once where they are built
// (a layer's LayerConsts, at its construction): each call then reads these few fields, not the
// tensors' metadata, which a decode step finds cold in cache at every linear (the weights streamed
// since evict it): checking and reading the four tensors' shapes, strides and data there was 0.9 us
// a linear, 1.5% of one user's decode step (docs/benchmarks.md, "Adapters in int8").
struct LoraWeights {
  LoraWeights(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scales, const at::Tensor& ranks,
              const std::vector<int64_t>& splits);
  at::Tensor a, b, scales, ranks;  // held, so that the pointers below stay valid
  std::vector<int64_t> splits;
  at::ScalarType type;               // a's and b's
  const void* ap;                    // a's first element (type), b's, the scales', the ranks'
  const void* bp;
  const float* sp;
  const int64_t* rp;                 // read at each call: loading an adapter writes the ranks in place
  int64_t s_count, m, r_max, k, n;   // slots, modules, max rank, in and out features
  int64_t a_slot, b_slot, s_slot;    // strides between slots
};
// lora_sgmv's work for rows x (float32 [T, K]) with slots (int64 [T], -1: no adapter), checked and
// cut into items, so that another kernel can run it inside its own parallel region (int8.cpp's
// one-row linear: the base matmul and its adapters, one fork)
class LoraPlan {
 public:
  struct Item {
    int64_t row0, rows, slot, module, lo, hi;  // a tile of one slot's rows; A rows or columns [lo, hi)
  };
  using Items = std::vector<Item>;
  LoraPlan(const at::Tensor& x, const LoraWeights& w, const at::Tensor& slots);
  bool empty() const { return shrink_.empty(); }  // no row has an adapted module
  int64_t items() const { return static_cast<int64_t>(expand_.size()); }
  // On `threads` threads: before(part, parts) on each, then the shrink, a barrier, the expand into
  // y [T, N] (row stride ys), each thread its share of the items (which thread changes no bits)
  void run(int64_t threads, const std::function<void(int64_t, int64_t)>& before, float* y, int64_t ys);

 private:
  void shrink(int64_t part, int64_t parts);
  void expand(float* y, int64_t ys, int64_t part, int64_t parts) const;
  const LoraWeights& w_;
  Items shrink_, expand_;
  std::vector<float> u_;  // each row's shrink results, [T, M R]
  const float* x_ = nullptr;
  int64_t xs_ = 0;
};
// A linear's adapters and this forward's rows' slots (what the linears below take, null: none)
struct LoraOperands {
  const LoraWeights& w;
  const at::Tensor& slots;
};
void lora_add(const at::Tensor& y, const at::Tensor& x, const LoraOperands& lora);  // lora_sgmv on them
// layer.cpp: a whole decoder layer of the float32 path, the ops above in the modules' order.
// How each weight part is multiplied: the weight plan's kinds (layers/block_weight.Kind), by name.
// Python passes the names ("exact", ...); register.cpp turns them into these once, at construction.
enum class PartKind : int64_t { kExact = 0, kInt8 = 1, kFloat = 2 };
// A layer's constant arguments, by name: X(type, name). register.cpp builds a LayerConsts from the
// Python keyword arguments of the same names (kernels/layer_consts.py lists them), refusing a
// missing or unknown one, so the two sides cannot disagree silently.
#define LOCKSTEP_LAYER_CONSTS(X)                                                                       \
  X(std::vector<at::Tensor>, norms)       /* input, post-attention (+ Gemma's pre/post feed-forward) */ \
  X(double, eps)                          /* the norms' epsilon */                                     \
  X(std::vector<at::Tensor>, weights)     /* every part of qkv, o, gate_up, down, in that order */     \
  X(std::vector<PartKind>, kinds)         /* each part's kind */                                       \
  X(std::vector<int64_t>, block_types)    /* each part's GGML type id (float parts: F32's, 0) */       \
  X(std::vector<int64_t>, part_counts)    /* parts per linear, 4 linears */                            \
  X(std::vector<int64_t>, in_features)    /* per linear */                                             \
  X(c10::optional<at::Tensor>, qkv_bias)  /* Qwen2's */                                                \
  X(int64_t, n_q)                         /* this rank's query heads */                                \
  X(int64_t, n_kv)                        /* and KV heads */                                           \
  X(int64_t, head_dim)                                                                                 \
  X(c10::optional<at::Tensor>, q_norm)    /* Qwen3's / Gemma's per-head q/k norms */                   \
  X(c10::optional<at::Tensor>, k_norm)                                                                 \
  X(double, qk_eps)                                                                                    \
  X(double, scaling)                      /* attention's */                                            \
  X(double, softcap)                      /* 0: none */                                                \
  X(int64_t, window)                      /* 0: none */                                                \
  X(std::string, act)                     /* "silu" | "gelu_tanh" */                                   \
  /* LoRA (lora_sgmv's operands), per linear, or all empty where the layer has no adapter slots: */     \
  X(std::vector<at::Tensor>, lora_a)      /* the slots' A [S, M R, K] (no elements: not adapted) */     \
  X(std::vector<at::Tensor>, lora_b)      /* B transposed [S, R, N] */                                 \
  X(std::vector<at::Tensor>, lora_scales) /* float32 [S, M R] */                                       \
  X(std::vector<at::Tensor>, lora_ranks)  /* int64 [S, M], written in place as slots are filled */     \
  X(std::vector<std::vector<int64_t>>, lora_splits)  /* each module's output columns */
struct LayerConsts {
#define LOCKSTEP_FIELD(type, name) type name{};
  LOCKSTEP_LAYER_CONSTS(LOCKSTEP_FIELD)
#undef LOCKSTEP_FIELD
  std::vector<c10::optional<LoraWeights>> lora;  // per linear, from the lora_* fields (finish_layer_consts)
};
// The per-step arguments: this step's rows h, rotary cos/sin, the layer's K/V buffers, where this
// step's K/V goes (loc), each row's K/V slots (kv_slots[starts[r] : starts[r] + lens[r]]) and each
// row's LoRA slot (none: no row has an adapter).
at::Tensor decoder_layer(const at::Tensor& h, const LayerConsts& c, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_buf, const at::Tensor& v_buf, const at::Tensor& loc,
                         const at::Tensor& kv_slots, const at::Tensor& starts, const at::Tensor& lens,
                         const c10::optional<at::Tensor>& lora_slots);
void finish_layer_consts(LayerConsts& c);  // TORCH_CHECKs the parts' counts agree, builds c.lora
#ifdef LOCKSTEP_AVX512
// amx_bf16.cpp: bfloat16 x against bfloat16-rounded blocks on AMX tiles
at::Tensor linear_amx_bf16(const at::Tensor& xb, const at::Tensor& blocks, int64_t type, int64_t k);
#endif

}  // namespace lockstep
