// popart-xla: 2D f32 convolutions through oneDNN, as one XLA FFI handler (CPU).
//
// One handler, three directions (attribute geom[0]): 0 forward y = conv(x, w); 1 backward data
// dx from (dy, w); 2 backward weights dw from (x, dy). Activations (x, y, dx, dy) are NHWC when
// geom[1] is 1, NCHW when 0; weights are always ONNX's OIHW, O x C/G x KH x KW for G groups
// (the same bytes as oneDNN's goihw). geom[2..9]: stride h, w; pad top, left, bottom, right;
// dilation h, w (1 = none); geom[10]: groups G (depthwise: G = C).
// The forward may carry post-ops after geom[10], three values each: a code (Post below) and
// the float32 bits of its alpha and beta. The bias (code kBias, first) and the second input
// of each binary post-op follow x and w as operands, in order: the bias [O], a binary input
// in the activations' layout with each of its 4 dims the result's or 1 (broadcast). A residual
// add of the result's own shape is oneDNN's sum post-op (code kSum): its operand is copied into
// the result (nothing to copy when XLA aliased the two) and the convolution accumulates into
// it, where the binary add reads it as a second tensor (1.5 ms more per call on ResNet-50's
// 56 x 56 1x1 expansion at batch 4, docs/performance.md).
// Operands may carry extra leading (vmap) dims: each has either the result's leading dims or
// all of them 1 (shared). Primitives are made once per shape and post-op chain and cached;
// weights are reordered to the primitive's blocked format on each call, except for kind 3: a
// forward whose weights come packed by PopartOnednnConvPack (hoisted out of an inference step:
// reordered once per weights version). A packed buffer is a 64-byte header (kPackMagic, the
// layout's index in this process's registry, O, KH, KW) and the weights in that layout.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "dnnl.hpp"
#include "xla/ffi/api/ffi.h"
#include "common.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = memory::format_tag;
using alg = dnnl::algorithm;

