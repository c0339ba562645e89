#!/usr/bin/env bash
# gpu-test.sh: the whole GPU check of zero, and every GPU figure it owes, in
# one command within a budget of 8 minutes, on a host that has no Go.
# `make gpu-test` (on any machine with Go) builds gpu/zero.test with -tags
# cuda and copies this script and bench/torch_pipeline.py beside it; copy
# gpu/ to the GPU host and run
#
#   gpu/gpu-test.sh                    # writes $OUT (default gpu/out)
#   ZERO_FAKE_CUDA=1 gpu/gpu-test.sh   # a rehearsal against the fake driver
#                                      # (from the repository root, which
#                                      # holds its source; BENCHTIME 1x)
#
# Steps, in the order of STEPS below, each under `timeout` within the global
# budget (BUDGET seconds, default 480). Each figure of BENCHMARKS.md that a
# GPU owes names the step that makes it.
#   tests       every CUDA/NCCL/GPU/NVML test, with ZERO_REQUIRE_GPU=1 (a test
#               that would skip fails instead); the two below run apart
#   registers   each kernel's registers, spills and shared memory from the
#               driver (TestCUDAKernelRegisters; kernels.json)
#   estimate    Estimate's device bytes against NVML's used memory around New
#               and three steps (TestGPUEstimateNVML)
#   kernels     kernel bandwidth against a device-to-device copy, the norm's
#               kernels among them (BenchmarkCUDAKernelBandwidth)
#   pipeline    seed 000's rows: ZeRO-1/2/3 × baseline, no_sync, coalesce,
#               coalesce under a budget (BenchmarkCUDAPipeline)
#   exposed     the reductions backward leaves exposed (BenchmarkCUDAExposedReduce)
#   norm        the norm summed by the landing against its own pass
#               (BenchmarkCUDANormInLanding)
#   offload     the engine's page-locked copies against plain ones and the
#               host link, and the offloaded step (BenchmarkCUDAOffloadCopy,
#               BenchmarkCUDAOffloadStep)
#   params      parameter offload: a gather's host-to-device copy against a
#               plain cuMemcpyAsync of the same size from page-locked memory,
#               and the stage-3 step at seed 000's shape with and without the
#               parameter shard on the host (BenchmarkCUDAParamOffloadCopy,
#               BenchmarkCUDAParamOffloadStep)
#   checkpoint  Save/Load and the safetensors export/import from device
#               memory (BenchmarkCUDACheckpoint, BenchmarkCUDASafetensors)
#   torch       the same pipeline in PyTorch eager ops (torch_pipeline.py)
#   memcheck    compute-sanitizer memcheck on the kernel tests
#   racecheck   compute-sanitizer racecheck on the kernels with shared memory
# A step the host cannot run (no GPU, no torch, no compute-sanitizer, or a
# sanitizer refused on a virtualised GPU) is recorded as skipped with the
# reason, and the runner goes on. Without a GPU the Go steps still run, so
# that every test and benchmark they name is seen to skip and say why; a
# step whose pattern matches nothing fails.
#
# What comes back, in $OUT (few files: a GPU lease returns at most 8):
#   summary.txt   the host, then one line per step (pass, FAIL, skipped: why)
#   figures.txt   every figure: benchmark lines, the tests' "figure:" lines,
#                 the PyTorch script's JSON
#   kernels.json  the registers step's record
#   logs.tar.gz   every step's whole log (logs/NAME.log) and host.txt
# The summary is printed last. The exit status is 1 if a step failed.
#
# Adding a step: a function step_NAME (calling gotest, bench or run_step)
# and its name in STEPS.
#
# Needs on the host: an NVIDIA driver for CUDA 12.0 or newer (libcuda.so.1),
# python3 with the nvidia pip packages or torch (for libnccl.so.2), and
# compute-sanitizer for the sanitizer steps (on PATH, or under
# $CUDA_HOME/bin or /usr/local/cuda/bin). Nothing of the CUDA toolkit is
# needed to run the tests: the kernels are in the binary.
set -uo pipefail

STEPS=(
	tests
	registers
	estimate
	kernels
	pipeline
	exposed
	norm
	offload
	params
	checkpoint
	torch
	memcheck
	racecheck
)

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin="$here/zero.test"
out=${OUT:-$here/out}
budget=${BUDGET:-480}
py=${PYTHON:-python3}
fake=${ZERO_FAKE_CUDA:-}
benchtime=${BENCHTIME:-10x}
[[ $fake == 1 ]] && benchtime=${BENCHTIME:-1x}
mkdir -p "$out"
out=$(cd "$out" && pwd)
logs="$out/logs"
rm -rf "$logs" "$out/logs.tar.gz" "$out/kernels.json"
mkdir -p "$logs"
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
if [[ $fake == 1 ]]; then
	gpu="" # the fake driver stands in for one; nvidia-smi is not asked
	device="the fake driver (ZERO_FAKE_CUDA=1, figures meaningless)"
