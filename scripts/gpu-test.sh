#!/usr/bin/env bash
# gpu-test.sh: the whole GPU check of zero in one command, within a budget of
# 5 minutes, on a host that has no Go. `make gpu-test` (on any machine with
# Go) builds gpu/zero.test with -tags cuda and copies this script and
# bench/torch_pipeline.py beside it; copy gpu/ to the GPU host and run
#
#   gpu/gpu-test.sh                  # writes $OUT (default gpu/out)
#
# Steps, in this order, each under `timeout` within the global budget
# (BUDGET seconds, default 300):
#   tests       every CUDA/NCCL/GPU/NVML test, with ZERO_REQUIRE_GPU=1 (a test
#               that would skip fails instead)
#   kernels     kernel bandwidth against a device-to-device copy
#   pipeline    the seed-000 pipeline, ZeRO-1/2/3 (BenchmarkCUDAPipeline)
#   offload     pinned copy bandwidth against the host link's limit, and the
#               offloaded step (BenchmarkCUDAOffloadCopy, BenchmarkCUDAOffloadStep)
#   params      parameter offload: a gather's host-to-device copy against a
#               plain cuMemcpyAsync of the same size from page-locked memory,
#               and the stage-3 step at seed 000's shape with and without the
#               parameter shard on the host (BenchmarkCUDAParamOffloadCopy,
#               BenchmarkCUDAParamOffloadStep)
#   torch       the same pipeline in PyTorch eager ops (torch_pipeline.py)
#   memcheck    compute-sanitizer memcheck on the kernel tests
#   racecheck   compute-sanitizer racecheck on the kernels with shared memory
# A step the host cannot run (no GPU, no torch, no compute-sanitizer, or a
# sanitizer refused on a virtualised GPU) is recorded as skipped with the
# reason, and the runner goes on. Every log and summary.txt go into $OUT;
# the summary is printed last. The exit status is 1 if a step failed.
#
# Needs on the host: an NVIDIA driver for CUDA 12.0 or newer (libcuda.so.1),
# python3 with the nvidia pip packages or torch (for libnccl.so.2), and
# compute-sanitizer for the sanitizer steps (on PATH, or under
# $CUDA_HOME/bin or /usr/local/cuda/bin). Nothing of the CUDA toolkit is
# needed to run the tests: the kernels are in the binary.
set -uo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin="$here/zero.test"
out=${OUT:-$here/out}
budget=${BUDGET:-300}
py=${PYTHON:-python3}
mkdir -p "$out"
summary="$out/summary.txt"
start=$(date +%s)
: >"$summary"
[[ -x $bin ]] || { echo "gpu-test: $bin is missing; run make gpu-test on a machine with Go and copy gpu/ here" | tee -a "$summary" >&2; exit 2; }

note() { echo "$*" | tee -a "$summary"; }
left() { echo $((budget - ($(date +%s) - start))); }

# The nvidia packages' library folders (nvidia/*/lib) and torch/lib, for
# libnccl.so.2, in one python3 call.
libs=$("$py" -c '
import glob, importlib.util, os
dirs = []
spec = importlib.util.find_spec("nvidia")
for root in (list(spec.submodule_search_locations) if spec else []):
    dirs += sorted(glob.glob(os.path.join(root, "*", "lib")))
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

gpu=$(nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader 2>/dev/null)
{
	echo "gpu-test on $(hostname) at $(date -u +%FT%TZ), budget ${budget}s"
	echo "GPU: ${gpu:-none (nvidia-smi found no GPU)}"
	echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
	echo "compute-sanitizer: ${sanitizer:-not found}"
} >"$out/host.txt"
cat "$out/host.txt"
note "host: ${gpu:-no GPU}"

status=0
# step NAME SECONDS CMD...: run CMD under timeout (at most what the budget
# has left), log to $OUT/NAME.log, and record pass, fail or timeout.
step() {
	local name=$1 want=$2
	shift 2
	local t
	t=$(left)
	((t > want)) && t=$want
	if ((t < 5)); then
		note "$name: skipped: the ${budget}s budget is spent"
		return
	fi
	local t0=$(date +%s)
	timeout --kill-after=5 "$t" "$@" >"$out/$name.log" 2>&1
	local rc=$? dt=$(($(date +%s) - t0))
	case $rc in
	0) note "$name: pass (${dt}s)" ;;
	124 | 137) note "$name: FAIL: timed out after ${t}s"; status=1 ;;
	*) note "$name: FAIL (exit $rc, ${dt}s): $(grep -m3 -E -- '--- FAIL|FAIL|rror' "$out/$name.log" | tr '\n' ' ' | cut -c1-300)"; status=1 ;;
	esac
}