namespace {

using popart_onednn::cpu;
using popart_onednn::run_mutex;
using popart_onednn::Scratch;

// Post-op codes (onednn/__init__.py POST_OPS): the bias, binary add / multiply / max / min
// with an operand,
// and oneDNN's eltwise algorithms (alpha, beta as oneDNN defines them).
enum Post : int64_t { kBias = 1, kAdd = 2, kMul = 3, kMax = 4, kMin = 5, kSum = 6, kEltwise = 10 };
const alg kBinaryAlgs[] = {alg::binary_add, alg::binary_mul, alg::binary_max, alg::binary_min};
bool binary(int64_t code) { return code >= kAdd && code <= kMin; }
bool operand(int64_t code) { return binary(code) || code == kSum; }   // 4-D operand post-ops
const alg kEltwiseAlgs[] = {
    alg::eltwise_relu,      alg::eltwise_clip,     alg::eltwise_hardswish, alg::eltwise_hardsigmoid,
    alg::eltwise_logistic,  alg::eltwise_swish,    alg::eltwise_gelu_erf,  alg::eltwise_gelu_tanh,
    alg::eltwise_tanh,      alg::eltwise_elu,      alg::eltwise_linear};
constexpr int64_t kNumEltwise = sizeof(kEltwiseAlgs) / sizeof(kEltwiseAlgs[0]);

float bits(int64_t v) {  // a float32 from the int32 bits geom carries
  int32_t i = static_cast<int32_t>(v);
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
}

struct Plan {  // one cached primitive and what running it needs
  dnnl::primitive prim;
  memory::desc act_in, act_out, w_prim, w_user, bias;
  std::vector<memory::desc> binary;  // the binary post-ops' second inputs, in order
  std::vector<int> binary_post;      // their post-op indices
  bool reorder = false;
  dnnl::reorder w_reorder;  // user -> primitive (kinds 0, 1) or primitive -> user (kind 2)
  size_t scratch = 0;
};

using Key = std::vector<int64_t>;
constexpr int64_t kPackMagic = 0x706f7061636b;   // the packed buffer's header
constexpr size_t kHeader = 16;                     // floats (64 bytes)
std::mutex layouts_mu;
std::vector<memory::desc> layouts;   // the packed layouts: a header holds an index

int64_t layout_id(const memory::desc& d) {
  std::lock_guard<std::mutex> lock(layouts_mu);
  for (size_t i = 0; i < layouts.size(); ++i)
    if (layouts[i] == d) return (int64_t)i;
  layouts.push_back(d);
  return (int64_t)layouts.size() - 1;
}

memory::desc layout(int64_t id) {
  std::lock_guard<std::mutex> lock(layouts_mu);
  return layouts.at(id);
}

std::atomic<int64_t> conv_packs{0};   // how many packs ran (tests count them)
std::mutex plans_mu;
std::map<Key, std::shared_ptr<Plan>> plans;

// k: kind, nhwc, N, C, H, W, O, KH, KW, OH, OW, sh, sw, pt, pl, pb, pr, dh, dw, G, the number
// of post-ops, the post-ops (code, alpha, beta each), then each binary input's N, C, H, W.
constexpr size_t kBase = 20;

std::shared_ptr<Plan> make_plan(const Key& k) {
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
  auto plan = std::make_shared<Plan>();
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  dnnl::post_ops ops;
  const size_t posts_end = kBase + 1 + 3 * k[kBase];
  size_t dims = posts_end;  // the next binary input's dims
  for (size_t p = kBase + 1; p < posts_end; p += 3) {
    const int64_t code = k[p];
    if (code == kBias) {
      plan->bias = memory::desc({k[6]}, f32, tag::a);
    } else if (binary(code)) {
      memory::desc b({k[dims], k[dims + 1], k[dims + 2], k[dims + 3]}, f32, act);
      dims += 4;
      plan->binary_post.push_back(ops.len());
      plan->binary.push_back(b);
      ops.append_binary(kBinaryAlgs[code - kAdd], b);
    } else if (code == kSum) {
      dims += 4;   // the result's own dims
      ops.append_sum(1.f);
    } else {
      ops.append_eltwise(kEltwiseAlgs[code - kEltwise], bits(k[p + 1]), bits(k[p + 2]));
    }
  }
  if (ops.len() > 0) attr.set_post_ops(ops);
  plan->w_user = memory::desc(wdims, f32, g == 1 ? tag::oihw : tag::goihw);
  const auto algo = alg::convolution_direct;
  memory::desc scratch;
  if (kind == 0) {
    auto fwd = plan->bias.is_zero()
        ? dnnl::convolution_forward::primitive_desc(cpu(), dnnl::prop_kind::forward_inference,
                                                    algo, src, w_any, dst, strides, dil, pl, pr,
                                                    attr)
        : dnnl::convolution_forward::primitive_desc(cpu(), dnnl::prop_kind::forward_inference,
                                                    algo, src, w_any, plan->bias, dst, strides,
                                                    dil, pl, pr, attr);
    plan->prim = dnnl::convolution_forward(fwd);
    plan->act_in = src, plan->act_out = dst, plan->w_prim = fwd.weights_desc();
    scratch = fwd.scratchpad_desc();
  } else {
    auto fwd = dnnl::convolution_forward::primitive_desc(
        cpu(), dnnl::prop_kind::forward_training, algo, src, w_any, dst, strides, dil, pl, pr, attr);
    if (kind == 1) {
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

// The reorder from packed layout ``id`` to ``plan``'s weights layout, made once.
dnnl::reorder repack(int64_t id, const std::shared_ptr<Plan>& plan) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, const Plan*>, dnnl::reorder> made;
  const memory::desc from = layout(id);
  std::lock_guard<std::mutex> lock(mu);
  auto& r = made[{id, plan.get()}];
  if (!r) r = dnnl::reorder(dnnl::reorder::primitive_desc(cpu(), from, cpu(), plan->w_prim));
  return r;
}

int64_t lead(ffi::Span<const int64_t> d, size_t inner = 4) {  // product of the outer dims
  int64_t b = 1;
  for (size_t i = 0; i + inner < d.size(); ++i) b *= d[i];
  return b;
}

struct Extra {  // a post-op operand: its code, data, dims and outer (vmap) size
  int64_t code;
  float* data;
  ffi::Span<const int64_t> dims;
  int64_t lead;
};

ffi::Error Conv(ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b, ffi::RemainingArgs rest,
                ffi::ResultBuffer<ffi::F32> out, ffi::Span<const int64_t> geom) {
  if (geom.size() < 11 || (geom.size() - 11) % 3 != 0)
    return ffi::Error::InvalidArgument("geom needs 11 values and 3 per post-op");
  const bool packed = geom[0] == 3;   // a forward on weights PopartOnednnConvPack packed
  const int64_t kind = packed ? 0 : geom[0], nhwc = geom[1], G = geom[10];
  // The operands' roles: activations x / dy, weights w (OIHW), by direction.
  auto da = a.dimensions(), db = b.dimensions(), dr = out->dimensions();
  if (da.size() < 4 || db.size() < (packed ? 1 : 4) || dr.size() < 4)
    return ffi::Error::InvalidArgument("operands need 4 dims at least");
  const int64_t* header = reinterpret_cast<const int64_t*>(b.typed_data());
  if (packed && (lead(db, 1) != 1 || header[0] != kPackMagic))
    return ffi::Error::InvalidArgument("the packed weights are not one PopartOnednnConvPack result");
  const int64_t batches = lead(dr);
  // The post-ops' operands: the bias (1 inner dim) and binary inputs (4), in order.
  std::vector<Extra> extras;
  if (kind != 0 && geom.size() > 11)
    return ffi::Error::InvalidArgument("post-ops are for the forward only");
  for (size_t i = 11, j = 0; i < geom.size(); i += 3) {
    const int64_t code = geom[i];
    if (code >= kEltwise && code < kEltwise + kNumEltwise) continue;
    if (code != kBias && !operand(code))
      return ffi::Error::InvalidArgument("unknown post-op code " + std::to_string(code));
    if (code == kBias && i != 11) return ffi::Error::InvalidArgument("the bias comes first");
    auto e = rest.get<ffi::Buffer<ffi::F32>>(j++);
    if (!e.has_value()) return ffi::Error::InvalidArgument("a post-op operand is missing");
    auto d = e->dimensions();
    const size_t inner = geom[i] == kBias ? 1 : 4;
    if (d.size() < inner) return ffi::Error::InvalidArgument("a post-op operand has too few dims");
    extras.push_back({code, e->typed_data(), d, lead(d, inner)});
  }
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
  if (packed) sp(da, N, C, H, W), O = header[2], KH = header[3], KW = header[4], sp(dr, t, t, OH, OW);
  else if (kind == 0) sp(da, N, C, H, W), weights(db), sp(dr, t, t, OH, OW);
  else if (kind == 1) sp(da, N, t, OH, OW), weights(db), sp(dr, t, t, H, W);
  else sp(da, N, C, H, W), sp(db, t, O, OH, OW), weights(dr);
  if (N * C * H * W * O * KH * KW * OH * OW == 0) {  // an empty operand: sums over nothing
    std::memset(out->typed_data(), 0, out->size_bytes());
    return ffi::Error::Success();
  }
  // Folding shared weights' vmap dims into the batch: one call over B*N images, where every
  // post-op operand folds too (a bias shared; a binary input per image or the same for all).
  bool fold = kind != 2 && lead(db, packed ? 1 : 4) == 1 && lead(da) == batches;
  std::vector<int64_t> bin_dims;  // each binary input's N, C, H, W
  for (size_t i = 11, j = 0; i < geom.size(); i += 3) {
    if (geom[i] == kBias) {
      fold = fold && extras[j++].lead == 1;
    } else if (operand(geom[i])) {
      const Extra& e = extras[j++];
      int64_t n, c, h, w;
      sp(e.dims, n, c, h, w);
      if (geom[i] == kSum && ((e.lead != batches && e.lead != 1) || n != N || c != O ||
                              h != OH || w != OW))
        return ffi::Error::InvalidArgument("a sum post-op's operand has the result's shape");
      fold = fold && ((e.lead == batches && n == N) || (e.lead == 1 && n == 1 && geom[i] != kSum));
      bin_dims.insert(bin_dims.end(), {n, c, h, w});
    }
  }
  int64_t loops = batches;
  if (fold) {
    for (size_t i = 0; i < bin_dims.size(); i += 4)
      if (bin_dims[i] == N) bin_dims[i] *= batches;
    N *= batches, loops = 1;
  }
  Key key{kind, nhwc, N, C, H, W, O, KH, KW, OH, OW};
  key.insert(key.end(), geom.begin() + 2, geom.begin() + 11);
  key.push_back((geom.size() - 11) / 3);
  key.insert(key.end(), geom.begin() + 11, geom.end());
  key.insert(key.end(), bin_dims.begin(), bin_dims.end());
  try {
    auto plan = get_plan(key);
    // One convolution at a time: each uses every OpenMP thread, and XLA may run independent
    // ones (a step's two gradients) concurrently on its own threads.
    std::lock_guard<std::mutex> running(run_mutex());
    dnnl::stream s(cpu());
    thread_local Scratch scratch, wbuf;
    memory pad(memory::desc({(int64_t)plan->scratch}, memory::data_type::u8, tag::a), cpu(),
               scratch.get(plan->scratch + 1));
    const size_t sa = plan->act_in.get_size() / 4, sw = plan->w_user.get_size() / 4;
    const size_t so = (kind == 2 ? sw : plan->act_out.get_size() / 4);
    const size_t sb = kind == 2 ? plan->act_out.get_size() / 4 : sw;
    const size_t step_a = lead(da) == 1 || loops == 1 ? 0 : sa;
    const size_t step_b = packed || lead(db) == 1 || loops == 1 ? 0 : sb;
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
        continue;
      }
      memory in(plan->act_in, cpu(), pa), res(plan->act_out, cpu(), po);
      memory w;
      if (packed) {  // in the primitive's layout already, or (another plan's) reordered
        const memory::desc have = layout(header[1]);
        w = memory(have, cpu(), pb + kHeader);
        if (have != plan->w_prim) {  // packed for another plan: reordered (primitive cached)
          memory to(plan->w_prim, cpu(), wbuf.get(plan->w_prim.get_size()));
          if (i == 0) repack(header[1], plan).execute(s, w, to);
          w = to;
        }
      } else {
        memory w_user(plan->w_user, cpu(), pb);
        w = plan->reorder ? memory(plan->w_prim, cpu(), wp) : w_user;
        if (plan->reorder && (i == 0 || step_b)) plan->w_reorder.execute(s, w_user, w);
      }
      if (kind == 1) {
        plan->prim.execute(s, {{DNNL_ARG_DIFF_DST, in}, {DNNL_ARG_WEIGHTS, w},
                               {DNNL_ARG_DIFF_SRC, res}, {DNNL_ARG_SCRATCHPAD, pad}});
        continue;
      }
      std::unordered_map<int, memory> args{{DNNL_ARG_SRC, in}, {DNNL_ARG_WEIGHTS, w},
                                           {DNNL_ARG_DST, res}, {DNNL_ARG_SCRATCHPAD, pad}};
      for (size_t j = 0, d = 0; j < extras.size(); ++j) {
        const Extra& e = extras[j];
        if (e.code == kSum) {   // accumulated into the result: the operand copied there first
          const float* p = e.data + (e.lead == 1 || loops == 1 ? 0 : i * so);
          if (p != po) std::memcpy(po, p, so * 4);
          continue;
        }
        const memory::desc& desc = e.code == kBias ? plan->bias : plan->binary[d];
        float* p = e.data + (e.lead == 1 || loops == 1 ? 0 : i * (desc.get_size() / 4));
        const int arg = e.code == kBias ? DNNL_ARG_BIAS
            : DNNL_ARG_ATTR_MULTIPLE_POST_OP(plan->binary_post[d++]) | DNNL_ARG_SRC_1;
        args.emplace(arg, memory(desc, cpu(), p));
      }
      plan->prim.execute(s, args);
    }
    s.wait();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("oneDNN convolution: ") + e.what());
  }
  return ffi::Error::Success();
}

