#!/usr/bin/env bash
# mpi_step.sh: a whole training step, zero over MPI against DeepSpeed on
# gloo, side by side: the same model (LAYERS fp32 weights of HIDDEN x HIDDEN,
# fixed gradients), config (ZeRO-2, buckets of 2^22 elements, AdamW lr 1e-3,
# weight decay 0.01) and W processes; steps per second over STEPS steps after
# 3 warm-up steps, and the CPU. Not in CI.
#
#   W=2 LAYERS=8 HIDDEN=1024 STEPS=20 VENV=venv-ds bench/mpi_step.sh
#
# VENV holds DeepSpeed 0.19.8 and torch 2.15.0:
#   python3 -m venv venv-ds && venv-ds/bin/pip install torch==2.15.0 deepspeed==0.19.8
# The first DeepSpeed run builds its CPU communication op (minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
W=${W:-2}
LAYERS=${LAYERS:-8}
HIDDEN=${HIDDEN:-1024}
STEPS=${STEPS:-20}
VENV=${VENV:-venv-ds}

mpi=$(scripts/install-mpi.sh)
lscpu | grep -m1 'Model name' || true
echo "W=$W, $LAYERS x ${HIDDEN}x$HIDDEN fp32 parameters, ZeRO-2, AdamW, $STEPS steps"
go test -c -o /tmp/zero-step.test .
ZERO_BENCH_LAYERS=$LAYERS ZERO_BENCH_HIDDEN=$HIDDEN ZERO_MPI_LIBRARY="$mpi/lib/libmpi.so.12" \
	"$mpi/bin/mpiexec" -n "$W" /tmp/zero-step.test -test.run '^$' -test.bench BenchmarkMPIStep -test.benchtime "${STEPS}x" |
	grep steps/s | sed 's/^/zero over MPI: /'
"$VENV/bin/torchrun" --nproc-per-node "$W" bench/deepspeed_step.py --layers "$LAYERS" --hidden "$HIDDEN" --steps "$STEPS" 2>&1 |
	grep steps/s
