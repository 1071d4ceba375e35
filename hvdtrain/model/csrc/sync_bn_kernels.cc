// CPU kernels for hvdtrain.SyncBatchNormalization: the per-element work of synchronized batch
// normalization in single passes, with float64 per-channel accumulation.
//
// The pure-TensorFlow path of the layer spends ~25 memory passes per layer and step; these four
// ops need 7 (as many as TensorFlow's fused batch norm), which is what keeps synchronized batch
// norm close to local batch norm on the CPU. The math is identical to the TensorFlow path (see
// hvdtrain/sync_bn.py); the tests check both against a float64 oracle.
//
// Every op sees its input as [rows, C] (channels-last, C = last dimension) and parallelises over
// blocks of rows with TensorFlow's intra-op thread pool. Reductions accumulate per block in
// float64 and combine the blocks in a fixed order, so results do not depend on thread timing.
//
// The row loops are compiled for AVX-512, AVX2 and baseline x86-64 (GCC's function
// multiversioning), and the loader picks the widest the CPU has, so one library serves hosts with
// different CPUs. The loops vectorize across channels and every clone does the same arithmetic in
// the same order (no FMA: -ffp-contract=off), so results are bit-identical on every CPU. The wide
// clones matter for the float64 accumulation and the fused ReLU's mask, which make these loops
// compute-bound on baseline x86-64: on an AVX-512 Xeon the backward sums took 1.5 ms instead of 2.7
// (128x28x28x32, one thread), against 1.2 ms to read and write the tensor once.
//
// With the attribute relu=true the ops fuse a ReLU after the normalization (as TensorFlow fuses
// FusedBatchNorm + Relu): the forward op writes max(z, 0) for z = (x - mean_hi) * scale + offset,
// and the backward ops recompute z from x to mask dy where z <= 0, so the ReLU costs no memory pass
// of its own either way. The library is built with -ffp-contract=off, so the recomputed z is
// bit-identical to the forward one.
#include <algorithm>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/platform/threadpool.h"

