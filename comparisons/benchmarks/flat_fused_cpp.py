r"""A hand-fused C++ loop for the chees benchmark's log joint, against the kernels pyrobdl ships.

A measurement of issue 41's "custom fused kernel" lever, not a code path of the package: one
C++ function (``torch.utils.cpp_extension.load_inline``, ``-O3 -march=native -ffast-math``; GCC
vectorizes the loops over hidden units with glibc's vector ``expf``) computes, per chain, the
1 x H tanh layer, the one output unit and the Gaussian likelihood with a learned precision in one
pass over the data, keeps the tanh values (``[N, H]``, in cache), and accumulates every gradient
in a second pass; the Gaussian prior is added by ``FlatLogJoint.log_prior``.  It is checked
against the autograd twin (``log_prob_grad_autograd``) at every K, then timed against the eager
and compiled kernels: one process, one torch thread, 5 rounds in alternating order of 0.4 s of
process CPU time, medians of CPU µs per chain-gradient.  Needs a C++ compiler (as
``compile=True`` does).

    nice -n 10 python comparisons/benchmarks/flat_fused_cpp.py
"""

from __future__ import annotations

import os
import statistics
import time
import warnings

import torch
from torch.utils.cpp_extension import load_inline

import pyrobdl
from pyrobdl.flat import FlatLogJoint

SRC = r"""
#include <torch/extension.h>
#include <cmath>
#include <vector>
// likelihood part of the 1 x H tanh MLP, one output unit, learned precision: per chain
// logp_lik [K], grad [K, P] (likelihood part, the prior added by the caller)
std::vector<torch::Tensor> fused_vg(torch::Tensor theta, torch::Tensor x, torch::Tensor y, int64_t H) {
  const int64_t K = theta.size(0), P = theta.size(1), N = x.size(0), D = x.size(1);
  auto grad = torch::zeros({K, P}, theta.options());
  auto logp = torch::empty({K}, theta.options());
  const float* X = x.data_ptr<float>(); const float* Y = y.data_ptr<float>();
  std::vector<float> w0t(D * H), dw0t(D * H), S(N * H), r(N), db0(H), dw1(H);
  const float LOG2PI = std::log(2.0f * (float)M_PI);
  for (int64_t k = 0; k < K; ++k) {
    const float* th = theta.data_ptr<float>() + k * P;
    const float* w0 = th; const float* b0 = th + H * D; const float* w1 = b0 + H;
    const float b1 = w1[H]; const float u = w1[H + 1]; const float tau = std::exp(u);
    for (int64_t h = 0; h < H; ++h) for (int64_t i = 0; i < D; ++i) w0t[i * H + h] = w0[h * D + i];
    float sq = 0.f;
    for (int64_t n = 0; n < N; ++n) {
      float* s = S.data() + n * H; const float* xn = X + n * D;
      for (int64_t h = 0; h < H; ++h) s[h] = b0[h];
      for (int64_t i = 0; i < D; ++i) { const float xi = xn[i]; const float* wi = w0t.data() + i * H;
        for (int64_t h = 0; h < H; ++h) s[h] += xi * wi[h]; }
      float fn = 0.f;
      for (int64_t h = 0; h < H; ++h) { const float t = 1.f - 2.f / (std::exp(2.f * s[h]) + 1.f); s[h] = t; fn += w1[h] * t; }
      const float rn = Y[n] - (fn + b1); r[n] = rn * tau; sq += rn * rn;
    }
    logp.data_ptr<float>()[k] = 0.5f * N * (u - LOG2PI) - 0.5f * tau * sq;
    std::fill(dw0t.begin(), dw0t.end(), 0.f); std::fill(db0.begin(), db0.end(), 0.f); std::fill(dw1.begin(), dw1.end(), 0.f);
    float db1 = 0.f;
    for (int64_t n = 0; n < N; ++n) {
      const float* s = S.data() + n * H; const float* xn = X + n * D; const float gn = r[n]; db1 += gn;
      float g[1024];
      for (int64_t h = 0; h < H; ++h) { const float t = s[h]; dw1[h] += gn * t; g[h] = gn * w1[h] * (1.f - t * t); db0[h] += g[h]; }
      for (int64_t i = 0; i < D; ++i) { const float xi = xn[i]; float* di = dw0t.data() + i * H;
        for (int64_t h = 0; h < H; ++h) di[h] += xi * g[h]; }
    }
    float* gr = grad.data_ptr<float>() + k * P;
    for (int64_t h = 0; h < H; ++h) for (int64_t i = 0; i < D; ++i) gr[h * D + i] = dw0t[i * H + h];
    for (int64_t h = 0; h < H; ++h) { gr[H * D + h] = db0[h]; gr[H * D + H + h] = dw1[h]; }
    gr[H * D + 2 * H] = db1; gr[H * D + 2 * H + 1] = 0.5f * N - 0.5f * tau * sq;
  }
  return {logp, grad};
}
"""

def build():
    """Compile (or load from torch's extension cache) the C++ function."""
    return load_inline("flat_fused_proto", cpp_sources=SRC, functions=["fused_vg"],
                       extra_cflags=["-O3", "-march=native", "-ffast-math"], build_directory=None, verbose=False)

def main():
    torch.set_num_threads(1)
    t0 = time.process_time(); mod = build(); print("build cpu s", time.process_time() - t0, flush=True)
    N, D, H = 500, 8, 50
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, D, generator=g), torch.randn(N, generator=g)
    model = pyrobdl.BayesianMLP(D, (H,), 1, activation="tanh", prior=pyrobdl.priors.Gaussian(1.0),
                                likelihood=pyrobdl.likelihoods.GaussianLearnedPrecision(6.0, 6.0))
    ref = FlatLogJoint(model, x, y, chunk_size="auto")
    assert [s.name for s in ref.layout.sites] == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "precision"]
    def fused(theta):
        lp, gp = ref.log_prior(theta)
        v, gg = mod.fused_vg(theta, x, y, H)
        return v + lp, gg + gp
    for K in (8, 64, 256):
        theta = ref.sample_prior(K, generator=g) * 0.3
        v0, g0 = ref.log_prob_grad_autograd(theta)
        v1, g1 = fused(theta)
        print(f"K={K} fused vs autograd: value max abs {float((v1 - v0).abs().max()):.2e}, grad max rel {float((g1 - g0).abs().max() / g0.abs().max()):.2e}", flush=True)
        comp = FlatLogJoint(model, x, y, chunk_size="auto")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore"); comp.compile(K)
        cands = {"eager auto": ref.value_and_grad, "compiled auto": comp.value_and_grad, "fused C++ prototype": fused}
        times = {n: [] for n in cands}
        for r in range(5):
            for n in (list(cands) if r % 2 == 0 else list(cands)[::-1]):
                f = cands[n]; f(theta)
                reps, st = 0, time.process_time()
                while time.process_time() - st < 0.4:
                    f(theta); reps += 1
                times[n].append((time.process_time() - st) / reps / K * 1e6)
        for n, v in times.items():
            print(f"K={K} {n:22s} median {statistics.median(v):6.1f} min {min(v):6.1f}", flush=True)
    print("load", os.getloadavg())

if __name__ == "__main__":
    main()
