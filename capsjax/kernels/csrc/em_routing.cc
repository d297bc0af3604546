// EM routing of convolutional capsule windows fused with their votes, and
// its gradient, as XLA FFI calls (capsjax/kernels/em_cpu.py builds and loads
// this file).
//
// Each window routes on its own (no E-step normaliser across windows):
//   poses x: [N, I, 4, 4] (the window's children), activations a: [N, I],
//   transforms w: [I, O, 4, 4], beta_u, beta_a: [O], lambdas: [T],
//   votes V_io = x_i w_io (4x4 products, flattened to D = 16),
// then T iterations of EM routing exactly as routing.em_routing (paper or
// authors activation form, optional cost normalisation and centre
// momentum). Outputs: poses [N, O, 16] (mu of the last M-step),
// activations [N, O] (sigmoid of its logit), assignments [N, I, O] (the R
// of the last M-step). float32 or float64 throughout.
//
// Why a kernel: one window's votes (288 x 32 x 16 floats in the paper EM
// model's conv capsules, 590 KB) stay in the core's cache for all of the
// routing's passes, forward and backward, and no [windows, I, O, D]
// temporary is ever written to memory. The backward pass recomputes the
// window's forward pass, then applies the hand-derived reverse of every
// step (its derivation is in the comments of Backward).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kSide = 4;          // pose matrices are 4 x 4
constexpr int64_t kDim = kSide * kSide;  // D: numbers per vote
constexpr double kLog2Pi = 1.8378770664093453;

struct Options {
  int64_t iterations;
  int64_t authors_form;    // 0: the paper's activation, 1: the authors'
  int64_t normalize_cost;  // cost -> (cost - mean_O) / std_O
  double center_momentum, variance_epsilon, mass_epsilon, cost_std_epsilon;
};

template <typename T>
T LogSigmoid(T x) {
  return -(std::log1p(std::exp(-std::abs(x))) + std::max(-x, T(0)));
}

template <typename T>
T Sigmoid(T x) {
  if (x >= 0) return T(1) / (T(1) + std::exp(-x));
  const T e = std::exp(x);
  return e / (T(1) + e);
}

