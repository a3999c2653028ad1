#!/usr/bin/env bash
# GPU check, one CUDA device, one call. The device image has python3 with a CUDA torch but
# no fairseq: `make gpu-wheels` (run here, on the CPU machine) puts fairseq-fixed,
# fairscale and their pure-Python dependencies into .whl/, which the call carries.
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Two parts, each copied to $OUT (if set) as soon as it is done, so a timeout keeps the first:
#   1. benchmarks/results/gpu_check.{md,json}: four trainings at the NLLB-600M shape, world
#      size 1 (stock fairseq's fairscale path as shipped, the plugin's two engines, the
#      NLLB configs' memory features), CUDA peak allocated and reserved;
#   2. benchmarks/results/gpu_memory_600m.{md,json,png}: the 600M table (README, docs/memory.md) measured
#      with CUDA statistics, per rank at world size 2 (fake process group, one device).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
SITE=/tmp/fairseq-site
if ! python3 -c "import fairseq" 2>/dev/null; then
    [ -d .whl ] || { echo "no fairseq and no .whl/: run 'make gpu-wheels' first" >&2; exit 2; }
    # fairseq-fixed is an sdist: it compiles its extensions against the local torch.
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" \
        .whl/*.whl .whl/*.tar.gz
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" .
    export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv
keep() { if [ -n "${OUT:-}" ]; then cp benchmarks/results/"$1".* "$OUT"/ 2>/dev/null || true; fi; }
timeout 380 python3 -m benchmarks.gpu_check || echo "gpu_check: exit $?" >&2
keep gpu_check
timeout 240 python3 -m benchmarks.memory --cuda --name gpu_memory_600m --configurations \
    stock-policy,plugin,plugin+chunked-loss+ac,plugin+chunked-loss+ac+16-bit-vocab-reduce+vocab-gathered \
    || echo "benchmarks.memory: exit $?" >&2
keep gpu_memory_600m
