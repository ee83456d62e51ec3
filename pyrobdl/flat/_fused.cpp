// The fused kernel of pyrobdl.flat.fused (that module's docstring has the maths and the measurements):
// the log joint and gradient of a one-hidden-layer MLP with one output and a Gaussian likelihood, one
// chain at a time, 16 data points per vector (GCC/Clang vector extensions: AVX-512 registers where the
// CPU has them, split into narrower ones where not).  Built by pyrobdl.flat.fused with -O3 -march=native
// and without -ffast-math (NaN and inf propagate as in torch: a sampler detects divergence by them).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t L = 16;  // data points per vector
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads and stores

inline v16 splat(float x) { return v16{} + x; }
inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define PYROBDL_SHUFFLEVECTOR 1
#endif
#endif
inline float hsum(v16 v) {
#ifdef PYROBDL_SHUFFLEVECTOR  // a tree: halves added, 4 shuffles (GCC >= 12, Clang)
  v = v + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v = v + __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v = v + __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
#else  // lane by lane: 16 dependent additions
  float s = 0.f;
  for (int64_t i = 0; i < L; ++i) s += v[i];
  return s;
#endif
}

// tanh(x) = x P(x^2) / Q(x^2), P and Q of degree 4 (numerator degree 9, denominator 8): a
// minimax rational fit of tanh on [0, 9] (comparisons/benchmarks/tanh_rational.py), at most
// 5.3 float32 ulp from tanh at every float32 input (measured), |tanh| <= 1 + 2^-22; x is clamped
// to [-9, 9] (float32 tanh rounds to +-1 beyond 8.4).  NaN stays NaN (comparisons with NaN are
// false), +-inf gives the value at +-9 (1 + 2^-23).  M at a time, step by step across them: the
// chains of dependent operations (clamp, square, two polynomials, a division) overlap, where one
// at a time left the vector units waiting (one at a time: 1.2x the CPU of two, measured on the
// benchmark BNN).
template <int M>
inline void vtanhm(v16* x, v16* t) {
  v16 z[M], p[M], q[M];
  for (int j = 0; j < M; ++j) x[j] = x[j] < -9.f ? splat(-9.f) : x[j];
  for (int j = 0; j < M; ++j) x[j] = x[j] > 9.f ? splat(9.f) : x[j];
  for (int j = 0; j < M; ++j) z[j] = x[j] * x[j];
  for (int j = 0; j < M; ++j) p[j] = z[j] * 1.3353892688461817e-08f + 2.0608633152352846e-05f;
  for (int j = 0; j < M; ++j) q[j] = z[j] * 7.776272976267938e-07f + 0.00032855952018076253f;
  for (int j = 0; j < M; ++j) p[j] = p[j] * z[j] + 0.0034955663912985004f;
  for (int j = 0; j < M; ++j) q[j] = q[j] * z[j] + 0.025876905744327022f;
  for (int j = 0; j < M; ++j) p[j] = p[j] * z[j] + 0.13381009355707604f;
  for (int j = 0; j < M; ++j) q[j] = q[j] * z[j] + 0.46714325010193997f;
  for (int j = 0; j < M; ++j) p[j] = p[j] * z[j] + 0.9999999795516118f;
  for (int j = 0; j < M; ++j) q[j] = q[j] * z[j] + 1.f;
  for (int j = 0; j < M; ++j) t[j] = x[j] * p[j] / q[j];
}

}  // namespace

extern "C" {

// Mirrors pyrobdl.flat.fused._Net (ctypes): keep the two in the same order.
struct PyrobdlNet {
  int64_t P, N, NP, D, H, act;        // act: 0 tanh, 1 relu; NP: N rounded up to 16
  int64_t ow0, ob0, ow1, ob1, ou;     // offsets in theta; -1: no such site (no bias; fixed precision)
  float tau, lik_const;               // fixed precision, and N times its per-point normaliser
  float a, b, gamma_const;            // a learned precision's Gamma(a, b) prior
  float prior_const;
  const float* XT;                    // [D][NP] inputs, feature-major, zero-padded
  const float* y;                     // [NP]
  const float* mask;                  // [NP]: 1 for a data point, 0 for padding
  const float* prior_prec;            // [P]: the Gaussian prior's precision per coordinate (0: none)
};

}  // extern "C"

