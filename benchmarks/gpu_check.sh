#!/usr/bin/env bash
# GPU check, one CUDA device, one call. The device image has python3 with a CUDA torch but
# no fairseq: `make gpu-wheels` (run here, on the CPU machine) puts fairseq-fixed,
# fairscale and their pure-Python dependencies into .whl/, which the call carries.
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# Results land in benchmarks/results/gpu_check.{md,json} (and are copied to $OUT if set).
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
timeout 480 python3 -m benchmarks.gpu_check
if [ -n "${OUT:-}" ]; then cp benchmarks/results/gpu_check.* "$OUT"/; fi
