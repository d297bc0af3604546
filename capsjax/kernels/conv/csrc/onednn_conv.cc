// An NHWC convolution (any stride, explicit zero padding) and both its
// gradients as XLA FFI calls into oneDNN (capsjax/kernels/conv/onednn.py
// builds and loads this file).
// x: [N, H, W, C], kernel: [Kh, Kw, C, F] (HWIO),
// y: [N, H', W', F] with H' = (H + pad_top + pad_bottom - Kh) / stride + 1.
// float32 throughout, or bfloat16 x, kernel, y and input gradient with the
// kernel gradient accumulated and returned in float32 (mixed precision:
// onednn.py rounds it once to the kernel's bfloat16). oneDNN picks the
// kernels for the CPU's instructions itself (AMX, AVX512-BF16, ...).
// Activations stay NHWC (oneDNN's brgemm kernels read it directly); only
// the kernel, Kh*Kw*C*F floats, is reordered to the layout oneDNN wants.
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "oneapi/dnnl/dnnl.hpp"
#include "oneapi/dnnl/dnnl_debug.h"
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

// Every primitive here is made with a scratchpad that this file owns.
// oneDNN's default ("library") scratchpad is global per thread: a
// primitive reads the scratchpad of the thread that executes it, sized by
// the primitives created on that thread. These primitives are created once
// and then executed on whichever XLA thread runs the call, so a primitive
// that needs scratch space (oneDNN's gemm convolutions, picked below
// AVX-512, keep their im2col columns there) got a null or too small
// buffer: a segfault, "could not execute a primitive", or heap corruption.
dnnl::primitive_attr OwnScratchpad() {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  return attr;
}

// The scratchpad of the primitive being executed: one buffer for all of
// them (they run one at a time, OneAtATime), grown to the largest asked
// for and kept, 64-byte aligned as oneDNN's own allocations are.
memory Scratchpad(const memory::desc& wanted) {
  struct Free {
    void operator()(void* p) const { std::free(p); }
  };
  static std::unique_ptr<void, Free> buffer;
  static size_t capacity = 0;
  const size_t size = wanted.get_size();
  if (size > capacity) {
    buffer.reset();
    void* data = nullptr;
    const size_t rounded = (size + 63) / 64 * 64;
    if (posix_memalign(&data, 64, rounded) != 0) {
      capacity = 0;
      throw dnnl::error(dnnl_out_of_memory, "scratchpad allocation failed");
    }
    buffer.reset(data);
    capacity = rounded;
  }
  return memory(wanted, Engine(), size ? buffer.get() : nullptr);
}

// Every size of one convolution (the output's come from the output buffer)
// and the data type of its activations and kernel.
struct Shapes {
  memory::dim n, h, w, c, kh, kw, f, oh, ow;
  memory::dim stride, pad_top, pad_bottom, pad_left, pad_right;
  dt type;

  std::array<memory::dim, 15> Key() const {
    return {n, h, w, c, kh, kw, f, oh, ow, stride, pad_top, pad_bottom,
            pad_left, pad_right, static_cast<memory::dim>(type)};
  }
};

// f32 or bf16, the types the handlers take; anything else is refused.
bool TypeOf(ffi::DataType type, dt* out) {
  if (type == ffi::DataType::F32) {
    *out = dt::f32;
  } else if (type == ffi::DataType::BF16) {
    *out = dt::bf16;
  } else {
    return false;
  }
  return true;
}

Shapes ShapesOf(ffi::Span<const int64_t> x, ffi::Span<const int64_t> k,
                ffi::Span<const int64_t> y, const Geometry& g, dt type) {
  return {x[0], x[1], x[2], x[3], k[0], k[1], k[3], y[1], y[2],
          g.stride, g.pad_top, g.pad_bottom, g.pad_left, g.pad_right, type};
}