// exp of the E-step's log-assignments (<= 0): the library's in float64;
// in float32 2^k e^f with a degree-7 polynomial for e^f (|f| <= ln 2 / 2,
// relative error below 1e-7), written so that the compiler vectorises it.
template <typename T>
inline T ExpNonPositive(T x) {
  return std::exp(x);
}
template <>
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) ~ 1.6e-38, the smallest normal
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds
  const float k = (x * 1.44269504088896341f + shifter) - shifter;
  const float f = (x - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  float y = 1.0f / 5040.0f;
  y = y * f + 1.0f / 720.0f;
  y = y * f + 1.0f / 120.0f;
  y = y * f + 1.0f / 24.0f;
  y = y * f + 1.0f / 6.0f;
  y = y * f + 0.5f;
  y = y * f + 1.0f;
  y = y * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// One worker's buffers, reused window after window, and its share of the
// gradients summed over windows. Every per-parent array keeps the parents
// O innermost ([..., D, O]), so the passes over the votes are vertical
// vector operations over O.
template <typename T>
struct Scratch {
  int64_t num_in, num_out, iterations;
  std::vector<T> votes, grad_votes;   // [I, D, O]
  std::vector<T> assign;              // [T, I, O]: R entering each M-step
  std::vector<T> mu, mu_new, var_eps; // [T, D, O]: var_eps = sigma^2 + eps
  std::vector<T> mass, logit, cost, cost_std;  // [T, O], [T, O], [T, O], [T]
  std::vector<T> sum_log_var;         // [T, O]: sum_d log(sigma^2 + eps)
  std::vector<T> sums;                // [D, O]
  std::vector<T> inv_var;             // [T, D, O]: 1 / var_eps
  std::vector<T> offset, num;         // [O]
  // Backward only.
  std::vector<T> g_mu, g_lv, g_mu_prev, g_var, g_mu_new, g_s, g_mu_e;  // [D, O]
  std::vector<T> g_logit, g_m, g_cost, sum_g_num;  // [O]
  std::vector<T> g_q, g_n, g_log_r;   // [I, O]
  // Gradients summed over the windows of the chunk this worker is running.
  std::vector<T> grad_w;              // [I, 4 (q), 4 (r), O], w transposed
  std::vector<T> grad_beta_u, grad_beta_a, grad_lambdas;  // [O], [O], [T]

  Scratch(int64_t i, int64_t o, int64_t t, bool backward)
      : num_in(i), num_out(o), iterations(t), votes(i * kDim * o),
        assign(t * i * o), mu(t * kDim * o), mu_new(t * kDim * o),
        var_eps(t * kDim * o), mass(t * o), logit(t * o), cost(t * o),
        sum_log_var(t * o),
        cost_std(t), sums(kDim * o), inv_var(t * kDim * o), offset(o), num(o) {
    if (!backward) return;
    for (auto* v : {&g_mu, &g_lv, &g_mu_prev, &g_var, &g_mu_new, &g_s, &g_mu_e})
      v->resize(kDim * o);
    for (auto* v : {&g_logit, &g_m, &g_cost, &sum_g_num}) v->resize(o);
    for (auto* v : {&g_q, &g_n, &g_log_r}) v->resize(i * o);
    grad_votes.resize(i * kDim * o);
    grad_w.assign(i * kDim * o, T(0));
    grad_beta_u.assign(o, T(0));
    grad_beta_a.assign(o, T(0));
    grad_lambdas.assign(t, T(0));
  }
};

// The window's routing, every iteration's statistics kept in ``s``.
// x: [I, 4, 4] poses, a: [I], wt: [I, 4 (q), 4 (r), O] the transforms
// transposed (V_io[p, r] = sum_q x_i[p, q] w_io[q, r]).
template <typename T>
void Forward(const Options& opt, const T* x, const T* a, const T* wt,
             const T* beta_u, const T* beta_a, const T* lambdas,
             Scratch<T>& s) {
  const int64_t I = s.num_in, O = s.num_out, iters = opt.iterations;
  const int64_t DO = kDim * O;
  const T c = T(opt.center_momentum), var_floor = T(opt.variance_epsilon);
  const T mass_eps = T(opt.mass_epsilon);
  T* V = s.votes.data();
  T* __restrict__ S = s.sums.data();
  // Votes, and the first M-step's weighted sums with R = 1/O.
  std::fill(S, S + DO, T(0));
  const T uniform = T(1) / T(O);
  T mass0 = 0;
  for (int64_t i = 0; i < I; ++i) {
    const T* xi = x + i * kDim;
    const T* wi = wt + i * DO;
    const T weight = a[i] * uniform;
    mass0 += weight;
    for (int64_t p = 0; p < kSide; ++p) {
      const T x0 = xi[p * 4], x1 = xi[p * 4 + 1], x2 = xi[p * 4 + 2],
              x3 = xi[p * 4 + 3];
      for (int64_t r = 0; r < kSide; ++r) {
        const T* __restrict__ w0 = wi + r * O;
        T* __restrict__ v = V + (i * kDim + p * 4 + r) * O;
        T* __restrict__ so = S + (p * 4 + r) * O;
        for (int64_t o = 0; o < O; ++o) {
          const T vote = x0 * w0[o] + x1 * w0[4 * O + o] +
                         x2 * w0[8 * O + o] + x3 * w0[12 * O + o];
          v[o] = vote;
          so[o] += weight * vote;
        }
      }
    }
  }
  std::fill(s.mass.begin(), s.mass.begin() + O, mass0);
  std::fill(s.assign.begin(), s.assign.begin() + I * O, uniform);

  for (int64_t t = 0; t < iters; ++t) {
    // M-step: mu = sum_i n_io V_io, n_io = R_io a_i / (m_o + eps).
    const T* R = s.assign.data() + t * I * O;
    const T* m = s.mass.data() + t * O;
    T* mu = s.mu.data() + t * DO;
    T* mu_new = s.mu_new.data() + t * DO;
    T* ve = s.var_eps.data() + t * DO;
    const T* mu_prev = t ? s.mu.data() + (t - 1) * DO : nullptr;
    for (int64_t d = 0; d < kDim; ++d) {
      for (int64_t o = 0; o < O; ++o) {
        const T mean = S[d * O + o] / (m[o] + mass_eps);
        mu_new[d * O + o] = mean;
        mu[d * O + o] =
            (T(1) - c) * mean + c * (mu_prev ? mu_prev[d * O + o] : T(0));
      }
    }
    // Two-pass variance: sum_i n_io (V_io - mu_o)^2.
    std::fill(ve, ve + DO, T(0));
    T* __restrict__ n = s.num.data();
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t o = 0; o < O; ++o)
        n[o] = R[i * O + o] * a[i] / (m[o] + mass_eps);
      const T* __restrict__ v = V + i * DO;
      T* __restrict__ var = ve;
      const T* __restrict__ centre = mu;
      for (int64_t d = 0; d < kDim; ++d) {
        for (int64_t o = 0; o < O; ++o) {
          const T diff = v[d * O + o] - centre[d * O + o];
          var[d * O + o] += n[o] * diff * diff;
        }
      }
    }
    T* cost = s.cost.data() + t * O;
    T* logit = s.logit.data() + t * O;
    T* sum_log_var = s.sum_log_var.data() + t * O;
    for (int64_t o = 0; o < O; ++o) {
      T sum_lv = 0;
      for (int64_t d = 0; d < kDim; ++d) {
        ve[d * O + o] += var_floor;
        sum_lv += std::log(ve[d * O + o]);
      }
      sum_log_var[o] = sum_lv;
      cost[o] = opt.authors_form
                    ? m[o] * (sum_lv + beta_u[o] * T(kDim) * T(kLog2Pi + 1.0))
                    : (T(kDim) * beta_u[o] + T(0.5) * sum_lv) * m[o];
    }
    T mean = 0, sd = 1;
    if (opt.normalize_cost) {
      for (int64_t o = 0; o < O; ++o) mean += cost[o];
      mean /= T(O);
      T sq = 0;
      for (int64_t o = 0; o < O; ++o) sq += (cost[o] - mean) * (cost[o] - mean);
      sd = std::sqrt(sq / T(O) + T(opt.cost_std_epsilon * opt.cost_std_epsilon));
    }
    s.cost_std[t] = sd;
    for (int64_t o = 0; o < O; ++o) {
      const T normalized = opt.normalize_cost ? (cost[o] - mean) / sd : cost[o];
      logit[o] = opt.authors_form
                     ? lambdas[t] * (-normalized - T(5000) * beta_a[o])
                     : lambdas[t] * (beta_a[o] - normalized);
    }
    if (t + 1 == iters) break;
    // E-step: R_io = softmax_o(log sigmoid(logit_o) + log N(V_io; mu, sigma)),
    // fused with the next M-step's weighted sums.
    T* iv = s.inv_var.data() + t * DO;
    T* offset = s.offset.data();
    for (int64_t o = 0; o < O; ++o) {
      for (int64_t d = 0; d < kDim; ++d) iv[d * O + o] = T(1) / ve[d * O + o];
      offset[o] = LogSigmoid(logit[o]) -
                  T(0.5) * (sum_log_var[o] + T(kDim) * T(kLog2Pi));
    }
    T* R_next = s.assign.data() + (t + 1) * I * O;
    T* m_next = s.mass.data() + (t + 1) * O;
    std::fill(m_next, m_next + O, T(0));
    std::fill(S, S + DO, T(0));
    T* __restrict__ num = s.num.data();
    const T* __restrict__ centre = mu;
    for (int64_t i = 0; i < I; ++i) {
      const T* __restrict__ v = V + i * DO;
      for (int64_t o = 0; o < O; ++o) num[o] = 0;
      for (int64_t d = 0; d < kDim; ++d) {
        for (int64_t o = 0; o < O; ++o) {
          const T diff = v[d * O + o] - centre[d * O + o];
          num[o] += diff * diff * iv[d * O + o];
        }
      }
      T top = offset[0] - T(0.5) * num[0];
      for (int64_t o = 0; o < O; ++o) {
        num[o] = offset[o] - T(0.5) * num[o];
        top = std::max(top, num[o]);
      }
      T total = 0;
      for (int64_t o = 0; o < O; ++o) total += ExpNonPositive(num[o] - top);
      // (num - top) - log total: top + log total would round at top's scale.
      const T log_total = std::log(total);
      T* __restrict__ r = R_next + i * O;
      for (int64_t o = 0; o < O; ++o) {
        r[o] = ExpNonPositive((num[o] - top) - log_total);
        m_next[o] += r[o] * a[i];
      }
      for (int64_t d = 0; d < kDim; ++d) {
        for (int64_t o = 0; o < O; ++o)
          S[d * O + o] += r[o] * a[i] * v[d * O + o];
      }
    }
  }
}

