//go:build cuda

package zero

import (
	"os"
	"testing"
	"time"
)

// The part of the shared harness (harness_test.go) that names the CUDA
// device, and so builds only with -tags cuda: the GPU tests, the offload
// tests on a GPU, the fake driver's tests and the CUDA benchmarks share it.

// needCUDA returns device 0 or skips.
func needCUDA(t testing.TB) *cudaDevice {
	t.Helper()
	d, err := CUDA(0)
	if err != nil {
		skipOrFail(t, "no CUDA device: %v", err)
	}
	return d.(*cudaDevice)
}

// fakeCUDA skips a test that needs the fake driver's hooks.
func fakeCUDA(t *testing.T) *cudaDevice {
	t.Helper()
	if os.Getenv("ZERO_FAKE_CUDA") != "1" {
		t.Skip("runs against the fake driver only (ZERO_FAKE_CUDA=1)")
	}
	return needCUDA(t)
}

// skipOrFail skips a GPU test, or fails it where ZERO_REQUIRE_GPU=1 (the GPU
// host's runner sets it), so a host whose driver is too old cannot pass by
// skipping everything.
func skipOrFail(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv("ZERO_REQUIRE_GPU") == "1" {
		t.Fatalf("ZERO_REQUIRE_GPU=1: "+format, args...)
	}
	t.Skipf(format, args...)
}

// benchShrink is what a CUDA benchmark divides its model's dimensions by:
// 1 on a GPU, by against the fake driver (ZERO_FAKE_CUDA=1), whose kernels
// run thread by thread on the host, so there a benchmark shows that it
// runs (the GPU runner's steps are rehearsed so), not how fast: seed 000's
// shape takes 10 to 20 s a step on it.
func benchShrink(b *testing.B, by int) int {
	b.Helper()
	if os.Getenv("ZERO_FAKE_CUDA") != "1" {
		return 1
	}
	b.Logf("the fake driver: the model's dimensions divided by %d", by)
	return by
}

// gpuStream is a new stream of d, closed when t ends.
func gpuStream(t testing.TB, d *cudaDevice) Stream {
	t.Helper()
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

// runEngineCUDA is runEngine (harness_test.go) on the one-GPU group: the same
// protocol, with the gradients uploaded to device memory and written on CUDA
// streams.
func runEngineCUDA(t testing.TB, d *cudaDevice, r runSpec, params []Param, data workload, seed int64) []rankResult {
	t.Helper()
	comms, err := NewCUDALocalGroupTimeout(r.world, d, 60*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	return runRanks(t, r, func(cfg Config, rank int, out *rankResult) error {
		return runRankCUDA(d, cfg, comms[rank], r, params, data, seed, out)
	})
}

func runRankCUDA(d *cudaDevice, cfg Config, comm Comm, r runSpec, params []Param, data workload, seed int64, out *rankResult) (err error) {
	defer comm.Close()
	up, err := d.NewStream()
	if err != nil {
		return err
	}
	defer up.Close()
	// upload this rank's gradients: dev[step][backward][param]
	dev := make([][][]Tensor, r.steps)
	defer func() {
		for _, s := range dev {
			for _, k := range s {
				for _, g := range k {
					d.Free(g)
				}
			}
		}
	}()
	for step := range r.steps {
		dev[step] = make([][]Tensor, r.backwards)
		for k := range r.backwards {
			dev[step][k] = make([]Tensor, len(params))
			for p, q := range params {
				g, err := d.Alloc(q.Count, q.DType)
				if err != nil {
					return err
				}
				dev[step][k][p] = g
				if err := d.copy(up, g, data[step][k][comm.Rank()][p].t); err != nil {
					return err
				}
			}
		}
	}
	if err := up.Sync(); err != nil {
		return err
	}
	return rankLoop(cfg, comm, d, r, params, func(step, k, p int) Tensor { return dev[step][k][p] }, seed, out)
}

// gpuTrainEnv runs trainEngineOn on the one-GPU group, with the parameters
// and gradients in d's memory.
func gpuTrainEnv(d *cudaDevice) trainEnv {
	return trainEnv{
		group:  func(world int) ([]Comm, error) { return NewCUDALocalGroupTimeout(world, d, 60*time.Second) },
		stream: d.NewStream,
		place: func(s Stream, b *tbuf) (Tensor, func(), error) {
			x, err := d.Alloc(b.len(), b.dt)
			if err != nil {
				return Tensor{}, nil, err
			}
			if err := d.copy(s, x, b.t()); err != nil {
				d.Free(x)
				return Tensor{}, nil, err
			}
			return x, func() { d.Free(x) }, nil
		},
		fetch: func(s Stream, x Tensor, b *tbuf) error {
			if err := d.copy(s, b.t(), x); err != nil {
				return err
			}
			return s.Sync()
		},
	}
}