memory::desc SrcDesc(const Shapes& s) {
  return memory::desc({s.n, s.c, s.h, s.w}, s.type, tag::nhwc);
}
memory::desc DstDesc(const Shapes& s) {
  return memory::desc({s.n, s.f, s.oh, s.ow}, s.type, tag::nhwc);
}
// The kernel as the user holds it, in the activations' type or, for the
// kernel gradient, float32.
memory::desc UserWeightsDesc(const Shapes& s, dt type) {
  return memory::desc({s.f, s.c, s.kh, s.kw}, type, tag::hwio);
}
memory::desc UserWeightsDesc(const Shapes& s) {
  return UserWeightsDesc(s, s.type);
}
memory::desc AnyWeightsDesc(const Shapes& s, dt type) {
  return memory::desc({s.f, s.c, s.kh, s.kw}, type, tag::any);
}
memory::desc AnyWeightsDesc(const Shapes& s) {
  return AnyWeightsDesc(s, s.type);
}
memory::dims Strides(const Shapes& s) { return {s.stride, s.stride}; }
memory::dims PadLow(const Shapes& s) { return {s.pad_top, s.pad_left}; }
memory::dims PadHigh(const Shapes& s) { return {s.pad_bottom, s.pad_right}; }

dnnl::convolution_forward::primitive_desc ForwardDesc(const Shapes& s) {
  return dnnl::convolution_forward::primitive_desc(
      Engine(), dnnl::prop_kind::forward_training,
      dnnl::algorithm::convolution_direct, SrcDesc(s), AnyWeightsDesc(s),
      DstDesc(s), Strides(s), PadLow(s), PadHigh(s), OwnScratchpad());
}

dnnl::convolution_backward_data::primitive_desc InputGradDesc(
    const Shapes& s) {
  return dnnl::convolution_backward_data::primitive_desc(
      Engine(), dnnl::algorithm::convolution_direct, SrcDesc(s),
      AnyWeightsDesc(s), DstDesc(s), Strides(s), PadLow(s), PadHigh(s),
      ForwardDesc(s), OwnScratchpad());
}

dnnl::convolution_backward_weights::primitive_desc KernelGradDesc(
    const Shapes& s) {
  // The kernel gradient is a sum over the batch and positions: float32
  // whatever the activations' type.
  return dnnl::convolution_backward_weights::primitive_desc(
      Engine(), dnnl::algorithm::convolution_direct, SrcDesc(s),
      AnyWeightsDesc(s, dt::f32), DstDesc(s), Strides(s), PadLow(s), PadHigh(s),
      ForwardDesc(s), OwnScratchpad());
}

// A primitive and the weights layout it wants, built once per shape:
// building the descriptors (and, for the gradients, the forward one they
// hint from) cost ~60 us per forward and backward, as much as a small
// layer's work (BENCHMARKS.md).
struct Prepared {
  dnnl::primitive primitive;
  memory::desc weights;
  memory::desc scratchpad;
};

// Runs a primitive on its arguments and this file's scratchpad (the
// caller holds OneAtATime).
void Execute(const dnnl::primitive& primitive,
             const memory::desc& scratchpad, dnnl::stream& stream,
             std::unordered_map<int, memory> args) {
  args.emplace(DNNL_ARG_SCRATCHPAD, Scratchpad(scratchpad));
  primitive.execute(stream, args);
}

// from's values written into to's layout.
void Reorder(memory& from, memory& to, dnnl::stream& stream) {
  dnnl::reorder::primitive_desc pd(from, to, OwnScratchpad());
  Execute(dnnl::reorder(pd), pd.scratchpad_desc(), stream,
          {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}});
}

enum class Pass { kForward, kInputGrad, kKernelGrad };

// The pass's primitive for these shapes from the cache, made by make() the
// first time (called under Guarded's lock). std::map's entries stay where
// they are as it grows.
template <typename Make>
const Prepared& Cached(Pass pass, const Shapes& s, Make make) {
  static std::map<std::pair<Pass, std::array<memory::dim, 15>>, Prepared>
      cache;
  auto key = std::make_pair(pass, s.Key());
  auto found = cache.find(key);
  if (found == cache.end()) found = cache.emplace(key, make()).first;
  return found->second;
}

