#!/bin/bash
# Issue 11's GPU checks in one call, for a machine with CUDA, PyTorch, JAX and NumPyro but no
# package index (the lent H100/H200 machines): the CUDA tests; chees end to end on the GPU at
# K = 4,096 with NumPyro NUTS on the host CPU beside it (docs/benchmarks/chees_gpu.md, "On an NVIDIA H100
# again", where K = 2,048 was measured); then, in the time left, a UCI wine reference on the GPU.
#
# Before the call, on a machine with pip (the wheels are pure Python; platformdirs is what
# ArviZ 0.23 imports and that image lacks), and with the UCI data beside the wheels (the device
# machine gets the repository only, not ../shared):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       pyro-ppl==1.9.2 pyro-api==0.1.2 arviz==0.23.4 h5netcdf==1.8.2 xarray-einstats==0.9.1 platformdirs
#   mkdir -p .whl/data/uci && cp -r ../shared/datasets/uci/wine-quality-red .whl/data/uci/
# and carry .whl (kept out of git, e.g. by .git/info/exclude). Then, from the repository root:
#   OUT=some/folder WINE_SPLIT=0 bash comparisons/benchmarks/gpu_session.sh
# Everything it writes (environment, logs, JSON lines) goes to $OUT; it ends within BUDGET_S
# seconds (default 520) so that a call with timeout_s 560 returns its files.
set -u
OUT=${OUT:?set OUT to a folder for the results}
BUDGET_S=${BUDGET_S:-520}
WINE_SPLIT=${WINE_SPLIT:-0}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5
T0=$(date +%s)
{ date -u; uptime; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; uname -r
  python3 -c "import sys,torch,jax,numpyro,pyro,arviz;print(sys.version);print(torch.__version__,jax.__version__,numpyro.__version__,pyro.__version__,arviz.__version__)"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -c "import pyrobdl" || { echo "pyrobdl does not import: a dependency is missing (see the header)"; exit 4; }

# NumPyro NUTS on the host CPU, its own process, one XLA thread (~3 minutes for both seeds)
(python3 comparisons/benchmarks/chees_gpu.py --part numpyro --seeds 0 1 --out "$OUT/numpyro.jsonl" > "$OUT/numpyro.log" 2>&1 &)

# the CUDA tests (every test that is parametrised over devices or marked cuda), before the timings
timeout 150 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_rank_diagnostics.py tests/test_certification.py \
    tests/test_checkpoint.py tests/test_chees.py tests/test_fit.py tests/test_flat.py tests/test_flat_elbo.py tests/test_gradient_variance.py \
    tests/test_inference_data.py tests/test_mcmc.py 2>&1 | tee "$OUT/tests.log"
echo "tests done at $(( $(date +%s) - T0 )) s"

# chees end to end: 150 warm-up iterations and 100 draws per chain, compiled, K = 4,096 (K = 2,048
# was measured before); the fit's convergence summary and certification now run on the GPU
timeout 200 python3 comparisons/benchmarks/chees_gpu.py --part e2e --chees-chains 4096 --compile-chains 4096 \
    --chees-warmup 150 --chees-min-samples 100 --progress --numpyro-results "$OUT/numpyro.jsonl" --out "$OUT/gpu.jsonl" 2>&1 | tee "$OUT/e2e.log"
echo "e2e done at $(( $(date +%s) - T0 )) s"

# a UCI wine reference on the GPU in the time left (512 chains in 64 superchains of 8, 300 + 300,
# extended by 100 draws per chain until certified); killed, it still leaves its progress in the log.
# Split 0 by default: its CPU reference (64 chains, certified) is the check.  E-BFMI is certified
# pooled over the chains (docs/diagnostics.md, "E-BFMI"): per chain, 512 chains of 300 draws would
# fail it on the estimator's noise alone.
LEFT=$(( BUDGET_S - 30 - ($(date +%s) - T0) ))
if [ -d .whl/data/uci ] && [ "$LEFT" -gt 60 ]; then
    timeout "$LEFT" python3 comparisons/uci_references.py --data-dir .whl/data --datasets wine --splits "$WINE_SPLIT" \
        --chains 512 --superchain 8 --superchain-starts --warmup 300 --samples 300 --extend-to 600 --extend-by 100 \
        --cert-prefixes 200 --device cuda --progress --out "$OUT/wine_gpu.jsonl" > "$OUT/wine_gpu.log" 2>&1
    echo "wine split $WINE_SPLIT: rc $? at $(( $(date +%s) - T0 )) s"; tail -c 600 "$OUT/wine_gpu.log"; echo
fi
# NumPyro's cached runs give the ratios (the e2e rows name the seeds they used)
for _ in $(seq 60); do pgrep -f "part numpyro" > /dev/null || break; sleep 2; done
echo "all done at $(( $(date +%s) - T0 )) s"
