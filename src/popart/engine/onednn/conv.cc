// popart-xla: 2D f32 convolutions through oneDNN, as one XLA FFI handler (CPU).
//
// One handler, three directions (attribute geom[0]): 0 forward y = conv(x, w); 1 backward data
// dx from (dy, w); 2 backward weights dw from (x, dy). Activations (x, y, dx, dy) are NHWC when
// geom[1] is 1, NCHW when 0; weights are always ONNX's OIHW, O x C/G x KH x KW for G groups
// (the same bytes as oneDNN's goihw). geom[2..9]: stride h, w; pad top, left, bottom, right;
// dilation h, w (1 = none); geom[10]: groups G (depthwise: G = C). Operands may carry extra
// leading (vmap) dims: each has either the result's leading dims or all of them 1 (shared).
// Primitives are made once per shape and cached; weights are reordered to the primitive's
// blocked format on each call.
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

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = memory::format_tag;

namespace {

dnnl::engine& cpu() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

struct Plan {  // one cached primitive and what running it needs
  dnnl::primitive prim;
  memory::desc act_in, act_out, w_prim, w_user;
  bool reorder = false;
  dnnl::reorder w_reorder;  // user -> primitive (kinds 0, 1) or primitive -> user (kind 2)
  size_t scratch = 0;
};

using Key = std::vector<int64_t>;
std::mutex plans_mu;
std::map<Key, std::shared_ptr<Plan>> plans;

std::shared_ptr<Plan> make_plan(const Key& k) {
  // k: kind, nhwc, N, C, H, W, O, KH, KW, OH, OW, sh, sw, pt, pl, pb, pr, dh, dw, G
  const int kind = k[0];
  const int64_t g = k[19];
  const tag act = k[1] ? tag::nhwc : tag::nchw;
  const auto f32 = memory::data_type::f32;
  memory::desc src({k[2], k[3], k[4], k[5]}, f32, act);
  memory::desc dst({k[2], k[6], k[9], k[10]}, f32, act);
  // Grouped weights are 5-D (G, O/G, C/G, KH, KW); ONNX's OIHW bytes are goihw.
  const memory::dims wdims = g == 1 ? memory::dims{k[6], k[3], k[7], k[8]}
                                    : memory::dims{g, k[6] / g, k[3] / g, k[7], k[8]};
  memory::desc w_any(wdims, f32, tag::any);
  memory::dims strides{k[11], k[12]}, pl{k[13], k[14]}, pr{k[15], k[16]};
  memory::dims dil{k[17] - 1, k[18] - 1};
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  const auto algo = dnnl::algorithm::convolution_direct;
  auto plan = std::make_shared<Plan>();
  plan->w_user = memory::desc(wdims, f32, g == 1 ? tag::oihw : tag::goihw);
  auto fwd = dnnl::convolution_forward::primitive_desc(
      cpu(), dnnl::prop_kind::forward_training, algo, src, w_any, dst, strides, dil, pl, pr, attr);
  memory::desc scratch;
  if (kind == 0) {
    plan->prim = dnnl::convolution_forward(fwd);
    plan->act_in = src, plan->act_out = dst, plan->w_prim = fwd.weights_desc();
    scratch = fwd.scratchpad_desc();
  } else if (kind == 1) {
    auto bwd = dnnl::convolution_backward_data::primitive_desc(
        cpu(), algo, src, w_any, dst, strides, dil, pl, pr, fwd, attr);
    plan->prim = dnnl::convolution_backward_data(bwd);
    plan->act_in = dst, plan->act_out = src, plan->w_prim = bwd.weights_desc();
    scratch = bwd.scratchpad_desc();
  } else {
    auto bwd = dnnl::convolution_backward_weights::primitive_desc(
        cpu(), algo, src, w_any, dst, strides, dil, pl, pr, fwd, attr);
    plan->prim = dnnl::convolution_backward_weights(bwd);
    plan->act_in = src, plan->act_out = dst, plan->w_prim = bwd.diff_weights_desc();
    scratch = bwd.scratchpad_desc();
  }
  plan->scratch = scratch.get_size();
  plan->reorder = plan->w_prim != plan->w_user;
  if (plan->reorder) {
    plan->w_reorder = kind == 2
        ? dnnl::reorder(dnnl::reorder::primitive_desc(cpu(), plan->w_prim, cpu(), plan->w_user))
        : dnnl::reorder(dnnl::reorder::primitive_desc(cpu(), plan->w_user, cpu(), plan->w_prim));
  }
  return plan;
}

std::shared_ptr<Plan> get_plan(const Key& k) {
  std::lock_guard<std::mutex> lock(plans_mu);
  auto& p = plans[k];
  if (!p) p = make_plan(k);
  return p;
}

struct Scratch {  // a per-thread, 64-byte aligned buffer that only grows
  void* p = nullptr;
  size_t n = 0;
  void* get(size_t need) {
    if (need > n) {
      std::free(p);
      n = (need + 63) / 64 * 64;
      p = std::aligned_alloc(64, n);
    }
    return p;
  }
  ~Scratch() { std::free(p); }
};

int64_t lead(ffi::Span<const int64_t> d) {  // product of the dims before the last four
  int64_t b = 1;
  for (size_t i = 0; i + 4 < d.size(); ++i) b *= d[i];
  return b;
}

ffi::Error Conv(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> out,
                ffi::Span<const int64_t> geom) {
  if (geom.size() != 11) return ffi::Error::InvalidArgument("geom needs 11 values");
  const int64_t kind = geom[0], nhwc = geom[1], G = geom[10];
  // The operands' roles: activations x / dy, weights w (OIHW), by direction.
  auto da = a.dimensions(), db = b.dimensions(), dr = out->dimensions();
  if (da.size() < 4 || db.size() < 4 || dr.size() < 4)
    return ffi::Error::InvalidArgument("operands need 4 dims at least");
  const int64_t batches = lead(dr);
  auto sp = [&](ffi::Span<const int64_t> d, int64_t& n, int64_t& c, int64_t& h, int64_t& w) {
    size_t r = d.size() - 4;
    n = d[r];
    c = nhwc ? d[r + 3] : d[r + 1];
    h = nhwc ? d[r + 1] : d[r + 2];
    w = nhwc ? d[r + 2] : d[r + 3];
  };
  int64_t N, C, H, W, O, KH, KW, OH, OW, t;
  auto weights = [&](ffi::Span<const int64_t> d) {
    size_t r = d.size() - 4;
    O = d[r], C = d[r + 1] * G, KH = d[r + 2], KW = d[r + 3];
  };
  if (kind == 0) sp(da, N, C, H, W), weights(db), sp(dr, t, t, OH, OW);
  else if (kind == 1) sp(da, N, t, OH, OW), weights(db), sp(dr, t, t, H, W);
  else sp(da, N, C, H, W), sp(db, t, O, OH, OW), weights(dr);
  if (N * C * H * W * O * KH * KW * OH * OW == 0) {  // an empty operand: sums over nothing
    std::memset(out->typed_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  // Folding shared weights' vmap dims into the batch: one call over B*N images.
  const bool w_shared = kind != 2 && lead(db) == 1 && lead(da) == batches;
  int64_t loops = batches;
  if (w_shared) N *= batches, loops = 1;
  Key key{kind, nhwc, N, C, H, W, O, KH, KW, OH, OW};
  key.insert(key.end(), geom.begin() + 2, geom.end());
  try {
    auto plan = get_plan(key);
    // One convolution at a time: each uses every OpenMP thread, and XLA may run independent
    // ones (a step's two gradients) concurrently on its own threads.
    static std::mutex run_mu;
    std::lock_guard<std::mutex> running(run_mu);
    dnnl::stream s(cpu());
    thread_local Scratch scratch, wbuf;
    memory pad(memory::desc({(int64_t)plan->scratch}, memory::data_type::u8, tag::a), cpu(),
               scratch.get(plan->scratch + 1));
    const size_t sa = plan->act_in.get_size() / 4, sw = plan->w_user.get_size() / 4;
    const size_t so = (kind == 2 ? sw : plan->act_out.get_size() / 4);
    const size_t sb = kind == 2 ? plan->act_out.get_size() / 4 : sw;
    const size_t step_a = lead(da) == 1 || loops == 1 ? 0 : sa;
    const size_t step_b = lead(db) == 1 || loops == 1 ? 0 : sb;
    float* pa = a.typed_data();
    float* pb = b.typed_data();
    float* po = out->typed_data();
    void* wp = plan->reorder ? wbuf.get(plan->w_prim.get_size()) : nullptr;
    for (int64_t i = 0; i < loops; ++i, pa += step_a, pb += step_b, po += so) {
      if (kind == 2) {
        memory x(plan->act_in, cpu(), pa), dy(plan->act_out, cpu(), pb);
        memory dw_user(plan->w_user, cpu(), po);
        memory dw = plan->reorder ? memory(plan->w_prim, cpu(), wp) : dw_user;
        plan->prim.execute(s, {{DNNL_ARG_SRC, x}, {DNNL_ARG_DIFF_DST, dy},
                               {DNNL_ARG_DIFF_WEIGHTS, dw}, {DNNL_ARG_SCRATCHPAD, pad}});
        if (plan->reorder) plan->w_reorder.execute(s, dw, dw_user);
      } else {
        memory in(plan->act_in, cpu(), pa), res(plan->act_out, cpu(), po);
        memory w_user(plan->w_user, cpu(), pb);
        memory w = plan->reorder ? memory(plan->w_prim, cpu(), wp) : w_user;
        if (plan->reorder && (i == 0 || step_b)) plan->w_reorder.execute(s, w_user, w);
        if (kind == 0)
          plan->prim.execute(s, {{DNNL_ARG_SRC, in}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, res},
                                 {DNNL_ARG_SCRATCHPAD, pad}});
        else
          plan->prim.execute(s, {{DNNL_ARG_DIFF_DST, in}, {DNNL_ARG_WEIGHTS, w},
                                 {DNNL_ARG_DIFF_SRC, res}, {DNNL_ARG_SCRATCHPAD, pad}});
      }
    }
    s.wait();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("oneDNN convolution: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PopartOnednnConv, Conv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("geom"));
