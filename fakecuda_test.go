//go:build cuda

package zero

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// With ZERO_FAKE_CUDA=1 the CUDA tests run against a fake libcuda.so.1
// over host memory (testdata/fakecuda), built here with g++ and loaded
// through ZERO_CUDA_LIBRARY: the loader, the contexts, streams, events,
// the descriptor ring and every launch run without a GPU, the kernels
// emulated from their own source. Run from the repository root.
func TestMain(m *testing.M) {
	if os.Getenv("ZERO_FAKE_CUDA") == "1" && os.Getenv("FAKECUDA_TRACE") == "" {
		// before the driver is loaded: the fake reads it once (fakeTrace)
		dir, err := os.MkdirTemp("", "zero-fakecuda-trace")
		if err == nil {
			os.Setenv("FAKECUDA_TRACE", filepath.Join(dir, "trace"))
		}
	}
	if os.Getenv("ZERO_FAKE_CUDA") == "1" && os.Getenv("ZERO_CUDA_LIBRARY") == "" {
		lib, err := buildFakeCUDA()
		if err != nil {
			fmt.Fprintln(os.Stderr, "fake libcuda:", err)
			os.Exit(2)
		}
		os.Setenv("ZERO_CUDA_LIBRARY", lib)
		fmt.Fprintln(os.Stderr, "CUDA tests run against the fake driver", lib)
	}
	os.Exit(m.Run())
}

func buildFakeCUDA() (string, error) {
	dir, err := os.MkdirTemp("", "zero-fakecuda")
	if err != nil {
		return "", err
	}
	lib := filepath.Join(dir, "libcuda.so.1")
	cxx := os.Getenv("CXX")
	if cxx == "" {
		cxx = "g++"
	}
	out, err := exec.Command(cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-ffp-contract=off", "-Wno-unknown-pragmas",
		"-I.", "-Icsrc", "testdata/fakecuda/fakecuda.cc", "-o", lib, "-lpthread").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%v: %s", err, out)
	}
	return lib, nil
}

// TestCUDALeavesTheCallersContext: a framework's own context, current on
// the calling thread, is current again after every call into the library,
// which works in the device's primary context meanwhile (the fake refuses
// work with no context current).
func TestCUDALeavesTheCallersContext(t *testing.T) {
	d := fakeCUDA(t)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const framework = uintptr(0xf00d) // the fake takes any handle as a context
	if err := setContext(framework); err != nil {
		t.Fatal(err)
	}
	defer setContext(0)
	s, err := d.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	x, err := d.Alloc(1000, FP32)
	if err != nil {
		t.Fatal(err)
	}
	steps := []func() error{
		func() error { return d.zero(s, x) },
		func() error { return d.cast(s, x, x, 2) },
		func() error { _, err := s.Record(); return err },
		s.Sync,
		func() error { return d.Free(x) },
		s.Close,
	}
	for i, step := range steps {
		if err := step(); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		if c, err := currentContext(); err != nil || c != framework {
			t.Fatalf("after step %d the thread's context is %#x (%v), want the framework's %#x", i, c, err, framework)
		}
	}
}

// TestCUDAOldDriver: a driver older than CUDA 12.0 is refused with
// ErrNoCUDA naming both versions. The load is kept once it succeeds, so the
// old driver is tried in a process of its own.
func TestCUDAOldDriver(t *testing.T) {
	if os.Getenv("ZERO_OLD_DRIVER_CHILD") == "1" {
		_, err := CUDA(0)
		if !errors.Is(err, ErrNoCUDA) || !strings.Contains(err.Error(), "CUDA 11.8") || !strings.Contains(err.Error(), "12.0") {
			t.Fatalf("CUDA(0) on a CUDA 11.8 driver: %v; want ErrNoCUDA naming 11.8 and 12.0", err)
		}
		t.Logf("as expected: %v", err)
		return
	}
	fakeCUDA(t)
	cmd := exec.Command(os.Args[0], "-test.run", "^TestCUDAOldDriver$", "-test.v")
	cmd.Env = append(os.Environ(), "ZERO_OLD_DRIVER_CHILD=1", "FAKECUDA_DRIVER=11080")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "as expected") {
		t.Fatalf("the child with an old driver: %v\n%s", err, out)
	}
}

