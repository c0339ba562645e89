package zero

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"
)

// onRanks runs fn on every rank of a fresh in-process group and returns
// the ranks' errors.
func onRanks(n int, timeout time.Duration, fn func(c Comm, s *HostStream) error) []error {
	comms, err := NewLocalGroupTimeout(n, timeout)
	if err != nil {
		return []error{err}
	}
	return eachRank(n, func(r int) error {
		s := NewHostStream()
		err := fn(comms[r], s)
		if cerr := s.Close(); err == nil {
			err = cerr
		}
		return err
	})
}

// values returns n random values representable in d, as a tensor and as float64.
func values(rng *rand.Rand, n int, d DType) (Tensor, []float64) {
	g := makeGrad(rng, n, d, 1)
	return g.t, g.ref
}

func readBack(t Tensor) []float64 {
	out := make([]float64, t.count)
	switch t.dtype {
	case FP32:
		for i, v := range t.hostFloats() {
			out[i] = float64(v)
		}
	default:
		for i, v := range halfsOf(t) {
			if t.dtype == BF16 {
				out[i] = float64(floatFromBF16(v))
			} else {
				out[i] = float64(floatFromFP16(v))
			}
		}
	}
	return out
}

// TestLocalCollectives checks each collective, op and dtype against a
// float64 reference, for several world sizes, with in-place buffers.
func TestLocalCollectives(t *testing.T) {
	seed := testSeed(t)
	for _, n := range []int{1, 2, 3, 4, 8} {
		for _, d := range []DType{FP32, BF16, FP16} {
			rng := rand.New(rand.NewSource(seed + int64(n)))
			const count = 1000 // not a multiple of the split granularity
			in := make([][]float64, n)
			bufs := make([]Tensor, n)
			rs := make([]Tensor, n)
			rsIn := make([][]float64, n)
			for r := range n {
				bufs[r], in[r] = values(rng, count, d)
				rs[r], rsIn[r] = values(rng, count*n, d)
			}
			root := n - 1
			bc, bcIn := values(rng, 77, d)
			bcs := make([]Tensor, n)
			for r := range n {
				bcs[r], _ = values(rng, 77, d)
				if r == root {
					bcs[r] = bc
				}
			}
			for _, op := range []ReduceOp{OpSum, OpAvg, OpMax} {
				// Every rank must get the same bits: all-reduces compared
				// across ranks, and each rank's reduce-scatter chunk with
				// the same chunk of an all-reduce of the same data.
				arBits := make([][]float64, n)
				rsBits := make([][]float64, n)
				errs := onRanks(n, 10*time.Second, func(c Comm, s *HostStream) error {
					r := c.Rank()
					buf := cloneTensor(bufs[r])
					if err := c.AllReduce(s, buf, op); err != nil {
						return err
					}
					send := cloneTensor(rs[r])
					recv := send.slice(r*count, count) // in place
					if err := c.ReduceScatter(s, send, recv, op); err != nil {
						return err
					}
					whole := cloneTensor(rs[r])
					if err := c.AllReduce(s, whole, op); err != nil {
						return err
					}
					defer func() {
						arBits[r] = readBack(buf)
						rsBits[r] = append(readBack(recv), readBack(whole.slice(r*count, count))...)
					}()
					ag := cloneTensor(rs[r])
					if err := c.AllGather(s, ag.slice(r*count, count), ag); err != nil {
						return err
					}
					b := cloneTensor(bcs[r])
					if err := c.Broadcast(s, b, root); err != nil {
						return err
					}
					if err := s.Sync(); err != nil {
						return err
					}
					tol := unitRoundoff(d) * float64(n+1)
					for i, got := range readBack(buf) {
						checkClose(t, "all-reduce", n, d, op, i, got, reduceRef(in, i, op), tol*magnitude(in, i))
					}
					for i, got := range readBack(recv) {
						col := make([][]float64, n)
						for k := range n {
							col[k] = rsIn[k][r*count : (r+1)*count]
						}
						checkClose(t, "reduce-scatter", n, d, op, i, got, reduceRef(col, i, op), tol*magnitude(col, i))
					}
					for i, got := range readBack(ag) {
						if want := rsIn[i/count][i]; got != want {
							t.Errorf("all-gather n=%d %v: [%d] = %g, want %g", n, d, i, got, want)
							break
						}
					}
					for i, got := range readBack(b) {
						if got != bcIn[i] {
							t.Errorf("broadcast n=%d %v: [%d] = %g, want %g", n, d, i, got, bcIn[i])
							break
						}
					}
					return nil
				})
				for _, err := range errs {
					if err != nil {
						t.Fatal(err)
					}
				}
				for r := range n {
					for i := range count {
						if !sameFloat(arBits[r][i], arBits[0][i]) {
							t.Fatalf("all-reduce n=%d %v %v: rank %d has %g at [%d], rank 0 %g", n, d, op, r, arBits[r][i], i, arBits[0][i])
						}
						if !sameFloat(rsBits[r][i], rsBits[r][count+i]) {
							t.Fatalf("reduce-scatter n=%d %v %v: rank %d has %g at [%d], the all-reduce %g", n, d, op, r, rsBits[r][i], i, rsBits[r][count+i])
						}
					}
				}
			}
		}
	}
}