// The two passes of the backward over one child's votes [D, O] (separate
// functions so that the compiler knows the arrays apart and vectorises
// them over O).
// E-step: q = sum_d (V - mu)^2 / ve, g_q given: g_V += 2 g_q (V - mu) / ve,
// g_mu -= the same, g_s += g_q (V - mu)^2.
template <typename T>
void EStepReverseChild(int64_t O, const T* __restrict__ g_q,
                       const T* __restrict__ v, const T* __restrict__ mu,
                       const T* __restrict__ inv_var, T* __restrict__ g_v,
                       T* __restrict__ g_mu, T* __restrict__ g_s) {
  for (int64_t d = 0; d < kDim; ++d) {
    for (int64_t o = 0; o < O; ++o) {
      const int64_t k = d * O + o;
      const T diff = v[k] - mu[k];
      const T scaled = T(2) * g_q[o] * diff * inv_var[k];
      g_v[k] += scaled;
      g_mu[k] -= scaled;
      g_s[k] += g_q[o] * diff * diff;
    }
  }
}

// M-step: mu_new = sum_i n V, var = sum_i n (V - mu)^2, their cotangents
// given: g_n = sum_d g_var (V - mu)^2 + g_mu_new V,
// g_V += n (2 (V - mu) g_var + g_mu_new).
template <typename T>
void MStepReverseChild(int64_t O, const T* __restrict__ n,
                       const T* __restrict__ v, const T* __restrict__ mu,
                       const T* __restrict__ g_var,
                       const T* __restrict__ g_mu_new, T* __restrict__ g_v,
                       T* __restrict__ g_n) {
  for (int64_t o = 0; o < O; ++o) g_n[o] = 0;
  for (int64_t d = 0; d < kDim; ++d) {
    for (int64_t o = 0; o < O; ++o) {
      const int64_t k = d * O + o;
      const T diff = v[k] - mu[k];
      g_n[o] += g_var[k] * diff * diff + g_mu_new[k] * v[k];
      g_v[k] += n[o] * (T(2) * diff * g_var[k] + g_mu_new[k]);
    }
  }
}

