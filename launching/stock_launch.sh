#!/usr/bin/env bash
# Launch stock fairseq-train (no plugin) as one torchrun rank on a CPU machine.
# Stock fairseq computes its device id as rank % cuda_device_count (ZeroDivisionError on
# CPU) and defaults the world size to the CUDA device count, so pass both explicitly.
# Usage: torchrun --nproc_per_node N --no-python launching/stock_launch.sh ARGS...
# FAIRSEQ_TRAIN may name another entry point, e.g. "fairseq-shard-measure-train --measure-out F".
exec ${FAIRSEQ_TRAIN:-fairseq-train} "$@" --distributed-world-size "$WORLD_SIZE" --distributed-rank "$RANK" \
    --distributed-init-method env:// --distributed-no-spawn --device-id 0 \
    --distributed-backend gloo