namespace hvdtrain {
namespace {

using tensorflow::DEVICE_CPU;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Status;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;
using tensorflow::shape_inference::InferenceContext;
using tensorflow::shape_inference::ShapeHandle;

constexpr int64_t kRowsPerBlock = 256;

// The row loops' clones (see the top): GCC on x86-64 glibc (clang does not clone templates, and
// the loader's choice needs glibc's ifunc). -DHVDTRAIN_CPU_CLONES= builds baseline code alone, and
// -DHVDTRAIN_CPU_CLONES='__attribute__((target("avx2")))' one width alone: tests/test_sync_bn.py
// compares them bit for bit.
#ifndef HVDTRAIN_CPU_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define HVDTRAIN_CPU_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#endif
#ifndef HVDTRAIN_CPU_CLONES
#define HVDTRAIN_CPU_CLONES
#endif

struct View {
  int64_t rows = 0;
  int64_t channels = 0;
};

// [rows, C] view of `t`, checking that every per-channel input has C entries.
bool MakeView(OpKernelContext* ctx, const Tensor& t, std::initializer_list<const Tensor*> per_channel,
              View* view) {
  if (t.dims() < 1) {
    ctx->SetStatus(InvalidArgument("input must have rank >= 1"));
    return false;
  }
  view->channels = t.dim_size(t.dims() - 1);
  view->rows = view->channels == 0 ? 0 : t.NumElements() / view->channels;
  for (const Tensor* p : per_channel) {
    if (p->NumElements() != view->channels) {
      ctx->SetStatus(InvalidArgument("per-channel input has ", p->NumElements(), " entries, expected ",
                                     view->channels));
      return false;
    }
  }
  return ctx->status().ok();
}

// Runs fn(first_row, end_row, block) over blocks of rows on the intra-op pool.
template <typename Fn>
void ForBlocks(OpKernelContext* ctx, const View& v, int64_t cost_per_row, Fn fn) {
  const int64_t blocks = (v.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
  pool->ParallelFor(blocks, cost_per_row * kRowsPerBlock, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      fn(b * kRowsPerBlock, std::min(v.rows, (b + 1) * kRowsPerBlock), b);
    }
  });
}

// Sums two per-channel float64 quantities over blocks of rows: out_a[c] = Σ a(row, c), same for b.
template <typename Fn>
void BlockedSums(OpKernelContext* ctx, const View& v, int64_t cost_per_row, double* out_a, double* out_b,
                 Fn accumulate) {
  const int64_t C = v.channels;
  const int64_t blocks = (v.rows + kRowsPerBlock - 1) / kRowsPerBlock;
  std::vector<double> partial(static_cast<size_t>(blocks * 2 * C), 0.0);
  ForBlocks(ctx, v, cost_per_row, [&](int64_t r0, int64_t r1, int64_t b) {
    double* pa = partial.data() + b * 2 * C;
    accumulate(r0, r1, pa, pa + C);
  });
  std::fill(out_a, out_a + C, 0.0);
  std::fill(out_b, out_b + C, 0.0);
  for (int64_t b = 0; b < blocks; ++b) {
    const double* pa = partial.data() + b * 2 * C;
    for (int64_t c = 0; c < C; ++c) {
      out_a[c] += pa[c];
      out_b[c] += pa[C + c];
    }
  }
}

Status PerChannelPair(InferenceContext* c) {
  ShapeHandle x = c->input(0);
  if (c->RankKnown(x) && c->Rank(x) >= 1) {
    auto channels = c->Vector(c->Dim(x, c->Rank(x) - 1));
    c->set_output(0, channels);
    c->set_output(1, channels);
  } else {
    c->set_output(0, c->Vector(InferenceContext::kUnknownDim));
    c->set_output(1, c->Vector(InferenceContext::kUnknownDim));
  }
  return Status();
}

// The normalized value before the optional ReLU; the forward and backward ops share it so that
// the backward's ReLU mask is exactly the forward's.
inline float Normalized(float x, float mean_hi, float scale, float offset) {
  return (x - mean_hi) * scale + offset;
}

// ReLU that keeps NaN (as TensorFlow's Relu does), so a diverged step still shows non-finite values.
inline float Relu(float z) { return z < 0.0f ? 0.0f : z; }

// dy times the ReLU's derivative at z (1 where z > 0, else 0, as TensorFlow's ReluGrad), or dy
// itself without the ReLU. A template parameter rather than a run-time flag, so that each inner
// loop stays branch-free and vectorizes.
template <bool kRelu>
inline float MaskedDy(float dy, float x, float mean_hi, float scale, float offset) {
  if (!kRelu) return dy;
  return dy * static_cast<float>(Normalized(x, mean_hi, scale, offset) > 0.0f);
}

// Per-channel Σ(x - shift) and Σ(x - shift)² over rows [r0, r1), in float64.
HVDTRAIN_CPU_CLONES void MomentRows(const float* x, const double* shift, int64_t C, int64_t r0, int64_t r1,
                                    double* sum, double* sq_sum) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* row = x + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const double d = static_cast<double>(row[c]) - shift[c];
      sum[c] += d;
      sq_sum[c] += d * d;
    }
  }
}

// Per-channel Σg and Σg·(x - mean_hi) over rows [r0, r1), g = MaskedDy<kRelu>.
template <bool kRelu>
HVDTRAIN_CPU_CLONES void GradSumRows(const float* dy, const float* x, const float* h, const float* s,
                                     const float* o, int64_t C, int64_t r0, int64_t r1, double* sum_g,
                                     double* sum_g_centered) {
  for (int64_t r = r0; r < r1; ++r) {
    const float *dr = dy + r * C, *xr = x + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float g = MaskedDy<kRelu>(dr[c], xr[c], h[c], s[c], o[c]);
      sum_g[c] += g;
      sum_g_centered[c] += static_cast<double>(g) * static_cast<double>(xr[c] - h[c]);
    }
  }
}

