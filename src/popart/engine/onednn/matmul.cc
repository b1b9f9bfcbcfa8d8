// popart-xla: 2D f32 matrix products y = relu?(a @ b + bias?) through oneDNN's matmul primitive,
// as one XLA FFI handler (CPU).
//
// a is [..., M, K] (leading dims folded into M when b and bias are shared), b is [K, N], or
// [N, K] when attribute mm[0] (trans_b) is 1 (ONNX Gemm's transB, PyTorch's Linear weight);
// bias is [N] (used when mm[1] is 1, else ignored), added by oneDNN's bias; mm[2] 1 appends a
// ReLU post-op. Weights are taken in their given row-major layout (no reorder); primitives are
// made once per shape and cached.
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = memory::format_tag;

namespace {

dnnl::engine& cpu() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

struct Plan {
  dnnl::matmul prim;
  memory::desc a, b, bias, y, scratch;
};

using Key = std::vector<int64_t>;  // M, K, N, trans_b, has_bias, relu

std::shared_ptr<Plan> make_plan(const Key& k) {
  const auto f32 = memory::data_type::f32;
  auto plan = std::make_shared<Plan>();
  plan->a = memory::desc({k[0], k[1]}, f32, tag::ab);
  plan->b = memory::desc({k[1], k[2]}, f32, k[3] ? tag::ba : tag::ab);
  plan->y = memory::desc({k[0], k[2]}, f32, tag::ab);
  if (k[4]) plan->bias = memory::desc({1, k[2]}, f32, tag::ab);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (k[5]) {
    dnnl::post_ops po;
    po.append_eltwise(dnnl::algorithm::eltwise_relu, 0.f, 0.f);
    attr.set_post_ops(po);
  }
  auto pd = k[4] ? dnnl::matmul::primitive_desc(cpu(), plan->a, plan->b, plan->bias, plan->y, attr)
                 : dnnl::matmul::primitive_desc(cpu(), plan->a, plan->b, plan->y, attr);
  plan->prim = dnnl::matmul(pd);
  plan->scratch = pd.scratchpad_desc();
  return plan;
}

std::shared_ptr<Plan> get_plan(const Key& k) {
  static std::mutex mu;
  static std::map<Key, std::shared_ptr<Plan>> plans;
  std::lock_guard<std::mutex> lock(mu);
  auto& p = plans[k];
  if (!p) p = make_plan(k);
  return p;
}

int64_t lead(ffi::Span<const int64_t> d, size_t keep) {  // product of the dims before the last keep
  int64_t b = 1;
  for (size_t i = 0; i + keep < d.size(); ++i) b *= d[i];
  return b;
}

ffi::Error Matmul(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> bias,
                  ffi::ResultBuffer<ffi::F32> out, ffi::Span<const int64_t> mm) {
  if (mm.size() != 3) return ffi::Error::InvalidArgument("mm needs 3 values");
  auto da = a.dimensions(), db = b.dimensions(), dr = out->dimensions();
  if (da.size() < 2 || db.size() < 2 || dr.size() < 2)
    return ffi::Error::InvalidArgument("operands need 2 dims at least");
  const int64_t trans_b = mm[0], has_bias = mm[1], relu = mm[2];
  int64_t M = da[da.size() - 2], K = da[da.size() - 1];
  const int64_t N = dr[dr.size() - 1];
  const int64_t batches = lead(dr, 2);
  if (db[db.size() - (trans_b ? 1 : 2)] != K || db[db.size() - (trans_b ? 2 : 1)] != N)
    return ffi::Error::InvalidArgument("a [.., M, K] and b [K, N] (or [N, K]) do not match");
  if (M * N == 0) return ffi::Error::Success();
  if (K == 0) {  // a sum over nothing: bias (or 0), then relu
    float* po = out->typed_data();
    for (int64_t i = 0; i < batches * M; ++i)
      for (int64_t j = 0; j < N; ++j) {
        float v = has_bias ? bias.typed_data()[j] : 0.f;
        po[i * N + j] = relu && v < 0.f ? 0.f : v;
      }
    return ffi::Error::Success();
  }
  // Shared b and bias (vmap's expand_dims gives them leading 1s): one product over batches*M rows.
  const bool shared = lead(db, 2) == 1 && lead(bias.dimensions(), 1) == 1 &&
                      lead(da, 2) == batches;
  int64_t loops = batches;
  if (shared) M *= batches, loops = 1;
  try {
    auto plan = get_plan({M, K, N, trans_b, has_bias, relu});
    static std::mutex run_mu;  // one product at a time: each uses every OpenMP thread
    std::lock_guard<std::mutex> running(run_mu);
    dnnl::stream s(cpu());
    thread_local std::vector<uint8_t> scratch;
    if (scratch.size() < plan->scratch.get_size()) scratch.resize(plan->scratch.get_size());
    memory pad(plan->scratch, cpu(), scratch.data());
    const size_t sa = lead(da, 2) == 1 || loops == 1 ? 0 : M * K;
    const size_t sb = lead(db, 2) == 1 || loops == 1 ? 0 : K * N;
    const size_t sbias = lead(bias.dimensions(), 1) == 1 || loops == 1 ? 0 : N;
    float *pa = a.typed_data(), *pb = b.typed_data(), *pbias = bias.typed_data();
    float* po = out->typed_data();
    for (int64_t i = 0; i < loops; ++i, pa += sa, pb += sb, pbias += sbias, po += M * N) {
      memory ma(plan->a, cpu(), pa), mb(plan->b, cpu(), pb), my(plan->y, cpu(), po);
      std::unordered_map<int, memory> args{
          {DNNL_ARG_SRC, ma}, {DNNL_ARG_WEIGHTS, mb}, {DNNL_ARG_DST, my},
          {DNNL_ARG_SCRATCHPAD, pad}};
      if (has_bias) args[DNNL_ARG_BIAS] = memory(plan->bias, cpu(), pbias);
      plan->prim.execute(s, args);
    }
    s.wait();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PopartOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("mm"));
