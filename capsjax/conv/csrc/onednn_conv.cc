// An NHWC convolution (any stride, explicit zero padding) and both its
// gradients as XLA FFI calls into oneDNN (capsjax/conv/onednn.py builds and
// loads this file).
// x: [N, H, W, C] f32, kernel: [Kh, Kw, C, F] f32 (HWIO),
// y: [N, H', W', F] with H' = (H + pad_top + pad_bottom - Kh) / stride + 1.
// Activations stay NHWC (oneDNN's brgemm kernels read it directly); only
// the kernel, Kh*Kw*C*F floats, is reordered to the layout oneDNN wants.
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// The convolution's stride and zero padding, from the FFI call's attributes
// (onednn.py passes them as int64).
struct Geometry {
  int64_t stride, pad_top, pad_bottom, pad_left, pad_right;
};
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    Geometry, ffi::StructMember<int64_t>("stride"),
    ffi::StructMember<int64_t>("pad_top"),
    ffi::StructMember<int64_t>("pad_bottom"),
    ffi::StructMember<int64_t>("pad_left"),
    ffi::StructMember<int64_t>("pad_right"));

using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

namespace {

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Every size of one convolution; the output's come from the output buffer.
struct Shapes {
  memory::dim n, h, w, c, kh, kw, f, oh, ow;
  memory::dim stride, pad_top, pad_bottom, pad_left, pad_right;

  std::array<memory::dim, 14> Key() const {
    return {n, h, w, c, kh, kw, f, oh, ow, stride, pad_top, pad_bottom,
            pad_left, pad_right};
  }
};

Shapes ShapesOf(ffi::Span<const int64_t> x, ffi::Span<const int64_t> k,
                ffi::Span<const int64_t> y, const Geometry& g) {
  return {x[0], x[1], x[2], x[3], k[0], k[1], k[3], y[1], y[2],
          g.stride, g.pad_top, g.pad_bottom, g.pad_left, g.pad_right};
}

memory::desc SrcDesc(const Shapes& s) {
  return memory::desc({s.n, s.c, s.h, s.w}, dt::f32, tag::nhwc);
}
memory::desc DstDesc(const Shapes& s) {
  return memory::desc({s.n, s.f, s.oh, s.ow}, dt::f32, tag::nhwc);
}
memory::desc UserWeightsDesc(const Shapes& s) {
  return memory::desc({s.f, s.c, s.kh, s.kw}, dt::f32, tag::hwio);
}
memory::desc AnyWeightsDesc(const Shapes& s) {
  return memory::desc({s.f, s.c, s.kh, s.kw}, dt::f32, tag::any);
}
memory::dims Strides(const Shapes& s) { return {s.stride, s.stride}; }
memory::dims PadLow(const Shapes& s) { return {s.pad_top, s.pad_left}; }
memory::dims PadHigh(const Shapes& s) { return {s.pad_bottom, s.pad_right}; }

dnnl::convolution_forward::primitive_desc ForwardDesc(const Shapes& s) {
  return dnnl::convolution_forward::primitive_desc(
      Engine(), dnnl::prop_kind::forward_training,
      dnnl::algorithm::convolution_direct, SrcDesc(s), AnyWeightsDesc(s),
      DstDesc(s), Strides(s), PadLow(s), PadHigh(s));
}

dnnl::convolution_backward_data::primitive_desc InputGradDesc(
    const Shapes& s) {
  return dnnl::convolution_backward_data::primitive_desc(
      Engine(), dnnl::algorithm::convolution_direct, SrcDesc(s),
      AnyWeightsDesc(s), DstDesc(s), Strides(s), PadLow(s), PadHigh(s),
      ForwardDesc(s));
}

dnnl::convolution_backward_weights::primitive_desc KernelGradDesc(
    const Shapes& s) {
  return dnnl::convolution_backward_weights::primitive_desc(
      Engine(), dnnl::algorithm::convolution_direct, SrcDesc(s),
      AnyWeightsDesc(s), DstDesc(s), Strides(s), PadLow(s), PadHigh(s),
      ForwardDesc(s));
}

// A primitive and the weights layout it wants, built once per shape:
// building the descriptors (and, for the gradients, the forward one they
// hint from) cost ~60 us per forward and backward, as much as a small
// layer's work (BENCHMARKS.md).
struct Prepared {
  dnnl::primitive primitive;
  memory::desc weights;
};

enum class Pass { kForward, kInputGrad, kKernelGrad };

// The pass's primitive for these shapes from the cache, made by make() the
// first time (called under Guarded's lock). std::map's entries stay where
// they are as it grows.
template <typename Make>
const Prepared& Cached(Pass pass, const Shapes& s, Make make) {
  static std::map<std::pair<Pass, std::array<memory::dim, 14>>, Prepared>
      cache;
  auto key = std::make_pair(pass, s.Key());
  auto found = cache.find(key);
  if (found == cache.end()) found = cache.emplace(key, make()).first;
  return found->second;
}

// The user's HWIO weights, reordered into the layout the primitive wants
// where it differs (tiny: Kh*Kw*C*F floats).
memory Weights(const memory::desc& wanted, const Shapes& s, float* data,
               dnnl::stream& stream) {
  memory user(UserWeightsDesc(s), Engine(), data);
  if (wanted == user.get_desc()) return user;
  memory out(wanted, Engine());
  dnnl::reorder(user, out).execute(stream, user, out);
  return out;
}

// One convolution at a time, so that the primitive cache needs no lock of
// its own: each call already runs on all cores (oneDNN's OpenMP threads),
// and where XLA starts two side by side, such as a layer's two gradients,
// the pair took as long either way (the baseline CNN's last layer, 838 ms
// overlapped against 846 ms one after the other; BENCHMARKS.md).
std::mutex& OneAtATime() {
  static std::mutex mutex;
  return mutex;
}

// Runs body() under OneAtATime, oneDNN's exceptions as FFI errors.
template <typename F>
ffi::Error Guarded(F body) {
  std::lock_guard<std::mutex> lock(OneAtATime());
  try {
    body();
    return ffi::Error::Success();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("oneDNN convolution failed: ") + e.what());
  }
}