else
	unset ZERO_FAKE_CUDA
	device=${gpu:-none}
	cd "$here" # the fake's source is only needed for a rehearsal
fi
{
	echo "gpu-test on $(hostname) at $(date -u +%FT%TZ), budget ${budget}s, BENCHTIME $benchtime"
	echo "GPU (index, name, driver, memory): $device"
	[[ -n $gpu ]] && echo "clocks as found (SM, max SM, memory): $(nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv,noheader 2>&1)"
	echo "CPU: $(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
	echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
	echo "compute-sanitizer: ${sanitizer:-not found}"
	echo "temporary directory (the checkpoint step's disk): $(df -hT "${TMPDIR:-/tmp}" 2>/dev/null | tail -1)"
} >"$logs/host.txt"
cat "$logs/host.txt"
note "host: GPU ${device}"

status=0
# run_step NAME SECONDS CMD...: run CMD under timeout (at most what the
# budget has left), log to $logs/NAME.log, and record pass, fail or timeout.
# A Go step (one whose log has go test's lines) fails where nothing matched
# its pattern, and is recorded as skipped where everything it ran skipped.
run_step() {
	local name=$1 want=$2
	shift 2
	local t log="$logs/$name.log"
	t=$(left)
	((t > want)) && t=$want
	if ((t < 5)); then
		note "$name: skipped: the ${budget}s budget is spent"
		return
	fi
	local t0=$(date +%s)
	timeout --kill-after=5 "$t" "$@" >"$log" 2>&1
	local rc=$? dt=$(($(date +%s) - t0))
	local ran skipped
	ran=$(grep -c -E '^(--- PASS|--- FAIL|Benchmark.*[0-9] ns/op)' "$log")
	skipped=$(grep -c -E '^--- SKIP' "$log")
	case $rc in
	0)
		if [[ $* == *"$bin"* ]] && ((ran == 0 && skipped == 0)); then
			note "$name: FAIL: matched no test or benchmark"
			status=1
		elif [[ $* == *"$bin"* ]] && ((ran == 0)); then
			note "$name: skipped: $(skip_reasons "$log" | head -1 | sed 's/^ *//')"
			skip_reasons "$log" | sed 1d >>"$summary"
		else
			note "$name: pass (${dt}s)"
			((skipped > 0)) && skip_reasons "$log" >>"$summary"
		fi
		;;
	124 | 137) note "$name: FAIL: timed out after ${t}s"; status=1 ;;
	*) note "$name: FAIL (exit $rc, ${dt}s): $(grep -m3 -E -- '--- FAIL|FAIL|rror' "$log" | tr '\n' ' ' | cut -c1-300)"; status=1 ;;
	esac
}

# skip_reasons LOG: each skipped test or benchmark with its reason (go test
# -v prints the reason on the line before "--- SKIP").
skip_reasons() {
	awk '/^--- SKIP: /{r=prev; sub(/^ +[a-z_]+\.go:[0-9]+: /, "", r); print "  " $3 ": " substr(r, 1, 150)} {prev=$0}' "$1"
}

skip() { note "$1: skipped: $2"; }

# On a GPU host nothing may skip; without one (or on the fake driver) the
# steps run so that their tests and benchmarks are seen to skip, or to run.
require=()
[[ -n $gpu ]] && require=(ZERO_REQUIRE_GPU=1)

# gotest NAME SECONDS REGEX [FLAG...]: the tests matching REGEX; a test
# that writes a record writes it into $out (ZERO_GPU_RESULTS).
gotest() {
	local name=$1 want=$2 regex=$3
	shift 3
	run_step "$name" "$want" env "${require[@]}" ZERO_GPU_RESULTS="$out" "$bin" -test.v -test.count=1 -test.run "$regex" "$@"
}

# bench NAME SECONDS REGEX [ENV...]: the benchmarks matching REGEX, at
# $benchtime (1x where the host has no GPU: they skip at once).
bench() {
	local name=$1 want=$2 regex=$3 n=$benchtime
	shift 3
	[[ -z $gpu && $fake != 1 ]] && n=1x
	run_step "$name" "$want" env "${require[@]}" "$@" "$bin" -test.v -test.run '^$' -test.bench "$regex" -test.benchtime "$n"
}

