// A VALID stride-1 NHWC convolution and both its gradients as XLA FFI
// calls into oneDNN (capsjax/onednn.py builds and loads this file).
// x: [N, H, W, C] f32, kernel: [Kh, Kw, C, F] f32 (HWIO), y: [N, H', W', F].
// Activations stay NHWC (oneDNN's brgemm kernels read it directly); only
// the kernel, Kh*Kw*C*F floats, is reordered to the layout oneDNN wants.
#include <cstdint>
#include <string>

#include "oneapi/dnnl/dnnl.hpp"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using dnnl::memory;
using tag = dnnl::memory::format_tag;
using dt = dnnl::memory::data_type;

namespace {

dnnl::engine& Engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct Shapes {
  memory::dim n, h, w, c, kh, kw, f, oh, ow;
};

Shapes ShapesOf(ffi::Span<const int64_t> x, ffi::Span<const int64_t> k) {
  Shapes s{x[0], x[1], x[2], x[3], k[0], k[1], k[3], 0, 0};
  s.oh = s.h - s.kh + 1;
  s.ow = s.w - s.kw + 1;
  return s;
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

dnnl::convolution_forward::primitive_desc ForwardDesc(const Shapes& s) {
  return dnnl::convolution_forward::primitive_desc(
      Engine(), dnnl::prop_kind::forward_training,
      dnnl::algorithm::convolution_direct, SrcDesc(s), AnyWeightsDesc(s),
      DstDesc(s), {1, 1}, {0, 0}, {0, 0});
}

dnnl::convolution_backward_data::primitive_desc InputGradDesc(
    const Shapes& s) {
  return dnnl::convolution_backward_data::primitive_desc(
      Engine(), dnnl::algorithm::convolution_direct, SrcDesc(s),
      AnyWeightsDesc(s), DstDesc(s), {1, 1}, {0, 0}, {0, 0}, ForwardDesc(s));
}

dnnl::convolution_backward_weights::primitive_desc KernelGradDesc(
    const Shapes& s) {
  return dnnl::convolution_backward_weights::primitive_desc(
      Engine(), dnnl::algorithm::convolution_direct, SrcDesc(s),
      AnyWeightsDesc(s), DstDesc(s), {1, 1}, {0, 0}, {0, 0}, ForwardDesc(s));
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

template <typename F>
ffi::Error Guarded(F body) {
  try {
    body();
    return ffi::Error::Success();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("oneDNN convolution failed: ") + e.what());
  }
}

ffi::Error Forward(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> k,
                   ffi::ResultBuffer<ffi::F32> y) {
  return Guarded([&] {
    Shapes s = ShapesOf(x.dimensions(), k.dimensions());
    dnnl::stream stream(Engine());
    auto pd = ForwardDesc(s);
    memory src(SrcDesc(s), Engine(), x.typed_data());
    memory dst(DstDesc(s), Engine(), y->typed_data());
    memory wei = Weights(pd.weights_desc(), s, k.typed_data(), stream);
    dnnl::convolution_forward(pd).execute(
        stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    stream.wait();
  });
}

ffi::Error InputGrad(ffi::Buffer<ffi::F32> dy, ffi::Buffer<ffi::F32> k,
                     ffi::ResultBuffer<ffi::F32> dx) {
  return Guarded([&] {
    Shapes s = ShapesOf(dx->dimensions(), k.dimensions());
    dnnl::stream stream(Engine());
    auto pd = InputGradDesc(s);
    memory diff_dst(DstDesc(s), Engine(), dy.typed_data());
    memory diff_src(SrcDesc(s), Engine(), dx->typed_data());
    memory wei = Weights(pd.weights_desc(), s, k.typed_data(), stream);
    dnnl::convolution_backward_data(pd).execute(
        stream, {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, wei},
                 {DNNL_ARG_DIFF_SRC, diff_src}});
    stream.wait();
  });
}

ffi::Error KernelGrad(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                      ffi::ResultBuffer<ffi::F32> dk) {
  return Guarded([&] {
    Shapes s = ShapesOf(x.dimensions(), dk->dimensions());
    dnnl::stream stream(Engine());
    auto pd = KernelGradDesc(s);
    memory src(SrcDesc(s), Engine(), x.typed_data());
    memory diff_dst(DstDesc(s), Engine(), dy.typed_data());
    memory user(UserWeightsDesc(s), Engine(), dk->typed_data());
    bool direct = pd.diff_weights_desc() == user.get_desc();
    memory diff_wei = direct ? user : memory(pd.diff_weights_desc(), Engine());
    dnnl::convolution_backward_weights(pd).execute(
        stream, {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst},
                 {DNNL_ARG_DIFF_WEIGHTS, diff_wei}});
    if (!direct) dnnl::reorder(diff_wei, user).execute(stream, diff_wei, user);
    stream.wait();
  });
}

}  // namespace

// The oneDNN kernels picked for a 3x3 convolution of an [n, h, h, c] input
// to f channels, in words (for logs).
extern "C" const char* ImplInfo(int64_t n, int64_t h, int64_t c, int64_t f) {
  static thread_local std::string info;
  try {
    Shapes s{n, h, h, c, 3, 3, f, h - 2, h - 2};
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
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvInputGrad, InputGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvKernelGrad, KernelGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
