package zero

import (
	"errors"
	"sync"
	"testing"
	"time"
)

// Memory and queued work: no function returns memory to its device while
// work queued on a stream can still touch it, on any error path, and the
// buffers of a collective that may still run after it failed are never
// unmapped.

// abortOnce returns a hook that aborts comm the first time it runs.
func abortOnce(comm Comm) func() {
	var once sync.Once
	return func() { once.Do(func() { AbortComm(comm, errors.New("the peer aborts")) }) }
}

// TestScratchFreedAfterQueuedWork: each function that allocates scratch
// memory, queues work on it and can fail, with a peer's Abort during the
// call (or a device call refused after a collective was queued), returns
// within a bound with the error, and frees nothing a queued copy or
// collective still uses (before the frees were stream-ordered,
// AllReduceScalars unmapped its buffer under a queued copy: SIGSEGV).
func TestScratchFreedAfterQueuedWork(t *testing.T) {
	// every rank's own memory for each parameter
	params := func() []Param {
		ps := testParams(FP32)
		for i := range ps {
			ps[i].Data = newTBuf(FP32, ps[i].Count).t()
		}
		return ps
	}
	cfg := Config{Stage: 2, BucketBytes: 1024, Optimizer: OptimizerPolicy{Groups: []Optimizer{NewAdamW(1e-3)}}}
	// engines builds an engine on each of two ranks, rank 0's on a
	// queuedDevice, and runs op on rank 0 and peer on rank 1 (nil: idle).
	engines := func(t *testing.T, cfg Config, op func(e *Engine, qc *queuedComm, peer Comm) error, peer func(e *Engine) error) error {
		comms, _ := NewLocalGroupTimeout(2, 10*time.Second)
		d := newQueuedDevice()
		qc := &queuedComm{Comm: comms[0], dev: d}
		var es [2]*Engine
		errs := eachRank(2, func(rank int) error {
			c := comms[rank]
			if rank == 0 {
				c = qc
			}
			var err error
			es[rank], err = New(cfg, c, params())
			return err
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		errs = eachRank(2, func(rank int) error {
			s := NewHostStream()
			defer s.Close()
			if err := backward(es[rank], s, constGrads(es[rank].params, float32(rank+1))); err != nil {
				return err
			}
			return es[rank].Step()
		})
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		var err error
		within(t, 30*time.Second, func() {
			errs = eachRank(2, func(rank int) error {
				if rank == 0 {
					err := op(es[0], qc, comms[1])
					if err != nil { // as RunLocal does: the peer stops waiting
						AbortComm(comms[0], err)
					}
					return err
				}
				if peer != nil {
					return peer(es[1])
				}
				return nil
			})
			err = errs[0]
			for _, e := range es {
				e.Close()
			}
		})
		if early := d.earlyFrees(); len(early) > 0 {
			t.Errorf("%d early frees, the first: %s", len(early), early[0])
		}
		d.release()
		return err
	}
	t.Run("AllReduceScalars", func(t *testing.T) {
		comms, _ := NewLocalGroupTimeout(2, 10*time.Second)
		d := newQueuedDevice()
		qc := &queuedComm{Comm: comms[0], dev: d, before: abortOnce(comms[1])}
		var err error
		within(t, 30*time.Second, func() { _, err = AllReduceScalars(qc, OpSum, 1, 2, 3) })
		if !errors.Is(err, ErrPeerFailed) {
			t.Errorf("got %v, want ErrPeerFailed", err)
		}
		if early := d.earlyFrees(); len(early) > 0 {
			t.Errorf("%d early frees, the first: %s", len(early), early[0])
		}
		d.release()
	})
	t.Run("New", func(t *testing.T) {
		comms, _ := NewLocalGroupTimeout(2, 10*time.Second)
		d := newQueuedDevice()
		qc := &queuedComm{Comm: comms[0], dev: d, before: abortOnce(comms[1])}
		var err error
		within(t, 30*time.Second, func() {
			var e *Engine
			if e, err = New(cfg, qc, params()); err == nil {
				e.Close()
			}
		})
		if !errors.Is(err, ErrPeerFailed) {
			t.Errorf("got %v, want ErrPeerFailed", err)
		}
		if early := d.earlyFrees(); len(early) > 0 {
			t.Errorf("%d early frees, the first: %s", len(early), early[0])
		}
		d.release()
	})
	t.Run("Save", func(t *testing.T) {
		dir := t.TempDir()
		err := engines(t, cfg, func(e *Engine, qc *queuedComm, peer Comm) error {
			qc.before = abortOnce(peer)
			return e.Save(dir, SaveOptions{})
		}, nil)
		if !errors.Is(err, ErrPeerFailed) {
			t.Errorf("got %v, want ErrPeerFailed", err)
		}
	})
	t.Run("Load", func(t *testing.T) {
		dir := t.TempDir()
		err := engines(t, cfg, func(e *Engine, qc *queuedComm, peer Comm) error {
			qc.before = abortOnce(peer)
			_, err := e.Load(dir, LoadOptions{})
			return err
		}, nil)
		if !errors.Is(err, ErrPeerFailed) {
			t.Errorf("got %v, want ErrPeerFailed", err)
		}
	})
	// A device call refused after the collective was queued: the
	// collective still writes into the scratch once it runs.
	t.Run("FullParams", func(t *testing.T) {
		err := engines(t, with(cfg, func(c *Config) { c.Stage = 3 }), func(e *Engine, qc *queuedComm, _ Comm) error {
			qc.dev.gateEach, qc.dev.failKernel = true, "cast"
			_, err := e.FullParams()
			return err
		}, func(e *Engine) error { _, err := e.FullParams(); return err })
		if !errors.Is(err, errInjected) {
			t.Errorf("got %v, want the injected failure", err)
		}
	})
	t.Run("New stage 3 Init", func(t *testing.T) {
		comms, _ := NewLocalGroupTimeout(2, 10*time.Second)
		d := newQueuedDevice()
		ps := testParams(FP32)
		// the cast after loadShard's, one per bucket: uploadCast's
		d.gateEach, d.failKernel, d.failSkip = true, "cast", len(newPlan(ps, cfg.BucketBytes, 2, 64).Buckets)
		for i := range ps {
			ps[i].Init = func(dst []float32, _ int) error { return nil }
		}
		var err error
		within(t, 30*time.Second, func() {
			errs := eachRank(2, func(rank int) error {
				var c Comm = &queuedComm{Comm: comms[0], dev: d}
				if rank == 1 {
					c = comms[1]
				}
				e, err := New(with(cfg, func(c *Config) { c.Stage = 3 }), c, ps)
				if err != nil {
					AbortComm(comms[rank], err)
					return err
				}
				return e.Close()
			})
			err = errs[0]
		})
		if !errors.Is(err, errInjected) {
			t.Errorf("got %v, want the injected failure", err)
		}
		if early := d.earlyFrees(); len(early) > 0 {
			t.Errorf("%d early frees, the first: %s", len(early), early[0])
		}
		d.release()
	})
}

// TestFreeAfterWaitsForTheStream: freeAfter returns at once and frees the
// memory only after the work queued before it, on every stream it names
// (a failed stream too); on a closed stream at once.
func TestFreeAfterWaitsForTheStream(t *testing.T) {
	d := newCountingDevice()
	d.freeAtOnce = true
	a, openA := gateStream()
	b, openB := gateStream()
	defer a.Close()
	defer b.Close()
	x, _ := d.Alloc(100, FP32)
	defer openA()
	defer openB()
	within(t, 10*time.Second, func() { freeAfter(d, x, a, b) })
	if d.frees.Load() != 0 {
		t.Fatal("freed while both streams were held")
	}
	openA()
	settleBehind(t, a, b)
	if d.frees.Load() != 0 {
		t.Fatal("freed while the second stream was held")
	}
	a.Launch(func() error { return errors.New("later work fails") })
	openB()
	if err := a.Sync(); err == nil {
		t.Fatal("the failing work did not fail the stream")
	}
	if d.frees.Load() != 1 || d.liveCount() != 0 {
		t.Fatalf("%d frees, %d live after both streams ran", d.frees.Load(), d.liveCount())
	}
	c := NewHostStream()
	c.Close()
	y, _ := d.Alloc(100, FP32)
	freeAfter(d, y, c)
	if d.liveCount() != 0 {
		t.Fatal("not freed at once on a closed stream")
	}
}

// slowEventStream records events that fire only once gate is closed, as a
// device's events fire after the host has moved on.
type slowEventStream struct {
	*HostStream
	gate chan struct{}
}

type slowEvent struct {
	Event
	gate chan struct{}
}

func (s slowEventStream) Record() (Event, error) {
	ev, err := s.HostStream.Record()
	return slowEvent{ev, s.gate}, err
}

func (s slowEventStream) recordUntimed(Event) (Event, error) { return s.Record() }

func (e slowEvent) Done() bool {
	select {
	case <-e.gate:
		return e.Event.Done()
	default:
		return false
	}
}

func (e slowEvent) Sync() error { <-e.gate; return e.Event.Sync() }

// TestFreeSyncedFreesAtOnce: scratch whose stream the caller synced after
// its last use goes back at once, even where an event recorded now would
// fire later (a GPU's: the fake driver's estimate test saw such scratch in
// the next allocation's high-water mark); unsynced, it waits for the event.
func TestFreeSyncedFreesAtOnce(t *testing.T) {
	d := newCountingDevice()
	s := slowEventStream{NewHostStream(), make(chan struct{})}
	defer s.Close()
	a, _ := d.Alloc(4, FP32)
	freeSynced(d, a, true, s)
	if got := d.liveCount(); got != 0 {
		t.Fatalf("%d allocations live after a synced free, want 0", got)
	}
	b, _ := d.Alloc(4, FP32)
	freeSynced(d, b, false, s)
	if got := d.liveCount(); got != 1 {
		t.Fatalf("%d allocations live before the stream's event fired, want 1", got)
	}
	close(s.gate)
	within(t, 10*time.Second, func() {
		for d.liveCount() != 0 {
			time.Sleep(time.Millisecond)
		}
	})
}