// dx = scale·g + b·(x - mean_hi) + c over rows [r0, r1), g = MaskedDy<kRelu>.
template <bool kRelu>
HVDTRAIN_CPU_CLONES void GradInputRows(const float* dy, const float* x, const float* h, const float* s,
                                       const float* o, const float* b, const float* c, int64_t C, int64_t r0,
                                       int64_t r1, float* dx) {
  for (int64_t r = r0; r < r1; ++r) {
    const float *dr = dy + r * C, *xr = x + r * C;
    float* dxr = dx + r * C;
    for (int64_t k = 0; k < C; ++k) {
      dxr[k] = s[k] * MaskedDy<kRelu>(dr[k], xr[k], h[k], s[k], o[k]) + b[k] * (xr[k] - h[k]) + c[k];
    }
  }
}

// y = [ReLU of] the normalized value over rows [r0, r1).
template <bool kRelu>
HVDTRAIN_CPU_CLONES void NormalizeRows(const float* x, const float* h, const float* s, const float* o, int64_t C,
                                       int64_t r0, int64_t r1, float* y) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* xr = x + r * C;
    float* yr = y + r * C;
    for (int64_t c = 0; c < C; ++c) {
      const float z = Normalized(xr[c], h[c], s[c], o[c]);
      yr[c] = kRelu ? Relu(z) : z;
    }
  }
}

// The ops with the `relu` attribute (fused ReLU) read it once, here.
class FusedReluKernel : public OpKernel {
 public:
  explicit FusedReluKernel(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("relu", &relu_));
  }

 protected:
  bool relu_ = false;
};

Status SameAsFirst(InferenceContext* c) {
  c->set_output(0, c->input(0));
  return Status();
}

}  // namespace

// ---- forward: shifted moments -----------------------------------------------------------------
REGISTER_OP("HvdtrainSyncBnMoments")
    .Input("x: float")
    .Input("shift: double")
    .Output("shifted_sum: double")
    .Output("shifted_sq_sum: double")
    .SetShapeFn(PerChannelPair)
    .Doc("Per channel (last axis): sum of (x - shift) and of (x - shift)^2, accumulated in float64.");

class MomentsOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor& shift = ctx->input(1);
    View v;
    if (!MakeView(ctx, x, {&shift}, &v)) return;
    Tensor *s1, *s2;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({v.channels}), &s1));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({v.channels}), &s2));
    const float* xp = x.flat<float>().data();
    const double* k = shift.flat<double>().data();
    const int64_t C = v.channels;
    BlockedSums(ctx, v, 4 * C, s1->flat<double>().data(), s2->flat<double>().data(),
                [&](int64_t r0, int64_t r1, double* a, double* b) { MomentRows(xp, k, C, r0, r1, a, b); });
  }
};
REGISTER_KERNEL_BUILDER(Name("HvdtrainSyncBnMoments").Device(DEVICE_CPU), MomentsOp);

// ---- forward: normalization --------------------------------------------------------------------
REGISTER_OP("HvdtrainSyncBnNormalize")
    .Input("x: float")
    .Input("mean_hi: float")
    .Input("scale: float")
    .Input("offset: float")
    .Output("y: float")
    .Attr("relu: bool = false")
    .SetShapeFn(SameAsFirst)
    .Doc("y = (x - mean_hi) * scale + offset, per channel (last axis); then max(y, 0) if relu.");

class NormalizeOp : public FusedReluKernel {
 public:
  using FusedReluKernel::FusedReluKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    const Tensor &hi = ctx->input(1), &scale = ctx->input(2), &offset = ctx->input(3);
    View v;
    if (!MakeView(ctx, x, {&hi, &scale, &offset}, &v)) return;
    Tensor* y;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &y));
    const float *xp = x.flat<float>().data(), *h = hi.flat<float>().data();
    const float *s = scale.flat<float>().data(), *o = offset.flat<float>().data();
    float* yp = y->flat<float>().data();
    const int64_t C = v.channels;
    ForBlocks(ctx, v, 3 * C, [&](int64_t r0, int64_t r1, int64_t) {
      (relu_ ? NormalizeRows<true> : NormalizeRows<false>)(xp, h, s, o, C, r0, r1, yp);
    });
  }
};
REGISTER_KERNEL_BUILDER(Name("HvdtrainSyncBnNormalize").Device(DEVICE_CPU), NormalizeOp);

