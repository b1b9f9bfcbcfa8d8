// popart-xla: f32 matrix products y[M, N] = a[M, K] @ W through oneDNN's matmul, as XLA FFI
// handlers (CPU), with the weight W either as ONNX holds it (kind 0, reordered into the
// primitive's blocked layout on each call) or packed once by the pack handler (kind 1).
//
// PopartOnednnMatmul(a, w) -> y, attribute geom = [kind, K, N, trans, pack_m]: a's leading dims
//   are the rows M (any number of them, vmap's included); w is W [K, N] (trans 0) or W^T [N, K]
//   (trans 1) for kind 0, or the packed bytes (as f32) for kind 1, with leading dims of size 1.
// PopartOnednnPack(w) -> packed, same geom (kind ignored): W in the layout oneDNN's matmul chose
//   for pack_m rows (format_tag::any); popart_onednn_packed_bytes(K, N, trans, pack_m) gives
//   its size when tracing. A product of another M uses a primitive made for that M on the
//   packed layout (oneDNN's brgemm kernels take the blocked weights for any M).
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dnnl.hpp"
#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = memory::format_tag;

namespace {

using popart_onednn::cpu;
using popart_onednn::run_mutex;
using popart_onednn::Scratch;

const auto f32 = memory::data_type::f32;

memory::desc user_w(int64_t K, int64_t N, int64_t trans) {
  return memory::desc({K, N}, f32, trans ? tag::ba : tag::ab);
}

// The weights' layout oneDNN's matmul picks for (pack_m, K, N): what the pack writes.
memory::desc packed_desc(int64_t K, int64_t N, int64_t pack_m) {
  static std::mutex mu;
  static std::map<std::vector<int64_t>, memory::desc> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& d = cache[{K, N, pack_m}];
  if (d.is_zero()) {
    memory::desc src({pack_m, K}, f32, tag::ab), dst({pack_m, N}, f32, tag::ab);
    memory::desc w({K, N}, f32, tag::any);
    d = dnnl::matmul::primitive_desc(cpu(), src, w, dst).weights_desc();
  }
  return d;
}

struct Plan {
  dnnl::primitive prim;
  memory::desc src, w, dst, w_user;
  dnnl::reorder w_reorder;  // user -> w (kind 0 when they differ, and the pack)
  bool reorder = false;
  size_t scratch = 0;
};

std::mutex plans_mu;
std::map<std::vector<int64_t>, std::shared_ptr<Plan>> plans;

// key: kind (0 matmul on user weights, 1 on packed, 2 the pack), M, K, N, trans, pack_m
std::shared_ptr<Plan> get_plan(const std::vector<int64_t>& k) {
  std::lock_guard<std::mutex> lock(plans_mu);
  auto& p = plans[k];
  if (p) return p;
  const int64_t kind = k[0], M = k[1], K = k[2], N = k[3], trans = k[4], pm = k[5];
  p = std::make_shared<Plan>();
  p->w_user = user_w(K, N, trans);
  p->src = memory::desc({M, K}, f32, tag::ab);
  p->dst = memory::desc({M, N}, f32, tag::ab);
  const memory::desc packed = packed_desc(K, N, pm);
  if (kind == 2) {
    p->w = packed;
    p->reorder = true;
    p->w_reorder = dnnl::reorder(dnnl::reorder::primitive_desc(cpu(), p->w_user, cpu(), packed));
    return p;
  }
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const memory::desc w = kind == 1 ? packed : memory::desc({K, N}, f32, tag::any);
  auto pd = dnnl::matmul::primitive_desc(cpu(), p->src, w, p->dst, attr);
  p->prim = dnnl::matmul(pd);
  p->w = pd.weights_desc();
  p->scratch = pd.scratchpad_desc().get_size();
  p->reorder = kind == 0 && p->w != p->w_user;
  if (p->reorder)
    p->w_reorder = dnnl::reorder(dnnl::reorder::primitive_desc(cpu(), p->w_user, cpu(), p->w));
  return p;
}

ffi::Error Matmul(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> out, ffi::Span<const int64_t> geom) {
  if (geom.size() != 5) return ffi::Error::InvalidArgument("geom needs 5 values");
  const int64_t kind = geom[0], K = geom[1], N = geom[2];
  auto da = a.dimensions(), dw = w.dimensions(), dr = out->dimensions();
  if (da.size() == 0 || da[da.size() - 1] != K) return ffi::Error::InvalidArgument("a's last dim is not K");
  // vmap (expand_dims): every operand has the batch dims in front, 1s where unbatched. A batched
  // weight (its dims beyond its own rank) runs one product per item, a shared one folds into M.
  int64_t Ma = 1, Mout = 1, wl = 1;
  for (size_t i = 0; i + 1 < da.size(); ++i) Ma *= da[i];
  for (size_t i = 0; i + 1 < dr.size(); ++i) Mout *= dr[i];
  for (size_t i = 0; i + (kind == 1 ? 1 : 2) < dw.size(); ++i) wl *= dw[i];
  const int64_t m = wl > 0 ? Mout / wl : 0;
  if (wl == 0 || Mout % wl != 0 || (Ma != Mout && Ma != m))
    return ffi::Error::InvalidArgument("the operands' batch dims do not match");
  if (Mout * K * N == 0) {
    std::memset(out->typed_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  try {
    auto plan = get_plan({kind == 1 ? 1 : 0, m, K, N, geom[3], geom[4]});
    std::lock_guard<std::mutex> running(run_mutex());
    dnnl::stream s(cpu());
    thread_local Scratch scratch, wbuf;
    memory pad(memory::desc({(int64_t)plan->scratch}, memory::data_type::u8, tag::a), cpu(),
               scratch.get(plan->scratch + 1));
    const int64_t a_step = Ma == Mout ? m * K : 0, w_step = (int64_t)w.element_count() / wl;
    for (int64_t i = 0; i < wl; ++i) {
      memory src(plan->src, cpu(), a.typed_data() + i * a_step);
      memory dst(plan->dst, cpu(), out->typed_data() + i * m * N);
      memory wm(plan->reorder ? plan->w_user : plan->w, cpu(), w.typed_data() + i * w_step);
      if (plan->reorder) {
        memory packed(plan->w, cpu(), wbuf.get(plan->w.get_size()));
        plan->w_reorder.execute(s, wm, packed);
        wm = packed;
      }
      plan->prim.execute(s, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, dst},
                             {DNNL_ARG_SCRATCHPAD, pad}});
    }
    s.wait();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("oneDNN matmul: ") + e.what());
  }
  return ffi::Error::Success();
}