// The user's HWIO weights, reordered into the layout the primitive wants
// where it differs (tiny: Kh*Kw*C*F values).
memory Weights(const memory::desc& wanted, const Shapes& s, void* data,
               dnnl::stream& stream) {
  memory user(UserWeightsDesc(s), Engine(), data);
  if (wanted == user.get_desc()) return user;
  memory out(wanted, Engine());
  Reorder(user, out, stream);
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

// Runs body() under OneAtATime, oneDNN's exceptions as FFI errors; the
// operands' types first: all f32 or all bf16 (the float32 kernel gradient
// is checked by its handler).
template <typename F>
ffi::Error Guarded(ffi::DataType a, ffi::DataType b, ffi::DataType c,
                   F body) {
  dt type;
  if (!TypeOf(a, &type) || b != a || c != a) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "oneDNN convolution: operands must be all float32 or "
                      "all bfloat16");
  }
  std::lock_guard<std::mutex> lock(OneAtATime());
  try {
    body(type);
    return ffi::Error::Success();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("oneDNN convolution failed: ") + e.what());
  }
}

ffi::Error Forward(ffi::AnyBuffer x, ffi::AnyBuffer k,
                   ffi::Result<ffi::AnyBuffer> y, Geometry g) {
  return Guarded(x.element_type(), k.element_type(), y->element_type(),
                 [&](dt type) {
    Shapes s =
        ShapesOf(x.dimensions(), k.dimensions(), y->dimensions(), g, type);
    dnnl::stream stream(Engine());
    const Prepared& p = Cached(Pass::kForward, s, [&] {
      auto pd = ForwardDesc(s);
      return Prepared{dnnl::convolution_forward(pd), pd.weights_desc(),
                      pd.scratchpad_desc()};
    });
    memory src(SrcDesc(s), Engine(), x.untyped_data());
    memory dst(DstDesc(s), Engine(), y->untyped_data());
    memory wei = Weights(p.weights, s, k.untyped_data(), stream);
    Execute(p.primitive, p.scratchpad, stream,
            {{DNNL_ARG_SRC, src}, {DNNL_ARG_WEIGHTS, wei}, {DNNL_ARG_DST, dst}});
    stream.wait();
  });
}

ffi::Error InputGrad(ffi::AnyBuffer dy, ffi::AnyBuffer k,
                     ffi::Result<ffi::AnyBuffer> dx, Geometry g) {
  return Guarded(dy.element_type(), k.element_type(), dx->element_type(),
                 [&](dt type) {
    Shapes s =
        ShapesOf(dx->dimensions(), k.dimensions(), dy.dimensions(), g, type);
    dnnl::stream stream(Engine());
    const Prepared& p = Cached(Pass::kInputGrad, s, [&] {
      auto pd = InputGradDesc(s);
      return Prepared{dnnl::convolution_backward_data(pd), pd.weights_desc(),
                      pd.scratchpad_desc()};
    });
    memory diff_dst(DstDesc(s), Engine(), dy.untyped_data());
    memory diff_src(SrcDesc(s), Engine(), dx->untyped_data());
    memory wei = Weights(p.weights, s, k.untyped_data(), stream);
    Execute(p.primitive, p.scratchpad, stream,
            {{DNNL_ARG_DIFF_DST, diff_dst}, {DNNL_ARG_WEIGHTS, wei},
             {DNNL_ARG_DIFF_SRC, diff_src}});
    stream.wait();
  });
}

ffi::Error KernelGrad(ffi::AnyBuffer x, ffi::AnyBuffer dy,
                      ffi::ResultBuffer<ffi::F32> dk, Geometry g) {
  return Guarded(x.element_type(), dy.element_type(), x.element_type(),
                 [&](dt type) {
    Shapes s =
        ShapesOf(x.dimensions(), dk->dimensions(), dy.dimensions(), g, type);
    dnnl::stream stream(Engine());
    const Prepared& p = Cached(Pass::kKernelGrad, s, [&] {
      auto pd = KernelGradDesc(s);
      return Prepared{dnnl::convolution_backward_weights(pd),
                      pd.diff_weights_desc(), pd.scratchpad_desc()};
    });
    memory src(SrcDesc(s), Engine(), x.untyped_data());
    memory diff_dst(DstDesc(s), Engine(), dy.untyped_data());
    memory user(UserWeightsDesc(s, dt::f32), Engine(), dk->typed_data());
    bool direct = p.weights == user.get_desc();
    memory diff_wei = direct ? user : memory(p.weights, Engine());
    Execute(p.primitive, p.scratchpad, stream,
            {{DNNL_ARG_SRC, src}, {DNNL_ARG_DIFF_DST, diff_dst},
             {DNNL_ARG_DIFF_WEIGHTS, diff_wei}});
    if (!direct) Reorder(diff_wei, user, stream);
    stream.wait();
  });
}