// sameFloat says whether a and b are one value, bit for bit (NaN is NaN).
func sameFloat(a, b float64) bool {
	return math.Float64bits(a) == math.Float64bits(b) || (math.IsNaN(a) && math.IsNaN(b))
}

func cloneTensor(t Tensor) Tensor {
	if t.dtype == FP32 {
		return Float32s(append([]float32(nil), t.hostFloats()...))
	}
	return Halfs(append([]uint16(nil), halfsOf(t)...), t.dtype)
}

func halfsOf(t Tensor) []uint16 {
	b := t.hostBytes()
	return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), t.count)
}

func reduceRef(in [][]float64, i int, op ReduceOp) float64 {
	acc := in[0][i]
	for _, x := range in[1:] {
		if op == OpMax {
			acc = math.Max(acc, x[i])
		} else {
			acc += x[i]
		}
	}
	if op == OpAvg {
		acc /= float64(len(in))
	}
	return acc
}

// magnitude is Σ|x| of element i, the scale of a sum's rounding error.
func magnitude(in [][]float64, i int) float64 {
	m := 0.0
	for _, x := range in {
		m += math.Abs(x[i])
	}
	return m
}

func checkClose(t *testing.T, what string, n int, d DType, op ReduceOp, i int, got, want, tol float64) {
	t.Helper()
	if !(math.Abs(got-want) <= tol) {
		t.Errorf("%s n=%d %v %v: [%d] = %g, want %g", what, n, d, op, i, got, want)
	}
}