namespace {

// dlogp/da of a hidden unit from its activation t and gfw = dlogp/df times its output weight:
// tanh'(a) = 1 - t^2; relu'(a) = [t > 0]
inline v16 dlogp_da(bool tanh, v16 t, v16 gfw) {
  return tanh ? gfw * (1.f - t * t) : (t > 0.f ? gfw : splat(0.f));
}

// hidden units h .. h + M - 1: layer 0's weight gradient sum_n dlogp/da_hn x_in, eight inputs at a
// time; in the first pass over the data also the bias's (sum_n dlogp/da_hn) and the output
// weight's (sum_n dlogp/df_n t_hn)
template <int M, int64_t DC>
void backward(const PyrobdlNet& net, bool tanh, const float* T, const float* GF, const float* w1, int64_t h,
              float* g) {
  const int64_t D = DC ? DC : net.D, NP = net.NP;
  v16 accb[M] = {}, accw[M] = {};
  for (int64_t i0 = 0; i0 < D; i0 += 8) {
    const int64_t width = D - i0 < 8 ? D - i0 : 8;
    v16 acc[M][8] = {};
    for (int64_t n0 = 0; n0 < NP; n0 += L) {
      const v16 gf = load(GF + n0);
      v16 d[M];
      for (int j = 0; j < M; ++j) {
        const v16 t = load(T + (h + j) * NP + n0);
        d[j] = dlogp_da(tanh, t, gf * w1[j]);
        if (i0 == 0) {
          accb[j] += d[j];
          accw[j] += gf * t;
        }
      }
      if (width == 8) {  // the same loop with a constant count: its accumulators stay in registers
        // where D is not a template constant (one loop for both: 1.30x the CPU at D = 20, measured)
        for (int64_t k = 0; k < 8; ++k) {
          const v16 x = load(net.XT + (i0 + k) * NP + n0);
          for (int j = 0; j < M; ++j) acc[j][k] += d[j] * x;
        }
      } else {
        for (int64_t k = 0; k < width; ++k) {
          const v16 x = load(net.XT + (i0 + k) * NP + n0);
          for (int j = 0; j < M; ++j) acc[j][k] += d[j] * x;
        }
      }
    }
    for (int j = 0; j < M; ++j)
      for (int64_t k = 0; k < width; ++k) g[net.ow0 + (h + j) * D + i0 + k] += hsum(acc[j][k]);
  }
  for (int j = 0; j < M; ++j) {
    if (net.ob0 >= 0) g[net.ob0 + h + j] += hsum(accb[j]);
    g[net.ow1 + h + j] += hsum(accw[j]);
  }
}

// the log joint of one chain at th [P]; its gradient into g [P].  DC: the number of inputs when known
// at compile time (a block's inputs then stay in registers), 0 for any D
template <int64_t DC>
float chain_vg(const PyrobdlNet& net, const float* th, float* g, std::vector<float>& buf) {
  const int64_t H = net.H, D = DC ? DC : net.D, NP = net.NP;
  buf.resize(H * NP + NP + L);
  // on a 64-byte boundary: every vector load and store below then stays within one cache line
  // (malloc gives 16 bytes; split across two lines they cost 1.2-1.4x, depending on the process)
  float* T = buf.data() + ((64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64) / sizeof(float);
  // T [H][NP]: every hidden unit's activation at every data point; GF [NP]: dlogp/df
  float* GF = T + H * NP;
  const float* w0 = th + net.ow0;
  const float* w1 = th + net.ow1;
  const float b1 = net.ob1 >= 0 ? th[net.ob1] : 0.f;
  const float u = net.ou >= 0 ? th[net.ou] : 0.f;
  const float tau = net.ou >= 0 ? std::exp(u) : net.tau;
  const bool tanh = net.act == 0;
  // the Gaussian prior: -prec theta, and the log density's quadratic form
  v16 quad = splat(0.f);
  int64_t c = 0;
  for (; c + L <= net.P; c += L) {  // 16 coordinates at a time (a scalar sum is a chain of P additions)
    const v16 t = load(th + c), gc = -load(net.prior_prec + c) * t;
    store(g + c, gc);
    quad += gc * t;
  }
  float lp = hsum(quad);
  for (; c < net.P; ++c) {
    g[c] = -net.prior_prec[c] * th[c];
    lp += g[c] * th[c];
  }
  lp = 0.5f * lp + net.prior_const;
  v16 sq = splat(0.f), gb1 = splat(0.f);
  for (int64_t n0 = 0; n0 < NP; n0 += L) {
    v16 f = splat(b1);
    v16 xb[DC ? DC : 1];  // the block's inputs, when D is known
    for (int64_t i = 0; i < DC; ++i) xb[i] = load(net.XT + i * NP + n0);
    constexpr int M = 2;  // hidden units at a time (their tanh interleaved; 3 measured alike, 4 slower)
    v16 fs[M] = {};
    int64_t h = 0;
    for (; h + M <= H; h += M) {
      v16 a[M], z[M];
      for (int j = 0; j < M; ++j) a[j] = splat(net.ob0 >= 0 ? th[net.ob0 + h + j] : 0.f);
      const float* wr = w0 + h * D;
      if (DC)
        for (int64_t i = 0; i < DC; ++i)
          for (int j = 0; j < M; ++j) a[j] += wr[j * D + i] * xb[i];
      else
        for (int64_t i = 0; i < D; ++i) {
          const v16 xi = load(net.XT + i * NP + n0);
          for (int j = 0; j < M; ++j) a[j] += wr[j * D + i] * xi;
        }
      if (tanh)
        vtanhm<M>(a, z);
      else
        for (int j = 0; j < M; ++j) z[j] = a[j] < 0.f ? splat(0.f) : a[j];  // relu; NaN stays NaN
      for (int j = 0; j < M; ++j) {
        fs[j] += w1[h + j] * z[j];
        store(T + (h + j) * NP + n0, z[j]);
      }
    }
    for (; h < H; ++h) {
      const float* wr = w0 + h * D;
      v16 a = splat(net.ob0 >= 0 ? th[net.ob0 + h] : 0.f);
      if (DC)
        for (int64_t i = 0; i < DC; ++i) a += wr[i] * xb[i];
      else
        for (int64_t i = 0; i < D; ++i) a += wr[i] * load(net.XT + i * NP + n0);
      v16 z = a < 0.f ? splat(0.f) : a;
      if (tanh) vtanhm<1>(&a, &z);
      fs[0] += w1[h] * z;
      store(T + h * NP + n0, z);
    }
    for (int j = 0; j < M; ++j) f += fs[j];
    const v16 r = (load(net.y + n0) - f) * load(net.mask + n0);
    sq += r * r;
    const v16 gf = r * tau;  // dlogp/df
    gb1 += gf;
    store(GF + n0, gf);
  }
  // the backward pass over [H][NP]: dlogp/da from the stored activation and dlogp/df, and at once
  // layer 0's gradient, the biases' and the output weights' (M hidden units and eight inputs at a
  // time, their accumulators in registers)
  int64_t h = 0;
  for (; h + 2 <= H; h += 2) backward<2, DC>(net, tanh, T, GF, w1 + h, h, g);
  for (; h < H; ++h) backward<1, DC>(net, tanh, T, GF, w1 + h, h, g);
  if (net.ob1 >= 0) g[net.ob1] += hsum(gb1);
  const float s = hsum(sq);
  if (net.ou >= 0) {  // learned precision tau = e^u: likelihood, Gamma prior and Jacobian
    const float m = static_cast<float>(net.N);
    lp += 0.5f * m * (u - 1.8378770664093453f) - 0.5f * tau * s + net.gamma_const + net.a * u - net.b * tau;
    g[net.ou] += 0.5f * m - 0.5f * tau * s + net.a - net.b * tau;
  } else {
    lp += net.lik_const - 0.5f * tau * s;
  }
  return lp;
}

typedef float (*ChainVg)(const PyrobdlNet&, const float*, float*, std::vector<float>&);

// the instance for D inputs: one per D up to 16, the general one beyond
ChainVg chain_vg_for(int64_t D) {
  static const ChainVg known[] = {chain_vg<0>, chain_vg<1>, chain_vg<2>, chain_vg<3>, chain_vg<4>, chain_vg<5>,
                                  chain_vg<6>, chain_vg<7>, chain_vg<8>, chain_vg<9>, chain_vg<10>, chain_vg<11>,
                                  chain_vg<12>, chain_vg<13>, chain_vg<14>, chain_vg<15>, chain_vg<16>};
  return D >= 1 && D <= 16 ? known[D] : chain_vg<0>;
}

}  // namespace

extern "C" {

// log joint [K] and gradient [K, P] at theta [K, P]
void pyrobdl_fused_vg(const PyrobdlNet* net, const float* theta, int64_t K, float* logp, float* grad) {
  thread_local std::vector<float> buf;
  const auto vg = chain_vg_for(net->D);
  for (int64_t k = 0; k < K; ++k) logp[k] = vg(*net, theta + k * net->P, grad + k * net->P, buf);
}

// m leapfrog steps of every row: theta += scaled p, gradient g at theta, p += c g with c = step[k],
// last[k] in the final step; outputs theta_out, p_out [K, P], logp [K], grad [K, P] at the end
void pyrobdl_fused_leapfrog(const PyrobdlNet* net, const float* theta, const float* p, const float* scaled,
                            const float* step, const float* last, int64_t K, int64_t m,
                            float* theta_out, float* p_out, float* logp, float* grad) {
  thread_local std::vector<float> buf;
  const auto vg = chain_vg_for(net->D);
  const int64_t P = net->P;
  for (int64_t k = 0; k < K; ++k) {
    float* th = theta_out + k * P;
    float* pk = p_out + k * P;
    float* gk = grad + k * P;
    const float* sk = scaled + k * P;
    std::memcpy(th, theta + k * P, sizeof(float) * P);
    std::memcpy(pk, p + k * P, sizeof(float) * P);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < P; ++j) th[j] += sk[j] * pk[j];
      logp[k] = vg(*net, th, gk, buf);
      const float c = i < m - 1 ? step[k] : last[k];
      for (int64_t j = 0; j < P; ++j) pk[j] += c * gk[j];
    }
  }
}

// tanh of n floats as the kernel computes it (for the tests and the accuracy probe)
void pyrobdl_fused_tanh(const float* x, int64_t n, float* out) {
  for (int64_t i0 = 0; i0 < n; i0 += L) {
    v16 v = splat(0.f), t;
    for (int64_t i = 0; i < L && i0 + i < n; ++i) v[i] = x[i0 + i];
    vtanhm<1>(&v, &t);
    for (int64_t i = 0; i < L && i0 + i < n; ++i) out[i0 + i] = t[i];
  }
}

}  // extern "C"
