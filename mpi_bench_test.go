package zero

import (
	"fmt"
	"math/rand"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"testing"
	"time"
)

// BenchmarkMPICollectives: zero's MPI reduce-scatter (fp32, sum) and
// all-gather, 1 MiB to 256 MiB of full buffer, against MPI's own
// MPI_Reduce_scatter_block (MPI_FLOAT, MPI_SUM) and MPI_Allgather over the
// same library, communicator and buffers, called in a C loop (mpiOwn) right
// after zero's calls, in the same processes: separate runs meet different
// loads and placements on a shared host (bench/mpi_collectives.c, MPI's own
// in a program of its own, moved 2.8-4.3 GB/s at W = 4 from run to run).
// Not call by call: alternating blocks of 10 calls slowed both by up to 2x.
// The timer and MB/s are zero's b.N calls (each followed by the stream's
// Sync), mpi-MB/s MPI's own b.N, x-mpi zero's throughput over MPI's, both on
// the slowest rank; each after one call to warm up and a barrier. Both use
// separate send and receive buffers, as the C program does. It runs under
// mpiexec, with a fixed count so that every rank takes the same b.N:
//
//	go test -c -o /tmp/zero.test . &&
//	  .mpi/bin/mpiexec -n 2 /tmp/zero.test -test.run '^$' -test.bench BenchmarkMPICollectives -test.benchtime 100x
//
// Rank 0 prints the figures; MB/s is the full buffer's bytes per second.
func BenchmarkMPICollectives(b *testing.B) {
	if os.Getenv("PMI_SIZE") == "" && os.Getenv("OMPI_COMM_WORLD_SIZE") == "" {
		b.Skip("runs under mpiexec: mpiexec -n W zero.test -test.run '^$' -test.bench BenchmarkMPICollectives -test.benchtime 100x")
	}
	comm, err := NewMPIFromEnv()
	if err != nil {
		b.Fatal(err)
	}
	mc := comm.(*mpiComm)
	if comm.Rank() != 0 { // one rank's lines: the testing package writes to fd 1
		if null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
			syscall.Dup2(int(null.Fd()), 1)
		}
	}
	W := comm.Size()
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
				part, err := hostDev.Alloc(n/W, FP32)
				if err != nil {
					b.Fatal(err)
				}
				defer hostDev.Free(part)
				send, recv := full, part
				if kind == KindAllGather {
					send, recv = part, full
				}
				s := NewHostStream()
				defer s.Close()
				zero := func() error { return syncedCollective(comm, s, kind, send, recv) }
				// warm-up: the staging buffer, the pages
				if err := zero(); err != nil {
					b.Fatal(err)
				}
				if _, err := AllReduceScalars(comm, OpMax, 0); err != nil { // a barrier
					b.Fatal(err)
				}
				b.SetBytes(int64(n) * 4)
				b.ResetTimer()
				for range b.N {
					if err := zero(); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				// then MPI's own, after one call to warm up and a barrier
				if err := mc.mpiOwn(kind, send, recv, 1); err != nil {
					b.Fatal(err)
				}
				if _, err := AllReduceScalars(comm, OpMax, 0); err != nil {
					b.Fatal(err)
				}
				t0 := time.Now()
				if err := mc.mpiOwn(kind, send, recv, b.N); err != nil {
					b.Fatal(err)
				}
				ownTime := time.Since(t0)
				// the slowest rank's times, as the C program reports
				slowest, err := AllReduceScalars(comm, OpMax, b.Elapsed().Seconds(), ownTime.Seconds())
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(float64(n)*4*float64(b.N)/slowest[1]/1e6, "mpi-MB/s")
				b.ReportMetric(slowest[1]/slowest[0], "x-mpi")
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