skip() { note "$1: skipped: $2"; }

cd "$here"
if [[ -z $gpu ]]; then
	# no GPU: the test step still runs (every GPU test must skip and say why)
	step tests 60 "$bin" -test.v -test.count=1 -test.run 'CUDA|NCCL|GPU|NVML|Bootstrap'
	# each skipped test with its reason (the line go test prints before it)
	awk '/^--- SKIP: /{r=prev; sub(/^ +[a-z_]+\.go:[0-9]+: /, "", r); print "  " $3 ": " substr(r, 1, 150)} {prev=$0}' "$out/tests.log" >>"$summary"
	for s in kernels pipeline offload params torch memcheck racecheck; do skip "$s" "no GPU on this host"; done
else
	step tests 120 env ZERO_REQUIRE_GPU=1 "$bin" -test.v -test.count=1 -test.run 'CUDA|NCCL|GPU|NVML|Bootstrap'
	step kernels 40 "$bin" -test.run '^$' -test.bench 'CUDAKernelBandwidth' -test.benchtime "${BENCHTIME:-10x}"
	step pipeline 40 "$bin" -test.run '^$' -test.bench 'CUDAPipeline' -test.benchtime "${BENCHTIME:-10x}"
	step offload 60 "$bin" -test.run '^$' -test.bench 'CUDAOffload' -test.benchtime "${BENCHTIME:-10x}" -test.v
	step params 60 "$bin" -test.run '^$' -test.bench 'CUDAParamOffload' -test.benchtime "${BENCHTIME:-10x}" -test.v
	if "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
		step torch 40 "$py" "$here/torch_pipeline.py"
	else
		skip torch "python3 has no torch with CUDA"
	fi
	if [[ -z $sanitizer ]]; then
		skip memcheck "compute-sanitizer not found (CUDA toolkit, CUDA_HOME)"
		skip racecheck "compute-sanitizer not found"
	else
		for tool in memcheck racecheck; do
			# racecheck: the kernels that use shared memory (sums of squares:
			# the whole-shard reference, the landing's and the chunks')
			run='TestCUDAKernels|TestCUDAGroupCollectives'
			[[ $tool == racecheck ]] && run='TestCUDAKernels(SumSquares|AccumulateSquares|ChunkSquares|SumChunks)'
			step "$tool" 40 env GODEBUG=asyncpreemptoff=1 "$sanitizer" --tool "$tool" --error-exitcode 1 \
				--target-processes all "$bin" -test.count=1 -test.run "$run"
			if grep -q -E 'not supported|Device not supported|unable to|Target application returned an error.*initialize' "$out/$tool.log" &&
				! grep -q -E 'ERROR SUMMARY: [1-9]|Invalid|Race reported' "$out/$tool.log"; then
				sed -i "\$d" "$summary" # the host refused the tool: not a failure of zero
				skip "$tool" "refused by this host: $(grep -m1 -E 'not supported|unable to' "$out/$tool.log" | cut -c1-200)"
			fi
		done
	fi
	# the figures, for BENCHMARKS.md
	grep -h -E '^Benchmark|PCIe gen' "$out/kernels.log" "$out/pipeline.log" "$out/offload.log" "$out/params.log" 2>/dev/null >"$out/bench.txt"
	grep -h -E '^\{' "$out/torch.log" 2>/dev/null >>"$out/bench.txt"
fi

note "gpu-test: $([[ $status == 0 ]] && echo PASS || echo FAIL) in $(($(date +%s) - start))s; logs in $out"
echo
echo "==== summary ($summary)"
cat "$summary"
exit $status