// y [M, N] = op(a) @ op(b) for row-major a ([M, K], or [K, M] transposed)
// and b ([K, N], or [N, K] transposed), both of type in_type, y of
// out_type; a transposed operand is read through its layout tag (no copy).
// The caller holds OneAtATime.
void RunMatmul(const void* a, const void* b, void* y, memory::dim m,
               memory::dim k, memory::dim n, bool transpose_a,
               bool transpose_b, dt in_type, dt out_type) {
  memory::desc a_desc({m, k}, in_type, transpose_a ? tag::ba : tag::ab);
  memory::desc b_desc({k, n}, in_type, transpose_b ? tag::ba : tag::ab);
  memory::desc y_desc({m, n}, out_type, tag::ab);
  static std::map<std::array<memory::dim, 7>, Prepared> cache;
  std::array<memory::dim, 7> key{m, k, n, transpose_a, transpose_b,
                                 static_cast<memory::dim>(in_type),
                                 static_cast<memory::dim>(out_type)};
  auto found = cache.find(key);
  if (found == cache.end()) {
    dnnl::matmul::primitive_desc pd(Engine(), a_desc, b_desc, y_desc,
                                    OwnScratchpad());
    found = cache.emplace(key, Prepared{dnnl::matmul(pd), b_desc,
                                        pd.scratchpad_desc()})
                .first;
  }
  dnnl::stream stream(Engine());
  memory a_mem(a_desc, Engine(), const_cast<void*>(a));
  memory b_mem(b_desc, Engine(), const_cast<void*>(b));
  memory y_mem(y_desc, Engine(), y);
  Execute(found->second.primitive, found->second.scratchpad, stream,
          {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem},
           {DNNL_ARG_DST, y_mem}});
  stream.wait();
}

// A product y [M, N] = op(a) @ op(b) (RunMatmul) as an FFI call: a and b
// f32 or both bf16, y f32 or the operands' type.
ffi::Error Matmul(ffi::AnyBuffer a, ffi::AnyBuffer b,
                  ffi::Result<ffi::AnyBuffer> y, int64_t transpose_a,
                  int64_t transpose_b) {
  dt in_type, out_type;
  if (!TypeOf(a.element_type(), &in_type) ||
      b.element_type() != a.element_type() ||
      !TypeOf(y->element_type(), &out_type) ||
      (out_type != dt::f32 && out_type != in_type) ||
      a.dimensions().size() != 2 || b.dimensions().size() != 2) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "oneDNN matmul: 2-D operands both float32 or both "
                      "bfloat16, the result float32 or theirs");
  }
  memory::dim k = transpose_a ? a.dimensions()[0] : a.dimensions()[1];
  std::lock_guard<std::mutex> lock(OneAtATime());
  try {
    RunMatmul(a.untyped_data(), b.untyped_data(), y->untyped_data(),
              y->dimensions()[0], k, y->dimensions()[1], transpose_a,
              transpose_b, in_type, out_type);
    return ffi::Error::Success();
  } catch (const dnnl::error& e) {
    return ffi::Error(ffi::ErrorCode::kInternal,
                      std::string("oneDNN matmul failed: ") + e.what());
  }
}

// The windows of x [N, H, W, C] (zero-padded) as patches [N*H'*W', Kh*Kw*C]
// in the (row, column, channel) order of an HWIO kernel flattened: one
// contiguous copy of C values per window and tap. XLA:CPU's concatenation
// of the Kh*Kw strided slices took longer than the product itself.
template <typename T>
void Im2col(const T* x, const Shapes& s, std::vector<T>* patches) {
  const memory::dim taps = s.kh * s.kw * s.c;
  const size_t size = static_cast<size_t>(s.n * s.oh * s.ow * taps);
  // Without padding every entry is written below; with it, the windows'
  // entries over the padding stay zero.
  if (s.pad_top || s.pad_bottom || s.pad_left || s.pad_right) {
    patches->assign(size, T(0));
  } else {
    patches->resize(size);
  }
  for (memory::dim b = 0; b < s.n; ++b) {
    for (memory::dim i = 0; i < s.oh; ++i) {
      for (memory::dim j = 0; j < s.ow; ++j) {
        T* row = patches->data() + ((b * s.oh + i) * s.ow + j) * taps;
        for (memory::dim u = 0; u < s.kh; ++u) {
          memory::dim h = i * s.stride + u - s.pad_top;
          if (h < 0 || h >= s.h) continue;
          for (memory::dim v = 0; v < s.kw; ++v) {
            memory::dim w = j * s.stride + v - s.pad_left;
            if (w < 0 || w >= s.w) continue;
            std::memcpy(row + (u * s.kw + v) * s.c,
                        x + ((b * s.h + h) * s.w + w) * s.c,
                        s.c * sizeof(T));
          }
        }
      }
    }
  }
}