// The gradient of one window's routing: ``Forward``, then each step's
// reverse, last iteration first. Cotangents in: g_pose [O, D], g_act [O],
// g_assign [I, O]; out: g_x [I, D] and g_a [I] of this window, and the
// gradients of wt (layout as wt), beta_u, beta_a and lambdas added to the
// worker's sums.
template <typename T>
void Backward(const Options& opt, const T* x, const T* a, const T* wt,
              const T* beta_u, const T* beta_a, const T* lambdas,
              const T* g_pose, const T* g_act, const T* g_assign, T* g_x,
              T* g_a, Scratch<T>& s) {
  Forward(opt, x, a, wt, beta_u, beta_a, lambdas, s);
  const int64_t I = s.num_in, O = s.num_out, iters = opt.iterations;
  const int64_t DO = kDim * O;
  const T c = T(opt.center_momentum), mass_eps = T(opt.mass_epsilon);
  const T* V = s.votes.data();
  T* gV = s.grad_votes.data();
  std::fill(gV, gV + I * DO, T(0));
  std::fill(g_a, g_a + I, T(0));
  // Cotangents of the current iteration's M-step outputs.
  T *g_mu = s.g_mu.data(), *g_lv = s.g_lv.data(), *g_logit = s.g_logit.data();
  T *g_var = s.g_var.data(), *g_mu_new = s.g_mu_new.data();
  T *g_mu_prev = s.g_mu_prev.data(), *g_m = s.g_m.data();
  T *g_cost = s.g_cost.data(), *g_log_r = s.g_log_r.data();
  for (int64_t o = 0; o < O; ++o)
    for (int64_t d = 0; d < kDim; ++d) g_mu[d * O + o] = g_pose[o * kDim + d];
  std::fill(g_lv, g_lv + DO, T(0));
  const T* last_logit = s.logit.data() + (iters - 1) * O;
  for (int64_t o = 0; o < O; ++o) {
    const T act = Sigmoid(last_logit[o]);
    g_logit[o] = g_act[o] * act * (T(1) - act);
  }
  for (int64_t t = iters - 1; t >= 0; --t) {
    const T* mu = s.mu.data() + t * DO;
    const T* ve = s.var_eps.data() + t * DO;
    const T* logit = s.logit.data() + t * O;
    if (t + 1 < iters) {
      // E-step t's reverse; g_log_r holds the cotangent of its log R.
      // logR = num - logsumexp_o num:  g_num = g_logR - R sum_o g_logR.
      // num_io = log sigmoid(logit_o) - (q_io + sum_d lv_od + D log 2pi) / 2
      // q_io = sum_d (V - mu)^2 exp(-lv):
      //   g_V += 2 g_q (V - mu) / ve, g_mu -= the same summed over i,
      //   g_lv -= (sum_i g_q (V - mu)^2) / ve.
      const T* R = s.assign.data() + (t + 1) * I * O;
      T* g_q = s.g_q.data();
      T* sum_g_num = s.sum_g_num.data();
      std::fill(sum_g_num, sum_g_num + O, T(0));
      for (int64_t i = 0; i < I; ++i) {
        T total = 0;
        for (int64_t o = 0; o < O; ++o) total += g_log_r[i * O + o];
        for (int64_t o = 0; o < O; ++o) {
          const T g_num = g_log_r[i * O + o] - R[i * O + o] * total;
          g_q[i * O + o] = T(-0.5) * g_num;
          sum_g_num[o] += g_num;
        }
      }
      for (int64_t o = 0; o < O; ++o) {
        g_logit[o] += Sigmoid(-logit[o]) * sum_g_num[o];
        for (int64_t d = 0; d < kDim; ++d)
          g_lv[d * O + o] -= T(0.5) * sum_g_num[o];
      }
      T* __restrict__ g_s = s.g_s.data();
      T* __restrict__ g_mu_e = s.g_mu_e.data();
      const T* __restrict__ iv = s.inv_var.data() + t * DO;
      std::fill(g_s, g_s + DO, T(0));
      std::fill(g_mu_e, g_mu_e + DO, T(0));
      for (int64_t i = 0; i < I; ++i) {
        EStepReverseChild(O, g_q + i * O, V + i * DO, mu, iv, gV + i * DO,
                          g_mu_e, g_s);
      }
      for (int64_t k = 0; k < DO; ++k) {
        g_mu[k] += g_mu_e[k];
        g_lv[k] -= g_s[k] / ve[k];
      }
    }
    // M-step t's reverse.
    const T lam = lambdas[t];
    const T* m = s.mass.data() + t * O;
    const T* cost = s.cost.data() + t * O;
    const T* R = s.assign.data() + t * I * O;
    const T* mu_new = s.mu_new.data() + t * DO;
    T mean = 0;
    if (opt.normalize_cost) {
      for (int64_t o = 0; o < O; ++o) mean += cost[o];
      mean /= T(O);
    }
    const T sd = s.cost_std[t];
    // logit = lam (beta_a - cost') or lam (-cost' - 5000 beta_a).
    for (int64_t o = 0; o < O; ++o) {
      const T normalized = opt.normalize_cost ? (cost[o] - mean) / sd : cost[o];
      if (opt.authors_form) {
        s.grad_beta_a[o] += T(-5000) * lam * g_logit[o];
        s.grad_lambdas[t] += g_logit[o] * (-normalized - T(5000) * beta_a[o]);
      } else {
        s.grad_beta_a[o] += lam * g_logit[o];
        s.grad_lambdas[t] += g_logit[o] * (beta_a[o] - normalized);
      }
      g_cost[o] = -lam * g_logit[o];
    }
    if (opt.normalize_cost) {
      // cost' = u / sd, u = cost - mean, sd = sqrt(mean(u^2) + e^2):
      // g_u = g / sd - u (sum_k g_k u_k) / (O sd^3), g_cost = g_u - mean(g_u).
      T dot = 0;
      for (int64_t o = 0; o < O; ++o) dot += g_cost[o] * (cost[o] - mean);
      T mean_g = 0;
      for (int64_t o = 0; o < O; ++o) {
        g_cost[o] = g_cost[o] / sd - (cost[o] - mean) * dot / (T(O) * sd * sd * sd);
        mean_g += g_cost[o];
      }
      mean_g /= T(O);
      for (int64_t o = 0; o < O; ++o) g_cost[o] -= mean_g;
    }
    const T* sum_log_var = s.sum_log_var.data() + t * O;
    for (int64_t o = 0; o < O; ++o) {
      const T sum_lv = sum_log_var[o];
      T g_lv_cost;
      if (opt.authors_form) {
        // cost = m (sum_d lv + beta_u D (log 2pi + 1)).
        const T k = T(kDim) * T(kLog2Pi + 1.0);
        s.grad_beta_u[o] += m[o] * k * g_cost[o];
        g_lv_cost = m[o] * g_cost[o];
        g_m[o] = (sum_lv + beta_u[o] * k) * g_cost[o];
      } else {
        // cost = (D beta_u + sum_d lv / 2) m.
        s.grad_beta_u[o] += T(kDim) * m[o] * g_cost[o];
        g_lv_cost = T(0.5) * m[o] * g_cost[o];
        g_m[o] = (T(kDim) * beta_u[o] + T(0.5) * sum_lv) * g_cost[o];
      }
      // lv = log(var + eps); var = sum_i n (V - mu)^2, whose mu-derivative
      // is -2 g_var sum_i n (V - mu) = -2 g_var (mu_new - mu sum_i n),
      // sum_i n = m / (m + eps); mu = (1 - c) mu_new + c mu_prev.
      const T rho = m[o] / (m[o] + mass_eps);
      for (int64_t d = 0; d < kDim; ++d) {
        const int64_t k = d * O + o;
        g_var[k] = (g_lv[k] + g_lv_cost) / ve[k];
        g_mu[k] -= T(2) * g_var[k] * (mu_new[k] - rho * mu[k]);
        g_mu_new[k] = (T(1) - c) * g_mu[k];
        g_mu_prev[k] = c * g_mu[k];
      }
    }
    // mu_new = sum_i n V, var = sum_i n (V - mu)^2: g_n and g_V.
    T* g_n = s.g_n.data();
    T* n = s.num.data();
    for (int64_t i = 0; i < I; ++i) {
      for (int64_t o = 0; o < O; ++o) {
        n[o] = R[i * O + o] * a[i] / (m[o] + mass_eps);
      }
      MStepReverseChild(O, n, V + i * DO, mu, g_var, g_mu_new, gV + i * DO,
                        g_n + i * O);
      // n = w / (m + eps): g_m -= g_n w / (m + eps)^2 = g_n n / (m + eps).
      for (int64_t o = 0; o < O; ++o)
        g_m[o] -= g_n[i * O + o] * n[o] / (m[o] + mass_eps);
    }
    // w = R a, m = sum_i w: g_w = g_n / (m + eps) + g_m; g_a += sum_o g_w R;
    // g_logR = g_w a R (R = exp(log R)); the assignments output is the R
    // entering the last M-step.
    for (int64_t i = 0; i < I; ++i) {
      T ga = 0;
      for (int64_t o = 0; o < O; ++o) {
        const int64_t k = i * O + o;
        const T gw = g_n[k] / (m[o] + mass_eps) + g_m[o];
        ga += gw * R[k];
        g_log_r[k] = gw * a[i] * R[k];
        if (t == iters - 1) g_log_r[k] += g_assign[k] * R[k];
      }
      g_a[i] += ga;
    }
    // The previous iteration's outputs: its mu through the momentum only.
    std::copy_n(g_mu_prev, DO, g_mu);
    std::fill(g_lv, g_lv + DO, T(0));
    std::fill(g_logit, g_logit + O, T(0));
  }
  // V_io[p, r] = sum_q x_i[p, q] w_io[q, r]:
  // g_x_i[p, q] = sum_{o, r} g_V_io[p, r] w_io[q, r],
  // g_w_io[q, r] += sum_p x_i[p, q] g_V_io[p, r].
  T* acc = s.num.data();
  for (int64_t i = 0; i < I; ++i) {
    const T* xi = x + i * kDim;
    const T* wi = wt + i * DO;
    const T* __restrict__ gv = gV + i * DO;
    T* __restrict__ gw = s.grad_w.data() + i * DO;
    for (int64_t p = 0; p < kSide; ++p) {
      for (int64_t q = 0; q < kSide; ++q) {
        std::fill(acc, acc + O, T(0));
        for (int64_t r = 0; r < kSide; ++r) {
          const T* g = gv + (p * 4 + r) * O;
          const T* w0 = wi + (q * 4 + r) * O;
          for (int64_t o = 0; o < O; ++o) acc[o] += g[o] * w0[o];
        }
        T total = 0;
        for (int64_t o = 0; o < O; ++o) total += acc[o];
        g_x[i * kDim + p * 4 + q] = total;
      }
    }
    for (int64_t q = 0; q < kSide; ++q) {
      const T x0 = xi[q], x1 = xi[4 + q], x2 = xi[8 + q], x3 = xi[12 + q];
      for (int64_t r = 0; r < kSide; ++r) {
        T* g = gw + (q * 4 + r) * O;
        for (int64_t o = 0; o < O; ++o)
          g[o] += x0 * gv[r * O + o] + x1 * gv[(4 + r) * O + o] +
                  x2 * gv[(8 + r) * O + o] + x3 * gv[(12 + r) * O + o];
      }
    }
  }
}