ffi::Error Forward(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> k,
                   ffi::ResultBuffer<ffi::F32> y, Geometry g) {
  return Guarded([&] {
    Shapes s = ShapesOf(x.dimensions(), k.dimensions(), y->dimensions(), g);
    dnnl::stream stream(Engine());
    const Prepared& p = Cached(Pass::kForward, s, [&] {
      auto pd = ForwardDesc(s);
      return Prepared{dnnl::convolution_forward(pd), pd.weights_desc()};
    });
    memory src(SrcDesc(s), Engine(), x.typed_data());
    memory dst(DstDesc(s), Engine(), y->typed_data());
    memory wei = Weights(p.weights, s, k.typed_data(), stream);
    p.primitive.execute(
        stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    stream.wait();
  });
}

ffi::Error InputGrad(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> k,
                     ffi::ResultBuffer<ffi::F32> dx, Geometry g) {
  return Guarded([&] {
    Shapes s = ShapesOf(dx->dimensions(), k.dimensions(), dy.dimensions(), g);
    dnnl::stream stream(Engine());
    const Prepared& p = Cached(Pass::kInputGrad, s, [&] {
      auto pd = InputGradDesc(s);
      return Prepared{dnnl::convolution_backward_data(pd), pd.weights_desc()};
    });
    memory diff_dst(DstDesc(s), Engine(), dy.typed_data());
    memory diff_src(SrcDesc(s), Engine(), dx->typed_data());
    memory wei = Weights(p.weights, s, k.typed_data(), stream);
    p.primitive.execute(
        stream, {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, wei},
                 {DNNL_ARG_DIFF_SRC, diff_src}});
    stream.wait();
  });
}

ffi::Error KernelGrad(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                      ffi::ResultBuffer<ffi::F32> dk, Geometry g) {
  return Guarded([&] {
    Shapes s = ShapesOf(x.dimensions(), dk->dimensions(), dy.dimensions(), g);
    dnnl::stream stream(Engine());
    const Prepared& p = Cached(Pass::kKernelGrad, s, [&] {
      auto pd = KernelGradDesc(s);
      return Prepared{dnnl::convolution_backward_weights(pd),
                      pd.diff_weights_desc()};
    });
    memory src(SrcDesc(s), Engine(), x.typed_data());
    memory diff_dst(DstDesc(s), Engine(), dy.typed_data());
    memory user(UserWeightsDesc(s), Engine(), dk->typed_data());
    bool direct = p.weights == user.get_desc();
    memory diff_wei = direct ? user : memory(p.weights, Engine());
    p.primitive.execute(
        stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst},
                 {DNNL_ARG_DIFF_WEIGHTS, diff_wei}});
    if (!direct) dnnl::reorder(diff_wei, user).execute(stream, diff_wei, user);
    stream.wait();
  });
}

}  // namespace

// The oneDNN kernels picked for one convolution (sizes as in Shapes), in
// words (for logs and tests).
extern "C" const char* ImplInfo(int64_t n, int64_t h, int64_t w, int64_t c,
                                int64_t kh, int64_t kw, int64_t f, int64_t oh,
                                int64_t ow, int64_t stride, int64_t pad_top,
                                int64_t pad_bottom, int64_t pad_left,
                                int64_t pad_right) {
  static thread_local std::string info;
  try {
    Shapes s{n, h, w, c, kh, kw, f, oh, ow,
             stride, pad_top, pad_bottom, pad_left, pad_right};
    info = "forward " + std::string(ForwardDesc(s).impl_info_str()) +
           "; input grad " + InputGradDesc(s).impl_info_str() +
           "; kernel grad " + KernelGradDesc(s).impl_info_str();
  } catch (const dnnl::error& e) {
    info = std::string("oneDNN error: ") + e.what();
  }
  return info.c_str();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs<Geometry>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvInputGrad, InputGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs<Geometry>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvKernelGrad, KernelGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs<Geometry>());