// The forward's weights (OIHW) in the layout of the forward plan of ``key`` (Conv's key, no
// post-ops), after the header.
ffi::Error ConvPack(ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> out,
                    ffi::Span<const int64_t> key) {
  try {
    auto plan = get_plan(Key(key.begin(), key.end()));
    if (plan->w_prim.get_size() + kHeader * 4 > out->size_bytes())
      return ffi::Error::InvalidArgument("the packed buffer is too small");
    int64_t* header = reinterpret_cast<int64_t*>(out->typed_data());
    std::memset(header, 0, kHeader * 4);
    header[0] = kPackMagic, header[1] = layout_id(plan->w_prim);
    header[2] = key[6], header[3] = key[7], header[4] = key[8];
    memory src(plan->w_user, cpu(), w.typed_data());
    memory dst(plan->w_prim, cpu(), out->typed_data() + kHeader);
    std::lock_guard<std::mutex> running(run_mutex());
    dnnl::stream s(cpu());
    if (plan->reorder) plan->w_reorder.execute(s, src, dst);
    else std::memcpy(dst.get_data_handle(), src.get_data_handle(), plan->w_user.get_size());
    s.wait();
    conv_packs++;
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("oneDNN convolution pack: ") + e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" int64_t popart_onednn_conv_packed_bytes(const int64_t* key, int64_t n) {
  try {
    return (int64_t)(get_plan(Key(key, key + n))->w_prim.get_size() + kHeader * 4);
  } catch (...) {
    return -1;
  }
}

extern "C" int64_t popart_onednn_conv_packs() { return conv_packs.load(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(PopartOnednnConvPack, ConvPack,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("key"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PopartOnednnConv, Conv,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<ffi::Span<const int64_t>>("geom"));
