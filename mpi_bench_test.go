package zero

import (
	"fmt"
	"os"
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
	for _, kind := range []CollectiveKind{KindReduceScatter, KindAllGather} {
		for mib := 1; mib <= 256; mib *= 4 {
			n := mib << 20 / 4
			b.Run(fmt.Sprintf("%v/W%d/%dMiB", kind, W, mib), func(b *testing.B) {
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
