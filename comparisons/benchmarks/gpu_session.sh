#!/bin/bash
# Issue 43's GPU checks in one call (or two on the same warm machine), for a machine with CUDA,
# PyTorch, JAX, NumPyro and optax but no package index (the lent H100/H200 machines):
#   A. the CUDA tests, with the quickstart suite on the GPU beside them (it only launches small
#      kernels), and the same cells on the host CPU (pinned to its last cores, one thread per
#      worker, no CUDA) for the whole call: CPU-vs-GPU seconds per method;
#   B. chees vs BlackJAX ChEES vs NumPyro NUTS (chain_method="vectorized"), all on the GPU, the
#      1x50 benchmark BNN, K = 512 then 4,096, 150 warm-up + 100 draws per chain
#      (comparisons/benchmarks/chees_vs_blackjax.py: one sampler at one K per process, each with its
#      own time limit from what is left);
#   C. the quickstart on the GPU resumed (its finished cells are kept), in the time left;
#   D. a wine reference with 512 chains (superchains of 8), if time is left, against its CPU
#      reference (only when the data travelled, below).
# Every phase writes under $WORK (default /tmp/gpu_session) and marks itself done there, so a second
# call on the same warm machine resumes where the first stopped.  At the end everything is packed
# into $OUT/session.tar.gz, with $OUT/summary.txt and $OUT/samplers.jsonl beside it.
#
# Before the call, on a machine with pip (the wheels are pure Python; the device image has JAX,
# NumPyro, optax, scipy, xarray, pandas, h5py but not these), from the repository root:
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       pyro-ppl==1.9.2 pyro-api==0.1.2 arviz==0.23.4 h5netcdf==1.8.2 xarray-einstats==0.9.1 platformdirs \
#       blackjax==1.7.1
#   mkdir -p .whl/data/uci && cp -r ../shared/datasets/uci/wine-quality-red .whl/data/uci/   # optional (D)
# and carry .whl.  Then:  OUT=some/folder BUDGET_S=540 bash comparisons/benchmarks/gpu_session.sh
# (timeout_s ~30 s above BUDGET_S).  `bash comparisons/benchmarks/gpu_session.sh --smoke` runs every
# phase on the CPU with tiny sizes and one K (tests/test_gpu_session.py does, marked slow).
set -u
SMOKE=0
[ "${1:-}" = "--smoke" ] && SMOKE=1
OUT=${OUT:?set OUT to a folder for the results}
BUDGET_S=${BUDGET_S:-540}
WORK=${WORK:-/tmp/gpu_session}
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
mkdir -p "$OUT" "$WORK"
if [ "$SMOKE" = 0 ] && [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=5 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=python3
command -v python3 > /dev/null || PY=python
CLI="$PY -c 'import sys; from pyrobdl.cli import main; sys.exit(main())'"
if [ "$SMOKE" = 1 ]; then
    DEV=cpu; KS="8"; WARM=20; DRAWS=20; TREE="--max-tree-depth 4"; ONLY="dataset=blr,method=map"; TESTS_S=60; QS_A_S=60; WORKERS=1
    # the JAX samplers on the CPU: one XLA thread, like torch's
    export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
else
    DEV=cuda; KS="512 4096"; WARM=150; DRAWS=100; TREE=""; ONLY="dataset=gap"; TESTS_S=100; QS_A_S=110; WORKERS=3
fi
echo "smoke=$SMOKE device=$DEV budget=${BUDGET_S}s work=$WORK"

# ---- the machine
if [ ! -f "$WORK/env.txt" ]; then
    { date -u; uptime; nproc; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; uname -r
      $PY -c "import sys,torch,pyro,arviz;print(sys.version);print('torch',torch.__version__,'cuda',torch.cuda.is_available(),'pyro',pyro.__version__,'arviz',arviz.__version__)"
      $PY -c "import jax,numpyro,blackjax,optax;print('jax',jax.__version__,'numpyro',numpyro.__version__,'blackjax',blackjax.__version__,'optax',optax.__version__);print('jax.devices()',jax.devices())"
      git log -1 --format='commit %h %s' 2>/dev/null; } > "$WORK/env.txt" 2>&1
fi
cat "$WORK/env.txt"
$PY -c "import pyrobdl" || { echo "pyrobdl does not import: a dependency is missing (see the header)"; exit 4; }

# ---- A. the quickstart's cells on the host CPU (whole call, last cores) and on the GPU beside the CUDA tests
NCPU=$(nproc)
PIN=""
[ "$SMOKE" = 0 ] && [ "$NCPU" -ge 8 ] && PIN="taskset -c $(( NCPU - 4 ))-$(( NCPU - 1 ))"
quickstart() {  # device, out folder, seconds
    timeout -s TERM "$3" bash -c "$CLI compare comparisons/quickstart.toml --out $2 --device $1 --only $ONLY --workers $WORKERS" \
        >> "$2.log" 2>&1
    echo "quickstart on $1: rc $? at $(( $(date +%s) - T0 )) s" | tee -a "$WORK/phases.log"
}
if [ ! -f "$WORK/qs_cpu.done" ]; then
    ( export CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
      $PIN true 2> /dev/null || PIN=""
      timeout -s TERM $(( $(left) - 20 )) $PIN bash -c "$CLI compare comparisons/quickstart.toml --out $WORK/qs_cpu --device cpu --only $ONLY --workers $WORKERS" \
          >> "$WORK/qs_cpu.log" 2>&1 && touch "$WORK/qs_cpu.done"
      echo "quickstart on cpu (twin): rc $? at $(( $(date +%s) - T0 )) s" >> "$WORK/phases.log" ) &
fi
if [ ! -f "$WORK/tests.done" ]; then
    QS_PID=""
    if [ "$SMOKE" = 0 ]; then quickstart cuda "$WORK/qs_gpu" "$QS_A_S" & QS_PID=$!; fi
    timeout "$TESTS_S" $PY -m pytest -q -p no:cacheprovider -k cuda tests/test_rank_diagnostics.py tests/test_certification.py \
        tests/test_checkpoint.py tests/test_chees.py tests/test_fit.py tests/test_flat.py tests/test_flat_elbo.py \
        tests/test_gradient_variance.py tests/test_inference_data.py tests/test_mcmc.py > "$WORK/tests.log" 2>&1
    echo "CUDA tests: rc $? at $(( $(date +%s) - T0 )) s; $(tail -n 1 "$WORK/tests.log")" | tee -a "$WORK/phases.log"
    touch "$WORK/tests.done"
    [ -n "$QS_PID" ] && wait "$QS_PID"   # the GPU quickstart of phase A, not the CPU twin
fi

# ---- B. the three samplers; each run's limit is what is left less a reserve for packing up
sampler() {  # name K cap_s
    local tag="$1_$2" lim
    [ -f "$WORK/$tag.done" ] && return
    lim=$(( $(left) - 25 )); [ "$lim" -gt "$3" ] && lim=$3
    if [ "$lim" -lt 20 ]; then echo "$tag: skipped, ${lim}s left" | tee -a "$WORK/phases.log"; return; fi
    local extra=""; [ "$1" = chees ] && extra="--compile"
    timeout "$lim" $PY comparisons/benchmarks/chees_vs_blackjax.py --sampler "$1" --chains "$2" --device $DEV \
        --warmup $WARM --samples $DRAWS $TREE $extra --out "$WORK/samplers.jsonl" > "$WORK/$tag.log" 2>&1
    local rc=$?
    echo "$tag: rc $rc (limit ${lim}s) at $(( $(date +%s) - T0 )) s" | tee -a "$WORK/phases.log"
    [ "$rc" = 0 ] && touch "$WORK/$tag.done"
}
set -- $KS
sampler blackjax "$1" 80; sampler chees "$1" 110; sampler numpyro "$1" 120
if [ -n "${2:-}" ]; then sampler blackjax "$2" 100; sampler chees "$2" 200; fi
QS_B=$(( $(left) - 150 ))  # C first, leaving NumPyro K = 4,096 its turn after
if [ "$SMOKE" = 0 ] && [ "$QS_B" -gt 30 ]; then quickstart cuda "$WORK/qs_gpu" "$QS_B"; fi
[ -n "${2:-}" ] && sampler numpyro "$2" 150
[ -f "$WORK/samplers.jsonl" ] && $PY comparisons/benchmarks/chees_vs_blackjax.py --table "$WORK/samplers.jsonl" > "$WORK/samplers.md" 2>&1

# ---- C. the quickstart on the GPU, resumed in the time left
if [ "$SMOKE" = 0 ] && [ "$(left)" -gt 50 ]; then quickstart cuda "$WORK/qs_gpu" $(( $(left) - 25 )); fi
if [ "$SMOKE" = 1 ]; then quickstart cpu "$WORK/qs_gpu" $(( $(left) - 25 )); fi   # the smoke run: phase C's path on the CPU

# ---- D. a wine reference on the GPU, if the data travelled and time is left
if [ "$SMOKE" = 0 ] && [ -d .whl/data/uci ] && [ "$(left)" -gt 120 ]; then
    timeout $(( $(left) - 25 )) $PY comparisons/uci_references.py --data-dir .whl/data --datasets wine --splits 0 \
        --chains 512 --superchain 8 --superchain-starts --warmup 300 --samples 300 --extend-to 600 --extend-by 100 \
        --cert-prefixes 200 --device cuda --progress --out "$WORK/wine_gpu.jsonl" > "$WORK/wine_gpu.log" 2>&1
    echo "wine: rc $? at $(( $(date +%s) - T0 )) s" | tee -a "$WORK/phases.log"
fi

# ---- pack up (the CPU twin is stopped first if it still runs: its finished cells are on disk)
pkill -TERM -f "qs_cpu --device cpu" 2> /dev/null; sleep 2
{ cat "$WORK/env.txt"; echo; cat "$WORK/phases.log"; echo; cat "$WORK/samplers.md" 2> /dev/null; echo
  tail -n 3 "$WORK/tests.log"; } > "$OUT/summary.txt" 2>&1
cp "$WORK/samplers.jsonl" "$OUT/" 2> /dev/null
tar czf "$OUT/session.tar.gz" -C "$WORK" --exclude='*.pt' --exclude='*.npz' --exclude='*.nc' . 2> /dev/null
cat "$OUT/summary.txt"
echo "all done at $(( $(date +%s) - T0 )) s"