// traceOp is one line of the fake driver's enqueue trace (fakecuda.cc):
// op, its stream (or event), and its numbers.
type traceOp struct {
	op     string
	stream uintptr // copy, launch, record, wait, waitvalue, sync; the event for esync
	a, b   uintptr // copy: dst, src; launch: kind, out; record, wait: event, generation; esync: generation
	n      uintptr // copy: bytes
}

// fakeTrace starts the fake driver's enqueue trace; stop ends it and
// returns its lines in the order of the calls.
func fakeTrace(t *testing.T) (stop func() []traceOp) {
	t.Helper()
	path := os.Getenv("FAKECUDA_TRACE")
	if path == "" {
		t.Skip("FAKECUDA_TRACE is not set: TestMain sets it before the fake driver loads")
	}
	if err := os.WriteFile(path, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	return func() []traceOp {
		done := path + ".done"
		if err := os.Rename(path, done); err != nil { // atomic: the fake appends no more
			t.Fatal(err)
		}
		b, err := os.ReadFile(done)
		if err != nil {
			t.Fatal(err)
		}
		os.Remove(done)
		num := func(f string) uintptr {
			if f == "(nil)" {
				return 0
			}
			v, err := strconv.ParseUint(strings.TrimPrefix(f, "0x"), map[bool]int{true: 16, false: 10}[strings.HasPrefix(f, "0x")], 64)
			if err != nil {
				t.Fatalf("trace: %q: %v", f, err)
			}
			return uintptr(v)
		}
		var out []traceOp
		for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
			f := strings.Fields(line)
			if len(f) < 2 {
				continue
			}
			op := traceOp{op: f[0], stream: num(f[1])}
			if len(f) > 2 {
				op.a = num(f[2])
			}
			if len(f) > 3 {
				op.b = num(f[3])
			}
			if len(f) > 4 {
				op.n = num(f[4])
			}
			out = append(out, op)
		}
		return out
	}
}

// orderedAfter reports whether trace entry i, on stream s, runs after
// entry w, on stream r: the same stream; or an event recorded on r after w
// that s waits on before i; or, where hostSyncs, a host sync after w and
// before i of r or of such an event (the host then enqueued i after w's
// work had run).
func orderedAfter(tr []traceOp, w, i int, r, s uintptr, hostSyncs bool) bool {
	if r == s && w < i {
		return true
	}
	type ev struct{ e, gen uintptr }
	recorded := map[ev]bool{} // events recorded on r after w
	latest := map[uintptr]uintptr{}
	for j := w + 1; j < i; j++ {
		op := tr[j]
		switch {
		case op.op == "record" && op.stream == r:
			recorded[ev{op.a, op.b}] = true
			latest[op.a] = op.b
		case hostSyncs && op.op == "sync" && op.stream == r:
			return true
		case hostSyncs && op.op == "esync" && latest[op.stream] != 0 && op.a >= latest[op.stream]:
			return true
		case op.op == "wait" && op.stream == s && recorded[ev{op.a, op.b}]:
			return true
		}
	}
	return false
}