// Runs body(scratch slot, window) for windows 0..n-1 on the caller and on
// XLA's intra-op thread pool, in chunks of ``chunk`` consecutive windows
// claimed in order. With ``kInOrder``, after_chunk(slot, c) then runs for
// chunks c = 0, 1, 2, ... one at a time in that order (a worker that
// finished chunk c waits for chunk c-1's), so that what it adds up does not
// depend on which thread ran which chunk. A task that starts after every
// chunk has been claimed returns without touching anything but the shared
// counters, so the caller may return as soon as every claimed chunk is done.
template <bool kInOrder, typename F, typename G>
void ForEachChunk(ffi::ThreadPool& pool, int64_t n, int64_t chunk,
                  int64_t workers, const F& body, const G& after_chunk) {
  struct Counters {
    std::atomic<int64_t> next{0}, done{0};
    std::atomic<int64_t> slots{0};
  };
  const int64_t chunks = (n + chunk - 1) / chunk;
  auto counters = std::make_shared<Counters>();
  auto work = [counters, n, chunk, chunks, &body, &after_chunk]() {
    int64_t c = counters->next.fetch_add(1);
    if (c >= chunks) return;
    const int64_t slot = counters->slots.fetch_add(1);
    for (; c < chunks; c = counters->next.fetch_add(1)) {
      for (int64_t k = c * chunk; k < std::min(n, (c + 1) * chunk); ++k)
        body(slot, k);
      if constexpr (kInOrder) {
        while (counters->done.load(std::memory_order_acquire) < c) {
          std::this_thread::yield();
        }
        after_chunk(slot, c);
      }
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < workers; ++t) pool.Schedule([work] { work(); });
  work();
  while (counters->done.load(std::memory_order_acquire) < chunks) {
    std::this_thread::yield();
  }
}

template <typename F>
void ForEachWindow(ffi::ThreadPool& pool, int64_t n, int64_t workers,
                   const F& body) {
  ForEachChunk<false>(pool, n, 1, workers, body, [](int64_t, int64_t) {});
}

int64_t Workers(ffi::ThreadPool& pool, int64_t n) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return std::max<int64_t>(1, std::min(threads, n));
}