std::atomic<int64_t> packs{0};  // how many packs ran (tests count them)

ffi::Error Pack(ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                ffi::Span<const int64_t> geom) {
  if (geom.size() != 5) return ffi::Error::InvalidArgument("geom needs 5 values");
  try {
    auto plan = get_plan({2, geom[4], geom[1], geom[2], geom[3], geom[4]});
    if (plan->w.get_size() > out->size_bytes())
      return ffi::Error::InvalidArgument("the packed buffer is too small");
    std::lock_guard<std::mutex> running(run_mutex());
    dnnl::stream s(cpu());
    memory src(plan->w_user, cpu(), w.typed_data()), dst(plan->w, cpu(), out->typed_data());
    plan->w_reorder.execute(s, src, dst);
    s.wait();
    packs++;
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("oneDNN pack: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" int64_t popart_onednn_packed_bytes(int64_t K, int64_t N, int64_t trans, int64_t pack_m) {
  (void)trans;
  try {
    return (int64_t)packed_desc(K, N, pack_m).get_size();
  } catch (...) {
    return -1;
  }
}

extern "C" int64_t popart_onednn_packs() { return packs.load(); }

extern "C" const char* popart_onednn_matmul_impl(int64_t M, int64_t K, int64_t N, int64_t packed) {
  static thread_local std::string s;
  try {
    const memory::desc w = packed ? packed_desc(K, N, M) : memory::desc({K, N}, f32, tag::any);
    auto pd = dnnl::matmul::primitive_desc(cpu(), memory::desc({M, K}, f32, tag::ab), w,
                                           memory::desc({M, N}, f32, tag::ab));
    s = pd.impl_info_str();
  } catch (const std::exception& e) {
    s = e.what();
  }
  return s.c_str();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(PopartOnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("geom"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PopartOnednnPack, Pack,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("geom"));