// ---- backward: per-channel sums --------------------------------------------------------------------
REGISTER_OP("HvdtrainSyncBnGradSums")
    .Input("dy: float")
    .Input("x: float")
    .Input("mean_hi: float")
    .Input("scale: float")
    .Input("offset: float")
    .Output("sum_dy: double")
    .Output("sum_dy_centered: double")
    .Attr("relu: bool = false")
    .SetShapeFn(PerChannelPair)
    .Doc("Per channel: sum of g and of g * (x - mean_hi), accumulated in float64, where g = dy, or "
         "with relu dy masked to 0 where (x - mean_hi) * scale + offset <= 0 (scale, offset unused "
         "otherwise).");

class GradSumsOp : public FusedReluKernel {
 public:
  using FusedReluKernel::FusedReluKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor &dy = ctx->input(0), &x = ctx->input(1), &hi = ctx->input(2);
    const Tensor &scale = ctx->input(3), &offset = ctx->input(4);
    OP_REQUIRES(ctx, dy.shape() == x.shape(), InvalidArgument("dy and x shapes differ"));
    View v;
    if (!MakeView(ctx, x, {&hi, &scale, &offset}, &v)) return;
    Tensor *s1, *s2;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({v.channels}), &s1));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({v.channels}), &s2));
    const float *dp = dy.flat<float>().data(), *xp = x.flat<float>().data(), *h = hi.flat<float>().data();
    const float *s = scale.flat<float>().data(), *o = offset.flat<float>().data();
    const int64_t C = v.channels;
    BlockedSums(ctx, v, 5 * C, s1->flat<double>().data(), s2->flat<double>().data(),
                [&](int64_t r0, int64_t r1, double* a, double* b) {
                  (relu_ ? GradSumRows<true> : GradSumRows<false>)(dp, xp, h, s, o, C, r0, r1, a, b);
                });
  }
};
REGISTER_KERNEL_BUILDER(Name("HvdtrainSyncBnGradSums").Device(DEVICE_CPU), GradSumsOp);

// ---- backward: input gradient ------------------------------------------------------------------
REGISTER_OP("HvdtrainSyncBnGradInput")
    .Input("dy: float")
    .Input("x: float")
    .Input("mean_hi: float")
    .Input("scale: float")
    .Input("offset: float")
    .Input("b: float")
    .Input("c: float")
    .Output("dx: float")
    .Attr("relu: bool = false")
    .SetShapeFn(SameAsFirst)
    .Doc("dx = scale * g + b * (x - mean_hi) + c, per channel (last axis), where g = dy, or with "
         "relu dy masked to 0 where (x - mean_hi) * scale + offset <= 0 (offset unused otherwise).");

class GradInputOp : public FusedReluKernel {
 public:
  using FusedReluKernel::FusedReluKernel;
  void Compute(OpKernelContext* ctx) override {
    const Tensor &dy = ctx->input(0), &x = ctx->input(1), &hi = ctx->input(2);
    const Tensor &scale = ctx->input(3), &offset = ctx->input(4), &b = ctx->input(5), &c = ctx->input(6);
    OP_REQUIRES(ctx, dy.shape() == x.shape(), InvalidArgument("dy and x shapes differ"));
    View v;
    if (!MakeView(ctx, x, {&hi, &scale, &offset, &b, &c}, &v)) return;
    Tensor* dx;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, x.shape(), &dx));
    const float *dp = dy.flat<float>().data(), *xp = x.flat<float>().data(), *h = hi.flat<float>().data();
    const float *s = scale.flat<float>().data(), *o = offset.flat<float>().data();
    const float *bp = b.flat<float>().data(), *cp = c.flat<float>().data();
    float* out = dx->flat<float>().data();
    const int64_t C = v.channels;
    ForBlocks(ctx, v, 5 * C, [&](int64_t r0, int64_t r1, int64_t) {
      (relu_ ? GradInputRows<true> : GradInputRows<false>)(dp, xp, h, s, o, bp, cp, C, r0, r1, out);
    });
  }
};
REGISTER_KERNEL_BUILDER(Name("HvdtrainSyncBnGradInput").Device(DEVICE_CPU), GradInputOp);

}  // namespace hvdtrain
