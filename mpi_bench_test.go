package zero

import (
	"fmt"
	"math/rand"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"testing"
)

// BenchmarkMPICollectives: zero's MPI reduce-scatter (fp32, sum) and
// all-gather, 1 MiB to 256 MiB of full buffer, as bench/mpi_collectives.c
// measures MPI's own calls over the same library: one call to warm up, then
// b.N calls, each followed by the stream's Sync. It runs under mpiexec, with
// a fixed count so that every rank takes the same b.N:
//
//	go test -c -o /tmp/zero.test . &&
//	  .mpi/bin/mpiexec -n 2 /tmp/zero.test -test.run '^$' -test.bench BenchmarkMPICollectives -test.benchtime 10x
//
// Rank 0 prints the figures; MB/s is the full buffer's bytes per second.
func BenchmarkMPICollectives(b *testing.B) {
	if os.Getenv("PMI_SIZE") == "" && os.Getenv("OMPI_COMM_WORLD_SIZE") == "" {
		b.Skip("runs under mpiexec: mpiexec -n W zero.test -test.run '^$' -test.bench BenchmarkMPICollectives -test.benchtime 10x")
	}
	comm, err := NewMPIFromEnv()
	if err != nil {
		b.Fatal(err)
	}
	if comm.Rank() != 0 { // one rank's lines: the testing package writes to fd 1
		if null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
			syscall.Dup2(int(null.Fd()), 1)
		}
	}
	W, r := comm.Size(), comm.Rank()
	fitted := runtime.GOMAXPROCS(0)
	for _, kind := range []CollectiveKind{KindReduceScatter, KindAllGather} {
		for mib := 1; mib <= 256; mib *= 4 {
			n := mib << 20 / 4
			b.Run(fmt.Sprintf("%v/W%d/%dMiB", kind, W, mib), func(b *testing.B) {
				defer asFitted(fitted)()
				// every rank must make the same calls
				if out, err := AllReduceScalars(comm, OpMax, float64(b.N), -float64(b.N)); err != nil || out[0] != -out[1] {
					b.Fatalf("the ranks run %v iterations: give -test.benchtime Nx (%v)", out, err)
				}
				full, err := hostDev.Alloc(n, FP32)
				if err != nil {
					b.Fatal(err)
				}
				defer hostDev.Free(full)
				part := full.slice(r*(n/W), n/W)
				s := NewHostStream()
				defer s.Close()
				call := func() error {
					var err error
					if kind == KindReduceScatter {
						err = comm.ReduceScatter(s, full, part, OpSum)
					} else {
						err = comm.AllGather(s, part, full)
					}
					if err == nil {
						err = s.Sync()
					}
					return err
				}
				if err := call(); err != nil { // warm-up: the staging buffer, the pages
					b.Fatal(err)
				}
				if _, err := AllReduceScalars(comm, OpMax, 0); err != nil { // a barrier
					b.Fatal(err)
				}
				b.SetBytes(int64(n) * 4)
				b.ResetTimer()
				for range b.N {
					if err := call(); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
	if err := comm.Close(); err != nil {
		b.Fatal(err)
	}
	if err := MPIFinalize(); err != nil {
		b.Fatal(err)
	}
}

// BenchmarkMPIStep is zero's side of the whole-step comparison with
// DeepSpeed on CPUs (bench/deepspeed_step.py, bench/mpi_step.sh): layers
// fp32 weights of hidden × hidden ($ZERO_BENCH_LAYERS, $ZERO_BENCH_HIDDEN;
// 8 and 1024), each rank handing over fixed gradients (drawn once, as the
// loss Σ⟨w, c⟩ of the DeepSpeed script gives), ZeRO-2 with buckets of 2^22
// elements, AdamW (lr 1e-3, weight decay 0.01), over MPI: one step is the
// gradients handed over, the reduce-scatters, the optimizer and the
// parameters' all-gather. It reports steps/s. Run under mpiexec with a
// fixed count:
//
//	mpiexec -n 2 zero.test -test.run '^$' -test.bench BenchmarkMPIStep -test.benchtime 20x
func BenchmarkMPIStep(b *testing.B) {
	if os.Getenv("PMI_SIZE") == "" && os.Getenv("OMPI_COMM_WORLD_SIZE") == "" {
		b.Skip("runs under mpiexec: mpiexec -n W zero.test -test.run '^$' -test.bench BenchmarkMPIStep -test.benchtime 20x")
	}
	layers, hidden := 8, 1024
	if v, err := strconv.Atoi(os.Getenv("ZERO_BENCH_LAYERS")); err == nil {
		layers = v
	}
	if v, err := strconv.Atoi(os.Getenv("ZERO_BENCH_HIDDEN")); err == nil {
		hidden = v
	}
	comm, err := NewMPIFromEnv()
	if err != nil {
		b.Fatal(err)
	}
	fitted := runtime.GOMAXPROCS(0)
	if comm.Rank() != 0 {
		if null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
			syscall.Dup2(int(null.Fd()), 1)
		}
	}
	n := hidden * hidden
	rng := rand.New(rand.NewSource(1))
	params := make([]Param, layers)
	grads := make([]Tensor, layers)
	crng := rand.New(rand.NewSource(100 + int64(comm.Rank())))
	for p := range params {
		w, g := make([]float32, n), make([]float32, n)
		for i := range w {
			w[i], g[i] = float32(rng.NormFloat64()*0.02), float32(crng.NormFloat64())
		}
		params[p] = Param{Name: fmt.Sprint("w", p), Count: n, DType: FP32, Data: Float32s(w)}
		grads[p] = Float32s(g)
	}
	opt := NewAdamW(1e-3)
	opt.WeightDecay = 0.01
	e, err := New(Config{Stage: 2, BucketBytes: 4 << 22, Optimizer: OptimizerPolicy{Groups: []Optimizer{opt}}}, comm, params)
	if err != nil {
		b.Fatal(err)
	}
	s := NewHostStream()
	step := func() error {
		for p := layers - 1; p >= 0; p-- { // backward's order
			if _, err := e.GradReady(p, grads[p], s); err != nil {
				return err
			}
		}
		if err := e.EndBackward(); err != nil {
			return err
		}
		return e.Step()
	}
	b.Run(fmt.Sprintf("W%d/%dx%d²", comm.Size(), layers, hidden), func(b *testing.B) {
		defer asFitted(fitted)()
		if out, err := AllReduceScalars(comm, OpMax, float64(b.N), -float64(b.N)); err != nil || out[0] != -out[1] {
			b.Fatalf("the ranks run %v iterations: give -test.benchtime Nx (%v)", out, err)
		}
		for range 3 { // warm-up, as the DeepSpeed script
			if err := step(); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := AllReduceScalars(comm, OpMax, 0); err != nil {
			b.Fatal(err)
		}
		b.ResetTimer()
		for range b.N {
			if err := step(); err != nil {
				b.Fatal(err)
			}
		}
		if _, err := AllReduceScalars(comm, OpMax, 0); err != nil { // the slowest rank's end
			b.Fatal(err)
		}
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "steps/s")
	})
	s.Close()
	e.Close()
	if err := comm.Close(); err != nil {
		b.Fatal(err)
	}
	if err := MPIFinalize(); err != nil {
		b.Fatal(err)
	}
}

// asFitted sets GOMAXPROCS to what NewMPI fitted it to, as a program has
// it, and returns what puts back the testing package's: the package sets
// GOMAXPROCS (-test.cpu) before each benchmark.
func asFitted(fitted int) (restore func()) {
	was := runtime.GOMAXPROCS(fitted)
	return func() { runtime.GOMAXPROCS(was) }
}