// Windows per chunk of the backward pass: at most kGradientChunks chunks,
// a number that does not depend on the machine's threads (it fixes the
// order of the sums), enough to keep them busy, and large enough that a
// chunk's sum (I * O * 16 additions) stays small beside its windows' work.
constexpr int64_t kGradientChunks = 64;

int64_t GradientChunk(int64_t n) {
  return std::max<int64_t>(1, (n + kGradientChunks - 1) / kGradientChunks);
}

Options ReadOptions(int64_t iterations, int64_t authors_form,
                    int64_t normalize_cost, double center_momentum,
                    double variance_epsilon, double mass_epsilon,
                    double cost_std_epsilon) {
  return {iterations, authors_form, normalize_cost, center_momentum,
          variance_epsilon, mass_epsilon, cost_std_epsilon};
}

ffi::Error CheckShapes(const ffi::AnyBuffer& x, const ffi::AnyBuffer& a,
                       const ffi::AnyBuffer& w, const ffi::AnyBuffer& bu,
                       const ffi::AnyBuffer& ba, const ffi::AnyBuffer& lambdas,
                       int64_t iterations) {
  auto xd = x.dimensions(), ad = a.dimensions(), wd = w.dimensions();
  if (xd.size() != 4 || xd[2] != kSide || xd[3] != kSide || ad.size() != 2 ||
      ad[0] != xd[0] || ad[1] != xd[1] || wd.size() != 4 || wd[0] != xd[1] ||
      wd[2] != kSide || wd[3] != kSide ||
      bu.element_count() != static_cast<size_t>(wd[1]) ||
      ba.element_count() != static_cast<size_t>(wd[1]) ||
      lambdas.element_count() != static_cast<size_t>(iterations) ||
      iterations < 1) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "EM routing kernel: shapes must be x [N, I, 4, 4], "
                      "a [N, I], w [I, O, 4, 4], beta_u and beta_a [O], "
                      "lambdas [T]");
  }
  if (x.element_type() != a.element_type() ||
      x.element_type() != w.element_type() ||
      x.element_type() != bu.element_type() ||
      x.element_type() != ba.element_type() ||
      x.element_type() != lambdas.element_type() ||
      (x.element_type() != ffi::F32 && x.element_type() != ffi::F64)) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "EM routing kernel: operands all float32 or all float64");
  }
  return ffi::Error::Success();
}