// TestLocalCollectiveCounters: calls, payload and ring-model wire bytes.
func TestLocalCollectiveCounters(t *testing.T) {
	const n = 4
	errs := onRanks(n, 10*time.Second, func(c Comm, s *HostStream) error {
		buf := Float32s(make([]float32, 4096))
		if err := c.AllReduce(s, buf, OpSum); err != nil {
			return err
		}
		if err := c.ReduceScatter(s, buf, buf.slice(c.Rank()*1024, 1024), OpSum); err != nil {
			return err
		}
		if err := c.AllGather(s, buf.slice(c.Rank()*1024, 1024), buf); err != nil {
			return err
		}
		if err := s.Sync(); err != nil {
			return err
		}
		k := c.Counters()
		for kind, want := range map[CollectiveKind]CollectiveCount{
			KindAllReduce:     {1, 16384, 2 * 16384 * 3 / 4},
			KindReduceScatter: {1, 16384, 16384 * 3 / 4},
			KindAllGather:     {1, 16384, 16384 * 3 / 4},
		} {
			if k[kind] != want {
				t.Errorf("%v: %+v, want %+v", kind, k[kind], want)
			}
		}
		return nil
	})
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestLocalGroupPeerLeaves: a rank that closes its communicator makes the
// others' pending collectives fail at once, not hang.
func TestLocalGroupPeerLeaves(t *testing.T) {
	start := time.Now()
	errs := onRanks(3, time.Minute, func(c Comm, s *HostStream) error {
		if c.Rank() == 1 {
			return c.Close()
		}
		if err := c.AllReduce(s, Float32s(make([]float32, 64)), OpSum); err != nil {
			return err
		}
		return s.Sync()
	})
	for r, err := range errs {
		if r != 1 && !errors.Is(err, ErrPeerFailed) {
			t.Errorf("rank %d: %v, want ErrPeerFailed", r, err)
		}
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("took %v with a one-minute timeout: the peer's exit was not noticed", d)
	}
}

// TestLocalGroupPeerVanishes: a rank that returns without a word makes
// the others fail with ErrTimeout within the timeout.
func TestLocalGroupPeerVanishes(t *testing.T) {
	errs := onRanks(3, 200*time.Millisecond, func(c Comm, s *HostStream) error {
		if c.Rank() == 2 {
			return nil
		}
		if err := c.AllReduce(s, Float32s(make([]float32, 64)), OpSum); err != nil {
			return err
		}
		return s.Sync()
	})
	for r, err := range errs[:2] {
		if !errors.Is(err, ErrTimeout) {
			t.Errorf("rank %d: %v, want ErrTimeout", r, err)
		}
	}
}

// TestLocalGroupMismatch: ranks that call different collectives get an
// error, not a hang or a wrong result.
func TestLocalGroupMismatch(t *testing.T) {
	errs := onRanks(2, 10*time.Second, func(c Comm, s *HostStream) error {
		if err := c.AllReduce(s, Float32s(make([]float32, 64+c.Rank())), OpSum); err != nil {
			return err
		}
		return s.Sync()
	})
	for r, err := range errs {
		if !errors.Is(err, ErrCollectiveMismatch) {
			t.Errorf("rank %d: %v, want ErrCollectiveMismatch", r, err)
		}
	}
}

func TestLocalGroupBadInput(t *testing.T) {
	if _, err := NewLocalGroup(0); !errors.Is(err, ErrConfig) {
		t.Errorf("NewLocalGroup(0): %v, want ErrConfig", err)
	}
	comms, _ := NewLocalGroup(2)
	s := NewHostStream()
	defer s.Close()
	c := comms[0]
	cases := map[string]struct {
		err  error
		want error
	}{
		"rs sizes":       {c.ReduceScatter(s, Float32s(make([]float32, 10)), Float32s(make([]float32, 4)), OpSum), ErrGradSize},
		"ag sizes":       {c.AllGather(s, Float32s(make([]float32, 4)), Float32s(make([]float32, 9))), ErrGradSize},
		"dtypes":         {c.ReduceScatter(s, Float32s(make([]float32, 8)), Halfs(make([]uint16, 4), BF16), OpSum), ErrDType},
		"op":             {c.AllReduce(s, Float32s(make([]float32, 8)), ReduceOp(9)), ErrConfig},
		"root":           {c.Broadcast(s, Float32s(make([]float32, 8)), 2), ErrConfig},
		"foreign stream": {c.AllReduce(fakeStream{}, Float32s(make([]float32, 8)), OpSum), ErrStream},
	}
	for name, tc := range cases {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: %v, want %v", name, tc.err, tc.want)
		}
	}
}

