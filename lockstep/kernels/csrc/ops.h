// Every op the extension exports, one source file each (linear.cpp, int8.cpp, attention.cpp, argmax.cpp,
// fused.cpp, layer.cpp, amx_bf16.cpp); register.cpp binds them. Block types arrive as GGML type ids (blocks.h).
#pragma once

#include <ATen/core/Tensor.h>

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
// layer.cpp: a whole decoder layer of the float32 path, the ops above in the modules' order
at::Tensor decoder_layer(const at::Tensor& h, const std::vector<at::Tensor>& norms, double eps,
                         const std::vector<at::Tensor>& w, const std::vector<int64_t>& type,
                         const std::vector<int64_t>& int8, const std::vector<int64_t>& count,
                         const std::vector<int64_t>& k, const c10::optional<at::Tensor>& qkv_bias, int64_t hq,
                         int64_t hk, int64_t dh, const c10::optional<at::Tensor>& qw,
                         const c10::optional<at::Tensor>& kw, double qk_eps, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& k_buf, const at::Tensor& v_buf,
                         const at::Tensor& loc, const at::Tensor& kv_slots, const at::Tensor& starts,
                         const at::Tensor& lens, double scaling, double softcap, int64_t window,
                         const std::string& act);
#ifdef LOCKSTEP_AVX512
// amx_bf16.cpp: bfloat16 x against bfloat16-rounded blocks on AMX tiles
at::Tensor linear_amx_bf16(const at::Tensor& xb, const at::Tensor& blocks, int64_t type, int64_t k);
#endif

}  // namespace lockstep