# The steps. Tests the steps below run for their figures are left out here.
step_tests() {
	if [[ $fake == 1 ]]; then
		skip tests "the fake driver's tests run in CI (.ci/run); this rehearsal runs the figures' steps"
		return
	fi
	gotest tests 150 'CUDA|NCCL|GPU|NVML|Bootstrap' -test.skip '^(TestCUDAKernelRegisters|TestGPUEstimateNVML)$'
}
step_registers() { gotest registers 30 '^TestCUDAKernelRegisters$'; }
step_estimate() { gotest estimate 120 '^TestGPUEstimateNVML$'; }
step_kernels() { bench kernels 60 '^BenchmarkCUDAKernelBandwidth$'; }
step_pipeline() { bench pipeline 90 '^BenchmarkCUDAPipeline$'; }
step_exposed() { bench exposed 60 '^BenchmarkCUDAExposedReduce$'; }
step_norm() { bench norm 45 '^BenchmarkCUDANormInLanding$'; }
step_offload() { bench offload 60 '^BenchmarkCUDAOffload(Copy|Step)$'; }
step_params() { bench params 60 '^BenchmarkCUDAParamOffload(Copy|Step)$'; }
# 256 MiB of state (16M fp32 elements: parameters, master, m, v) and a
# 256 MiB safetensors file, on the host's temporary disk (host.txt says
# which), 5 iterations unless BENCHTIME says otherwise: a slow disk's fsyncs
# must fit the step's time
step_checkpoint() {
	local n=16777216 benchtime=${BENCHTIME:-5x}
	[[ $fake == 1 ]] && n=1048576 benchtime=1x
	bench checkpoint 150 '^BenchmarkCUDA(Checkpoint|Safetensors)$' ZERO_BENCH_CKPT_ELEMS=$n ZERO_BENCH_ST_ELEMS=$n
}
step_torch() {
	if [[ -z $gpu ]]; then
		skip torch "no GPU on this host"
	elif "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
		run_step torch 40 "$py" "$here/torch_pipeline.py"
	else
		skip torch "python3 has no torch with CUDA"
	fi
}
step_memcheck() { sanitize memcheck 'TestCUDAKernels|TestCUDAGroupCollectives'; }
# racecheck: the kernels that use shared memory (sums of squares: the
# whole-shard reference, the landing's and the chunks')
step_racecheck() { sanitize racecheck 'TestCUDAKernels(SumSquares|AccumulateSquares|ChunkSquares|SumChunks)'; }
sanitize() {
	local tool=$1 regex=$2
	if [[ -z $gpu ]]; then
		skip "$tool" "no GPU on this host"
		return
	elif [[ -z $sanitizer ]]; then
		skip "$tool" "compute-sanitizer not found (CUDA toolkit, CUDA_HOME)"
		return
	fi
	run_step "$tool" 60 env GODEBUG=asyncpreemptoff=1 "$sanitizer" --tool "$tool" --error-exitcode 1 \
		--target-processes all "$bin" -test.count=1 -test.run "$regex"
	if grep -q -E 'not supported|Device not supported|unable to|Target application returned an error.*initialize' "$logs/$tool.log" &&
		! grep -q -E 'ERROR SUMMARY: [1-9]|Invalid|Race reported' "$logs/$tool.log"; then
		sed -i "\$d" "$summary" # the host refused the tool: not a failure of zero
		skip "$tool" "refused by this host: $(grep -m1 -E 'not supported|unable to' "$logs/$tool.log" | cut -c1-200)"
	fi
}

for s in "${STEPS[@]}"; do
	"step_$s"
done

# the figures, for BENCHMARKS.md
{
	echo "# $(head -2 "$logs/host.txt" | tr '\n' ' ')"
	for s in "${STEPS[@]}"; do
		[[ -f $logs/$s.log ]] || continue
		grep -h -E '^Benchmark.*[0-9] ns/op|figure: ' "$logs/$s.log" | sed -E 's/^ +[a-z_]+\.go:[0-9]+: figure: /figure: /'
		[[ $s == torch ]] && grep -h -E '^\{' "$logs/$s.log"
	done
} >"$out/figures.txt"
tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"

note "gpu-test: $([[ $status == 0 ]] && echo PASS || echo FAIL) in $(($(date +%s) - start))s; figures in $out/figures.txt, logs in $out/logs.tar.gz"
echo
echo "==== summary ($summary)"
cat "$summary"
exit $status
