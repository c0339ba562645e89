#!/usr/bin/env bash
# gpu-test.sh: run zero's CUDA tests and benchmarks on a GPU host that has no
# Go. `make gpu-test` (on any machine with Go) builds gpu/zero.test with
# -tags cuda and copies this script and bench/torch_pipeline.py beside it;
# copy the gpu/ folder to the GPU host and run:
#
#   gpu/gpu-test.sh                 # tests, compute-sanitizer, benchmarks, torch comparison
#   SANITIZE=0 BENCH=0 gpu/gpu-test.sh   # tests only
#
# Needs on the host: an NVIDIA driver for CUDA 13, python3 with the nvidia
# pip packages (PyTorch's NCCL: nvidia/nccl/lib), compute-sanitizer for the
# sanitizer runs (from the CUDA toolkit: on PATH, or under $CUDA_HOME/bin or
# /usr/local/cuda/bin), and torch for the comparison. The CUDA runtime is
# linked statically into zero.test; NCCL is dlopen'ed from LD_LIBRARY_PATH.
# Output goes to the terminal and to gpu-test.log beside the script.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin="$here/zero.test"
log="$here/gpu-test.log"
py=${PYTHON:-python3}
[[ -x $bin ]] || { echo "gpu-test: $bin is missing; run make gpu-test on a machine with Go and copy gpu/ here" >&2; exit 2; }

# The nvidia packages' library folders (nvidia/*/lib, nvidia/cu13/lib) and
# torch/lib, in one python3 call.
libs=$("$py" -c '
import glob, importlib.util, os
dirs = []
spec = importlib.util.find_spec("nvidia")
for root in (list(spec.submodule_search_locations) if spec else []):
    dirs += sorted(glob.glob(os.path.join(root, "*", "lib"))) + sorted(glob.glob(os.path.join(root, "cu13", "lib")))
t = importlib.util.find_spec("torch")
if t and t.origin:
    dirs.append(os.path.join(os.path.dirname(t.origin), "lib"))
print(":".join(d for d in dict.fromkeys(dirs) if os.path.isdir(d)))
' 2>/dev/null)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

sanitizer=$(command -v compute-sanitizer || true)
for c in "${CUDA_HOME:-/nonexistent}/bin/compute-sanitizer" /usr/local/cuda/bin/compute-sanitizer; do
	[[ -z $sanitizer && -x $c ]] && sanitizer=$c
done

status=0
run() { # run a step, log it, remember a failure
	echo "== $*" | tee -a "$log"
	"$@" 2>&1 | tee -a "$log"
	local rc=${PIPESTATUS[0]}
	if [[ $rc -ne 0 ]]; then
		echo "== FAILED ($rc): $*" | tee -a "$log"
		status=1
	fi
}

: >"$log"
{
	echo "gpu-test on $(hostname) at $(date -u +%FT%TZ)"
	nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 || echo "nvidia-smi: not available"
	echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
	echo "compute-sanitizer: ${sanitizer:-not found}"
} | tee -a "$log"

cd "$here"
# On the GPU host a GPU test that would skip (no device, a driver too old for
# the CUDA 13 runtime, no NCCL) fails instead.
export ZERO_REQUIRE_GPU=${ZERO_REQUIRE_GPU:-1}
# 1. every CUDA, NCCL and GPU test (the CPU suite too with ALL=1)
pattern='CUDA|NCCL|GPU|NVML|Bootstrap'
[[ ${ALL:-0} == 1 ]] && pattern='.'
run "$bin" -test.v -test.count=1 -test.timeout=30m -test.run "$pattern"

# 2. the kernel tests under compute-sanitizer: memcheck and racecheck
if [[ ${SANITIZE:-1} == 1 ]]; then
	if [[ -n $sanitizer ]]; then
		for tool in memcheck racecheck; do
			run env GODEBUG=asyncpreemptoff=1 "$sanitizer" --tool "$tool" --error-exitcode 1 --target-processes all \
				"$bin" -test.count=1 -test.timeout=30m -test.run 'TestCUDAKernels|TestCUDAGroupCollectives'
		done
	else
		echo "== SKIPPED compute-sanitizer: not found (install the CUDA toolkit or set CUDA_HOME)" | tee -a "$log"
	fi
fi

# 3. benchmarks: kernel bandwidth against a device copy, the seed-000 pipeline,
#    then the same pipeline in PyTorch eager ops on the same GPU
if [[ ${BENCH:-1} == 1 ]]; then
	run "$bin" -test.run '^$' -test.bench 'CUDA' -test.benchtime "${BENCHTIME:-20x}" -test.timeout=30m
	if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
		run "$py" "$here/torch_pipeline.py"
	else
		echo "== SKIPPED torch_pipeline.py: python3 has no torch with CUDA" | tee -a "$log"
	fi
fi

echo "gpu-test: $([[ $status == 0 ]] && echo PASS || echo FAIL); log in $log" | tee -a "$log"
exit $status