// TestCopyStream: the non-temporal copy of the all-gather and broadcast,
// at sizes and alignments around its vector and 4 KiB thresholds.
func TestCopyStream(t *testing.T) {
	rng := rand.New(rand.NewSource(testSeed(t)))
	src := make([]byte, 1<<20)
	rng.Read(src)
	for range 200 {
		n := rng.Intn(len(src) / 2)
		if rng.Intn(4) == 0 {
			n = 4096 + rng.Intn(200) - 100
		}
		so, do := rng.Intn(64), rng.Intn(64)
		dst := make([]byte, n+128)
		copyStream(uintptr(unsafe.Pointer(&dst[do])), uintptr(unsafe.Pointer(&src[so])), n)
		for i := range n {
			if dst[do+i] != src[so+i] {
				t.Fatalf("n=%d src+%d dst+%d: byte %d differs", n, so, do, i)
			}
		}
		for i := range do {
			if dst[i] != 0 {
				t.Fatalf("n=%d: wrote before the destination", n)
			}
		}
		for i := do + n; i < len(dst); i++ {
			if dst[i] != 0 {
				t.Fatalf("n=%d: wrote past the destination", n)
			}
		}
	}
}

// TestAvgMatchesScaledSum: for a power-of-two world, OpAvg gives the bits
// of OpSum scaled by 1/n afterwards (but in fp16's subnormal range), which
// is why the engine reduces with OpAvg there (ncclAvg on NCCL) and keeps
// half-precision sums from overflowing.
func TestAvgMatchesScaledSum(t *testing.T) {
	seed := testSeed(t)
	for _, n := range []int{2, 4, 8} {
		for _, d := range []DType{FP32, BF16, FP16} {
			rng := rand.New(rand.NewSource(seed + int64(n)))
			in := make([]Tensor, n)
			for r := range in {
				in[r], _ = values(rng, 4096, d)
			}
			avg := make([][]float64, n)
			sum := make([][]float64, n)
			errs := onRanks(n, 10*time.Second, func(c Comm, s *HostStream) error {
				a, b := cloneTensor(in[c.Rank()]), cloneTensor(in[c.Rank()])
				if err := c.AllReduce(s, a, OpAvg); err != nil {
					return err
				}
				if err := c.AllReduce(s, b, OpSum); err != nil {
					return err
				}
				if err := s.Sync(); err != nil {
					return err
				}
				avg[c.Rank()], sum[c.Rank()] = readBack(a), readBack(b)
				return nil
			})
			for _, err := range errs {
				if err != nil {
					t.Fatal(err)
				}
			}
			for r := range n {
				for i := range avg[r] {
					want := float64(float32(sum[r][i]) * float32(1/float64(n)))
					if d == FP16 && math.Abs(want) < math.Ldexp(1, -14) {
						continue // fp16 subnormals round where the scaled sum does not
					}
					if avg[r][i] != want {
						t.Fatalf("n=%d %v rank %d: [%d] avg %g, sum/n %g", n, d, r, i, avg[r][i], want)
					}
				}
			}
		}
	}
}

// opRecorder records the op of every reduce-scatter it passes on.
type opRecorder struct {
	Comm
	ops []ReduceOp
}

func (o *opRecorder) ReduceScatter(s Stream, send, recv Tensor, op ReduceOp) error {
	o.ops = append(o.ops, op)
	return o.Comm.ReduceScatter(s, send, recv, op)
}

// TestEngineReduceOp: the engine averages on the wire for a power-of-two
// world and sums elsewhere.
func TestEngineReduceOp(t *testing.T) {
	for _, n := range []int{1, 2, 3, 4, 6, 8} {
		comms, _ := NewLocalGroup(n)
		rec := make([]*opRecorder, n)
		errs := eachRank(n, func(r int) error {
			rec[r] = &opRecorder{Comm: comms[r]}
			e, err := New(Config{Stage: 2, BucketBytes: 1 << 20}, rec[r], []Param{{Count: 100, DType: FP16}})
			if err != nil {
				return err
			}
			defer e.Close()
			if err := e.EndBackward(); err != nil {
				return err
			}
			return e.Step()
		})
		for _, err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		want := OpSum
		if n&(n-1) == 0 {
			want = OpAvg
		}
		if len(rec[0].ops) != 1 || rec[0].ops[0] != want {
			t.Errorf("world %d: reduce-scatter ops %v, want [%v]", n, rec[0].ops, want)
		}
	}
}