// w [I, O, 4 (q), 4 (r)] -> [I, 4 (q), 4 (r), O], and back.
template <typename T>
std::vector<T> TransformsParentsLast(const T* w, int64_t I, int64_t O) {
  std::vector<T> wt(I * kDim * O);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t d = 0; d < kDim; ++d)
        wt[(i * kDim + d) * O + o] = w[(i * O + o) * kDim + d];
  return wt;
}

template <typename T>
void RunForward(ffi::ThreadPool& pool, const Options& opt,
                const ffi::AnyBuffer& x, const ffi::AnyBuffer& a,
                const ffi::AnyBuffer& w, const ffi::AnyBuffer& bu,
                const ffi::AnyBuffer& ba, const ffi::AnyBuffer& lam,
                ffi::Result<ffi::AnyBuffer>& poses,
                ffi::Result<ffi::AnyBuffer>& acts,
                ffi::Result<ffi::AnyBuffer>& assign) {
  const int64_t n = x.dimensions()[0], I = x.dimensions()[1],
                O = w.dimensions()[1];
  const T* xp = static_cast<const T*>(x.untyped_data());
  const T* ap = static_cast<const T*>(a.untyped_data());
  const T* wp = static_cast<const T*>(w.untyped_data());
  const T* bup = static_cast<const T*>(bu.untyped_data());
  const T* bap = static_cast<const T*>(ba.untyped_data());
  const T* lp = static_cast<const T*>(lam.untyped_data());
  T* out_pose = static_cast<T*>(poses->untyped_data());
  T* out_act = static_cast<T*>(acts->untyped_data());
  T* out_assign = static_cast<T*>(assign->untyped_data());
  const int64_t workers = Workers(pool, n);
  std::vector<std::unique_ptr<Scratch<T>>> scratch(workers);
  for (auto& sc : scratch)
    sc = std::make_unique<Scratch<T>>(I, O, opt.iterations, false);
  const int64_t last = opt.iterations - 1;
  const std::vector<T> wt = TransformsParentsLast(wp, I, O);
  ForEachWindow(pool, n, workers, [&](int64_t slot, int64_t k) {
    Scratch<T>& s = *scratch[slot];
    Forward(opt, xp + k * I * kDim, ap + k * I, wt.data(), bup, bap, lp, s);
    const T* mu = s.mu.data() + last * O * kDim;
    for (int64_t o = 0; o < O; ++o)
      for (int64_t d = 0; d < kDim; ++d)
        out_pose[(k * O + o) * kDim + d] = mu[d * O + o];
    for (int64_t o = 0; o < O; ++o)
      out_act[k * O + o] = Sigmoid(s.logit[last * O + o]);
    std::copy_n(s.assign.data() + last * I * O, I * O, out_assign + k * I * O);
  });
}

template <typename T>
void RunBackward(ffi::ThreadPool& pool, const Options& opt,
                 const ffi::AnyBuffer& x, const ffi::AnyBuffer& a,
                 const ffi::AnyBuffer& w, const ffi::AnyBuffer& bu,
                 const ffi::AnyBuffer& ba, const ffi::AnyBuffer& lam,
                 const ffi::AnyBuffer& g_pose, const ffi::AnyBuffer& g_act,
                 const ffi::AnyBuffer& g_assign,
                 ffi::Result<ffi::AnyBuffer>& g_x,
                 ffi::Result<ffi::AnyBuffer>& g_a,
                 ffi::Result<ffi::AnyBuffer>& g_w,
                 ffi::Result<ffi::AnyBuffer>& g_bu,
                 ffi::Result<ffi::AnyBuffer>& g_ba,
                 ffi::Result<ffi::AnyBuffer>& g_lam) {
  const int64_t n = x.dimensions()[0], I = x.dimensions()[1],
                O = w.dimensions()[1], iters = opt.iterations;
  auto in = [](const ffi::AnyBuffer& b) {
    return static_cast<const T*>(b.untyped_data());
  };
  auto out = [](ffi::Result<ffi::AnyBuffer>& b) {
    return static_cast<T*>(b->untyped_data());
  };
  const T *xp = in(x), *ap = in(a), *wp = in(w), *bup = in(bu), *bap = in(ba),
          *lp = in(lam), *gp = in(g_pose), *gac = in(g_act),
          *gas = in(g_assign);
  T *gxp = out(g_x), *gap = out(g_a);
  const int64_t chunk = GradientChunk(n);
  const int64_t workers = Workers(pool, (n + chunk - 1) / chunk);
  std::vector<std::unique_ptr<Scratch<T>>> scratch(workers);
  for (auto& sc : scratch)
    sc = std::make_unique<Scratch<T>>(I, O, iters, true);
  const std::vector<T> wt = TransformsParentsLast(wp, I, O);
  // The shared parameters' gradients: each chunk's windows summed in a
  // worker's scratch, the chunks' sums then added in chunk order, so that
  // the result is the same bit for bit on every call and thread count.
  std::vector<T> g_wt(I * kDim * O, T(0));
  T *gbu = out(g_bu), *gba = out(g_ba), *glam = out(g_lam);
  std::fill(gbu, gbu + O, T(0));
  std::fill(gba, gba + O, T(0));
  std::fill(glam, glam + iters, T(0));
  auto add_and_clear = [](T* sum, std::vector<T>& part) {
    for (size_t k = 0; k < part.size(); ++k) sum[k] += part[k];
    std::fill(part.begin(), part.end(), T(0));
  };
  ForEachChunk<true>(
      pool, n, chunk, workers,
      [&](int64_t slot, int64_t k) {
        Backward(opt, xp + k * I * kDim, ap + k * I, wt.data(), bup, bap, lp,
                 gp + k * O * kDim, gac + k * O, gas + k * I * O,
                 gxp + k * I * kDim, gap + k * I, *scratch[slot]);
      },
      [&](int64_t slot, int64_t) {
        Scratch<T>& s = *scratch[slot];
        add_and_clear(g_wt.data(), s.grad_w);
        add_and_clear(gbu, s.grad_beta_u);
        add_and_clear(gba, s.grad_beta_a);
        add_and_clear(glam, s.grad_lambdas);
      });
  T* gw = out(g_w);
  for (int64_t i = 0; i < I; ++i)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t d = 0; d < kDim; ++d)
        gw[(i * O + o) * kDim + d] = g_wt[(i * kDim + d) * O + o];
}