// The kernel gradient as one product, patches^T @ dy, summed in float32:
// for bf16 strided convolutions, where oneDNN's own kernel-gradient
// kernels are slow (onednn.py).
ffi::Error KernelGradByProduct(ffi::AnyBuffer x, ffi::AnyBuffer dy,
                               ffi::ResultBuffer<ffi::F32> dk, Geometry g) {
  return Guarded(x.element_type(), dy.element_type(), x.element_type(),
                 [&](dt type) {
    Shapes s =
        ShapesOf(x.dimensions(), dk->dimensions(), dy.dimensions(), g, type);
    // Kept between calls: the patches of the paper's PrimaryCaps at batch
    // 64 are 95 MB, whose pages would be faulted in afresh every step.
    static std::vector<uint16_t> half;
    static std::vector<float> full;
    const void* patches;
    if (type == dt::bf16) {
      Im2col(static_cast<const uint16_t*>(x.untyped_data()), s, &half);
      patches = half.data();
    } else {
      Im2col(static_cast<const float*>(x.untyped_data()), s, &full);
      patches = full.data();
    }
    RunMatmul(patches, dy.untyped_data(), dk->untyped_data(),
              s.kh * s.kw * s.c, s.n * s.oh * s.ow, s.f,
              /*transpose_a=*/true, /*transpose_b=*/false, type, dt::f32);
  });
}

}  // namespace

// The oneDNN kernels picked for one convolution (sizes as in Shapes;
// bf16 != 0 for bfloat16 activations and kernel), in words (for logs and
// tests).
extern "C" const char* ImplInfo(int64_t n, int64_t h, int64_t w, int64_t c,
                                int64_t kh, int64_t kw, int64_t f, int64_t oh,
                                int64_t ow, int64_t stride, int64_t pad_top,
                                int64_t pad_bottom, int64_t pad_left,
                                int64_t pad_right, int64_t bf16) {
  static thread_local std::string info;
  try {
    Shapes s{n, h, w, c, kh, kw, f, oh, ow,
             stride, pad_top, pad_bottom, pad_left, pad_right,
             bf16 ? dt::bf16 : dt::f32};
    info = "forward " + std::string(ForwardDesc(s).impl_info_str()) +
           "; input grad " + InputGradDesc(s).impl_info_str() +
           "; kernel grad " + KernelGradDesc(s).impl_info_str();
  } catch (const dnnl::error& e) {
    info = std::string("oneDNN error: ") + e.what();
  }
  return info.c_str();
}

// The instruction set oneDNN's kernels use on this CPU (its name, such as
// "avx512_core_bf16"), and whether it has bfloat16 dot products (AVX512-BF16,
// AMX or AVX2-VNNI-2): without them oneDNN's bfloat16 kernels convert to
// float32 and run slower than its float32 ones.
extern "C" const char* CpuIsa() {
  return dnnl_cpu_isa2str(dnnl_get_effective_cpu_isa());
}
extern "C" int NativeBf16() {
  auto has = [](dnnl_cpu_isa_t isa) {
    return (dnnl_get_effective_cpu_isa() & isa) == isa;
  };
  return has(dnnl_cpu_isa_avx512_core_bf16) || has(dnnl_cpu_isa_avx2_vnni_2);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvForward, Forward,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<Geometry>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvInputGrad, InputGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attrs<Geometry>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvKernelGrad, KernelGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs<Geometry>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("transpose_a")
                                  .Attr<int64_t>("transpose_b"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(OnednnConvKernelGradByProduct,
                              KernelGradByProduct,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs<Geometry>());