// TestAbortWaitsForPeersReadingMyBuffers: a rank that closes its Comm while
// a peer still copies from its buffer (a broadcast from it) does not see its
// collective finish, and so cannot free the buffer, before the peer is done
// reading: no use after free, at any size.
func TestAbortWaitsForPeersReadingMyBuffers(t *testing.T) {
	comms, _ := NewLocalGroupTimeout(2, 20*time.Second)
	dev := CPU()
	errs := eachRank(2, func(r int) error {
		buf, err := dev.Alloc(64<<20, FP32)
		if err != nil {
			return err
		}
		s := NewHostStream()
		defer s.Close()
		if err := comms[r].Broadcast(s, buf, 1); err != nil { // rank 0 copies 256 MiB from rank 1
			return err
		}
		if r == 1 {
			time.Sleep(5 * time.Millisecond)
			comms[1].Close()
		}
		s.Sync() // the broadcast may or may not report the abort
		return dev.Free(buf)
	})
	everyRankIs(t, "broadcast, then rank 1 leaves", errs, nil)
}

// TestRunLocal: every rank runs and their errors come back joined, each
// naming its rank; a rank that fails, or panics, aborts the group, so the
// others, blocked in a collective with the default timeout of five
// minutes, return within a second.
func TestRunLocal(t *testing.T) {
	var ran atomic.Int32
	if err := RunLocal(3, func(c Comm) error { ran.Add(1); return nil }); err != nil || ran.Load() != 3 {
		t.Fatalf("three ranks that succeed: %v, %d ran", err, ran.Load())
	}
	boom := errors.New("rank 1's data loader failed")
	for _, fails := range []func(){func() { panic("a bug in rank 1") }, nil} {
		start := time.Now()
		err := RunLocal(3, func(c Comm) error {
			if c.Rank() == 1 {
				time.Sleep(20 * time.Millisecond)
				if fails != nil {
					fails()
				}
				return boom
			}
			buf, err := c.Device().Alloc(64, FP32)
			if err != nil {
				return err
			}
			defer c.Device().Free(buf)
			s := NewHostStream()
			defer s.Close()
			if err := c.AllReduce(s, buf, OpSum); err != nil { // waits for rank 1, which never comes
				return err
			}
			return s.Sync()
		})
		if took := time.Since(start); took > time.Second {
			t.Errorf("the ranks returned after %v; want within a second of rank 1's failure", took)
		}
		if fails == nil && !errors.Is(err, boom) || fails != nil && !errors.Is(err, ErrAborted) {
			t.Errorf("rank 1's failure is not in %v", err)
		}
		for _, r := range []int{0, 1, 2} {
			if !strings.Contains(err.Error(), fmt.Sprintf("rank %d: ", r)) {
				t.Errorf("rank %d's error is not named in %v", r, err)
			}
		}
		if !errors.Is(err, ErrPeerFailed) {
			t.Errorf("the other ranks' errors (%v) do not say a peer failed", err)
		}
	}
}

// panicInRank is a bug in a rank's code, named so its frame can be found.
//
//go:noinline
func panicInRank(r int) {
	var positions map[int]int
	positions[r] = 1 // a nil map: panics
}