// TestCUDAParamOffloadOrder: on the fake driver, two ranks train three
// steps at stage 3 with the parameter shard in page-locked host memory
// (the optimizer on the device, then offloaded), gathering each parameter
// for the forward and again for the backward and releasing it before the
// next. In the enqueue trace, every copy out of a rank's host shard runs on
// that rank's gather stream, ordered after the shard's last write (New's
// load, the last step's optimizer pass or, offloaded, the reduce stream's
// wait for the host's pass); every read of a view by the caller's stream
// is ordered after the copy into its gather buffer through the gather's
// event (the stream waits on it, the host never syncs); the views hold the
// parameters FullParams reads; and the engine's device allocations reach
// the estimate for that live set to the byte, no parameter shard among
// them, the shard being in the page-locked ledger.
func TestCUDAParamOffloadOrder(t *testing.T) {
	d := fakeCUDA(t)
	sizes := []int{300, 1000, 77, 500}
	params := make([]Param, len(sizes))
	for p, n := range sizes {
		params[p] = Param{Name: fmt.Sprint("p", p), Count: n, DType: FP32}
	}
	for _, offload := range []bool{false, true} {
		cfg := Config{Stage: 3, BucketBytes: 2048, Overlap: true, Offload: OffloadPolicy{Params: true, Optimizer: offload},
			Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(0.01)}}}
		const world, steps = 2, 3
		est, err := Estimate(params, cfg, world, Workload{})
		if err != nil {
			t.Fatal(err)
		}
		comms, err := NewCUDALocalGroupTimeout(world, d, 60*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		type rankRun struct {
			gs, rs, s uintptr
			shard     Tensor
			reads     [][2]uintptr // a view's address and its gather buffer's, per read
			trained   int          // the reads of the training steps; then come reads after FullParams
			bufBytes  int
			peak      [2]int
			pinned    bool
		}
		runs := make([]rankRun, world)
		stop := fakeTrace(t)
		errs := eachRank(world, func(rank int) error {
			defer comms[rank].Close()
			dev := newCountingDeviceOn(d)
			ps := append([]Param(nil), params...)
			var frees []Tensor
			defer func() {
				for _, x := range frees {
					d.Free(x)
				}
				dev.release()
			}()
			s, err := d.NewStream()
			if err != nil {
				return err
			}
			defer s.Close()
			put := func(vals []float32) (Tensor, error) {
				x, err := d.Alloc(len(vals), FP32)
				if err == nil {
					frees = append(frees, x)
					err = d.copy(s, x, Float32s(vals))
				}
				return x, err
			}
			grads := make([]Tensor, len(ps))
			for p, n := range sizes {
				vals := make([]float32, n)
				for i := range vals {
					vals[i] = float32(p) + float32(i)/float32(n)
				}
				if ps[p].Data, err = put(vals); err != nil {
					return err
				}
				for i := range vals {
					vals[i] = float32((i+p+rank)%7) - 3
				}
				if grads[p], err = put(vals); err != nil {
					return err
				}
			}
			e, err := New(cfg, onDevice{comms[rank], dev}, ps)
			if err != nil {
				return err
			}
			defer e.Close()
			r := &runs[rank]
			r.gs, r.rs, r.s, r.shard = e.gatherStream.(*cudaStream).h, e.reduceStream.(*cudaStream).h, s.(*cudaStream).h, e.ps.shard
			r.pinned = dev.pinned(e.ps.shard)
			r.bufBytes = e.plan.MaxBucket() * 4
			var last [][]float32
			gather := func(p int) error {
				views, err := e.Gather(s, p)
				if err != nil {
					return err
				}
				buf := e.ps.buckets[e.plan.ParamBucket[p]].buf.t
				got := make([]float32, views[0].count)
				if err := d.copy(s, Float32s(got), views[0]); err != nil { // the caller reads the view on its stream
					return err
				}
				r.reads = append(r.reads, [2]uintptr{views[0].ptr, buf.ptr})
				last[p] = got
				return e.Release(s, p)
			}
			for range steps {
				last = make([][]float32, len(ps))
				for p := range ps {
					if err := gather(p); err != nil {
						return err
					}
				}
				for p := len(ps) - 1; p >= 0; p-- {
					if err := gather(p); err != nil {
						return err
					}
					if _, err := e.GradReady(p, grads[p], s); err != nil {
						return err
					}
				}
				if err := e.EndBackward(); err != nil {
					return err
				}
				if err := e.Step(); err != nil {
					return err
				}
			}
			r.peak[0], r.peak[1] = dev.peaks() // FullParams' temporaries count in no estimate
			r.trained = len(r.reads)
			full, err := e.FullParams()
			if err != nil {
				return err
			}
			if err := s.Sync(); err != nil {
				return err
			}
			// the last step's views were read before it: compare with a
			// gather after it
			for p := range ps {
				if err := gather(p); err != nil {
					return err
				}
				if err := s.Sync(); err != nil {
					return err
				}
				if !slices.Equal(last[p], full[p]) {
					return fmt.Errorf("parameter %d: the view holds other values than FullParams reads", p)
				}
			}
			if m := e.ParamMemory(); m.ShardBytes != 0 || m.HostShardBytes != int64(e.ps.shard.Bytes()) {
				return fmt.Errorf("parameter memory %+v: the shard must be on the host", m)
			}
			return nil
		})
		tr := stop()
		for rank, err := range errs {
			if err != nil {
				t.Fatalf("offload=%v rank %d: %v", offload, rank, err)
			}
		}
		in := func(p, lo uintptr, n int) bool { return p >= lo && p < lo+uintptr(n) }
		for rank, r := range runs {
			what := fmt.Sprintf("offload=%v rank %d", offload, rank)
			if !r.pinned {
				t.Fatalf("%s: the parameter shard is not page-locked memory", what)
			}
			if r.peak[0] != int(est.Device.Engine()) || r.peak[1] != int(est.Host.Total()) {
				t.Fatalf("%s: device high-water %d, host %d bytes; the estimate %d and %d (%+v)", what, r.peak[0], r.peak[1], est.Device.Engine(), est.Host.Total(), est.Device)
			}
			lo, size := r.shard.ptr, r.shard.Bytes()
			copies, lastWrite := 0, -1
			for i, op := range tr {
				switch {
				case op.op == "launch" && op.b != 0 && in(op.b, lo, size), op.op == "waitvalue" && op.stream == r.rs:
					lastWrite = i
				}
				if op.op != "copy" || !in(op.b, lo, size) {
					continue
				}
				if op.stream != r.gs {
					t.Fatalf("%s: trace %d: a copy out of the host shard on stream %#x, not the gather stream %#x", what, i, op.stream, r.gs)
				}
				if lastWrite < 0 || !orderedAfter(tr, lastWrite, i, tr[lastWrite].stream, r.gs, true) {
					t.Fatalf("%s: trace %d: a copy out of the host shard not ordered after its last write (trace %d)", what, i, lastWrite)
				}
				copies++
			}
			if copies < 2*steps*len(sizes)/2 {
				t.Fatalf("%s: %d copies out of the host shard for %d steps", what, copies, steps)
			}
			// each read of a view by the caller's stream, after the copy
			// into its buffer
			read := 0
			for c, op := range tr {
				if op.op != "copy" || op.stream != r.s || read >= len(r.reads) || op.b != r.reads[read][0] {
					continue
				}
				buf := r.reads[read][1]
				read++
				i := -1
				for j := c - 1; j >= 0; j-- {
					if o := tr[j]; o.op == "copy" && in(o.b, lo, size) && in(o.a, buf, r.bufBytes) {
						i = j
						break
					}
				}
				if i < 0 {
					t.Fatalf("%s: trace %d: the caller reads a view whose buffer no copy out of the host shard filled", what, c)
				}
				// in training through the gather's event, never a host
				// sync; after FullParams, which syncs, by either
				if training := read <= r.trained; !orderedAfter(tr, i, c, r.gs, r.s, !training) {
					t.Fatalf("%s: trace %d: the caller's read of a view is not ordered after the copy into its buffer (trace %d) by an event it waits on", what, c, i)
				}
			}
			if read != len(r.reads) {
				t.Fatalf("%s: %d of %d reads of views found in the trace", what, read, len(r.reads))
			}
		}
	}
}