ffi::Error EmForwardImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                         ffi::AnyBuffer a, ffi::AnyBuffer w, ffi::AnyBuffer bu,
                         ffi::AnyBuffer ba, ffi::AnyBuffer lam,
                         ffi::Result<ffi::AnyBuffer> poses,
                         ffi::Result<ffi::AnyBuffer> acts,
                         ffi::Result<ffi::AnyBuffer> assign,
                         int64_t iterations, int64_t authors_form,
                         int64_t normalize_cost, double center_momentum,
                         double variance_epsilon, double mass_epsilon,
                         double cost_std_epsilon) {
  if (auto error = CheckShapes(x, a, w, bu, ba, lam, iterations); error.failure())
    return error;
  const Options opt =
      ReadOptions(iterations, authors_form, normalize_cost, center_momentum,
                  variance_epsilon, mass_epsilon, cost_std_epsilon);
  if (x.element_type() == ffi::F64)
    RunForward<double>(pool, opt, x, a, w, bu, ba, lam, poses, acts, assign);
  else
    RunForward<float>(pool, opt, x, a, w, bu, ba, lam, poses, acts, assign);
  return ffi::Error::Success();
}

ffi::Error EmBackwardImpl(
    ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer a, ffi::AnyBuffer w,
    ffi::AnyBuffer bu, ffi::AnyBuffer ba, ffi::AnyBuffer lam,
    ffi::AnyBuffer g_pose, ffi::AnyBuffer g_act, ffi::AnyBuffer g_assign,
    ffi::Result<ffi::AnyBuffer> g_x, ffi::Result<ffi::AnyBuffer> g_a,
    ffi::Result<ffi::AnyBuffer> g_w, ffi::Result<ffi::AnyBuffer> g_bu,
    ffi::Result<ffi::AnyBuffer> g_ba, ffi::Result<ffi::AnyBuffer> g_lam,
    int64_t iterations, int64_t authors_form, int64_t normalize_cost,
    double center_momentum, double variance_epsilon, double mass_epsilon,
    double cost_std_epsilon) {
  if (auto error = CheckShapes(x, a, w, bu, ba, lam, iterations); error.failure())
    return error;
  const Options opt =
      ReadOptions(iterations, authors_form, normalize_cost, center_momentum,
                  variance_epsilon, mass_epsilon, cost_std_epsilon);
  if (x.element_type() == ffi::F64)
    RunBackward<double>(pool, opt, x, a, w, bu, ba, lam, g_pose, g_act,
                        g_assign, g_x, g_a, g_w, g_bu, g_ba, g_lam);
  else
    RunBackward<float>(pool, opt, x, a, w, bu, ba, lam, g_pose, g_act,
                       g_assign, g_x, g_a, g_w, g_bu, g_ba, g_lam);
  return ffi::Error::Success();
}

}  // namespace

#define EM_ATTRS                                   \
  .Attr<int64_t>("iterations")                     \
      .Attr<int64_t>("authors_form")               \
      .Attr<int64_t>("normalize_cost")             \
      .Attr<double>("center_momentum")             \
      .Attr<double>("variance_epsilon")            \
      .Attr<double>("mass_epsilon")                \
      .Attr<double>("cost_std_epsilon")

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmConvRoutingForward, EmForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() EM_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(EmConvRoutingBackward, EmBackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>() EM_ATTRS);