// TestRunLocalPanicStackOnce: a rank that panics while the others wait in
// a collective makes RunLocal return ErrAborted with the panic's value, and
// its stack (the panicking frame) exactly once, in the panicking rank's
// error; the others' errors name that rank and its panic, without the stack.
func TestRunLocalPanicStackOnce(t *testing.T) {
	err := RunLocal(3, func(c Comm) error {
		if c.Rank() == 1 {
			panicInRank(1)
		}
		buf, err := c.Device().Alloc(64, FP32)
		if err != nil {
			return err
		}
		defer c.Device().Free(buf)
		s := NewHostStream()
		defer s.Close()
		if err := c.AllReduce(s, buf, OpSum); err != nil {
			return err
		}
		return s.Sync()
	})
	if !errors.Is(err, ErrAborted) {
		t.Fatalf("%v, want ErrAborted", err)
	}
	text := err.Error()
	if n := strings.Count(text, "zero.panicInRank("); n != 1 {
		t.Errorf("the panicking frame shows %d times, want once:\n%s", n, text)
	}
	if n := strings.Count(text, "runtime/debug.Stack"); n != 1 {
		t.Errorf("%d stacks, want one:\n%s", n, text)
	}
	if !strings.HasPrefix(text, "rank 0: ") || !strings.Contains(text, "rank 1: zero: aborted: panicked: assignment to entry in nil map") ||
		strings.Count(text, "(its stack is in rank 1's error)") != 2 {
		t.Errorf("want rank 1's error with the panic and its stack, the others pointing to it:\n%s", text)
	}
}

// TestAllReduceScalars: a few of the caller's float64s reduced across 3
// ranks, as sum, average and max, against float64 in rank order: to 48
// bits, over the whole float64 range, the same on every rank.
func TestAllReduceScalars(t *testing.T) {
	value := func(r, i int) float64 { return []float64{0.1, 1e300, -3e-300, math.Pi}[i] * float64(r+1) }
	got := make([][3][]float64, 3)
	err := RunLocal(3, func(c Comm) error {
		vals := []float64{value(c.Rank(), 0), value(c.Rank(), 1), value(c.Rank(), 2), value(c.Rank(), 3)}
		for k, op := range []ReduceOp{OpSum, OpAvg, OpMax} {
			out, err := AllReduceScalars(c, op, vals...)
			if err != nil {
				return err
			}
			got[c.Rank()][k] = out
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		sum, mx := 0.0, math.Inf(-1)
		for r := range 3 {
			sum += value(r, i)
			mx = max(mx, value(r, i))
		}
		for k, want := range []float64{sum, sum / 3, mx} {
			for r := range 3 {
				if g := got[r][k][i]; math.Abs(g-want) > math.Abs(want)*0x1p-46 || g != got[0][k][i] {
					t.Errorf("value %d op %d rank %d: %g, want %g (and rank 0's %g)", i, k, r, g, want, got[0][k][i])
				}
			}
		}
	}
}

// TestDepartureWaitsForSlowPeers: a rank that finished its part of a
// collective waits for every peer to finish theirs, however much longer
// than the group's timeout a peer's part takes (a machine under load): a
// rank that left would free a buffer the peer still copies from. The
// arrival keeps its timeout.
func TestDepartureWaitsForSlowPeers(t *testing.T) {
	comms, _ := NewLocalGroupTimeout(2, time.Minute)
	g := comms[0].(*localComm).g
	args := collArgs{kind: KindBroadcast, dtype: FP32, count: 1}
	for _, err := range eachRank(2, func(r int) error { _, err := g.meet(r, 0, &args); return err }) {
		if err != nil {
			t.Fatal(err)
		}
	}
	g.mu.Lock()
	g.timeout = time.Millisecond // rank 0's part now takes 300 times as long
	g.mu.Unlock()
	left := make(chan error, 1)
	go func() { _, err := g.meet(1, 0, nil); left <- err }()
	select {
	case err := <-left:
		t.Fatalf("rank 1 left before rank 0 finished its part (%v)", err)
	case <-time.After(300 * time.Millisecond):
	}
	if _, err := g.meet(0, 0, nil); err != nil {
		t.Fatal(err)
	}
	if err := <-left; err != nil {
		t.Fatalf("rank 1's departure: %v", err)
	}
	// arriving, a rank still waits at most the timeout for its peers
	start := time.Now()
	if _, err := g.meet(0, 1, &args); !errors.Is(err, ErrTimeout) {
		t.Fatalf("an arrival nobody joins: %v, want ErrTimeout", err)
	}
	t.Logf("the lone arrival gave up after %v", time.Since(start))
}
