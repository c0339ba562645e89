package zero

import (
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// TestHostStreamOrder: work runs in enqueue order, one item at a time.
func TestHostStreamOrder(t *testing.T) {
	s := NewHostStream()
	defer s.Close()
	var got []int
	for i := range 100 {
		s.Launch(func() error { got = append(got, i); return nil })
	}
	if err := s.Sync(); err != nil {
		t.Fatal(err)
	}
	if len(got) != 100 {
		t.Fatalf("%d of 100 items ran", len(got))
	}
	for i, v := range got {
		if v != i {
			t.Fatalf("item %d ran as %d", i, v)
		}
	}
}

// TestHostStreamWait: work after Wait(e) runs after the work before e on
// the other stream, and not before; work before the Wait is not held.
func TestHostStreamWait(t *testing.T) {
	a, b := NewHostStream(), NewHostStream()
	defer a.Close()
	defer b.Close()
	gate := make(chan struct{})
	var aDone atomic.Bool
	a.Launch(func() error { <-gate; aDone.Store(true); return nil })
	ev, _ := a.Record()
	early := make(chan struct{})
	b.Launch(func() error { close(early); return nil })
	b.Wait(ev)
	var sawA atomic.Bool
	b.Launch(func() error { sawA.Store(aDone.Load()); return nil })
	select {
	case <-early:
	case <-time.After(10 * time.Second):
		t.Error("work enqueued before Wait was held back")
	}
	if ev.Done() {
		t.Error("event fired before its work ran")
	}
	close(gate)
	if err := b.Sync(); err != nil {
		t.Fatal(err)
	}
	if !sawA.Load() {
		t.Error("work after Wait ran before the awaited work")
	}
	if !ev.Done() {
		t.Error("event not fired after Sync of a waiter")
	}
	if err := b.Wait(nil); err != nil {
		t.Errorf("Wait(nil): %v", err)
	}
}

// TestHostStreamErrors: an error is sticky, skips later work, fires
// events with the error and fails streams that wait on them.
func TestHostStreamErrors(t *testing.T) {
	a, b := NewHostStream(), NewHostStream()
	defer b.Close()
	boom := errors.New("boom")
	a.Launch(func() error { return boom })
	ran := false
	a.Launch(func() error { ran = true; return nil })
	ev, _ := a.Record()
	if err := ev.Sync(); !errors.Is(err, boom) {
		t.Errorf("event: %v, want boom", err)
	}
	if err := a.Sync(); !errors.Is(err, boom) || ran {
		t.Errorf("Sync: %v (later work ran: %v), want boom and skipped", err, ran)
	}
	b.Wait(ev)
	if err := b.Sync(); !errors.Is(err, boom) {
		t.Errorf("waiter: %v, want boom", err)
	}
	if err := a.Close(); !errors.Is(err, boom) {
		t.Errorf("Close: %v", err)
	}
	if err := a.Launch(func() error { return nil }); !errors.Is(err, ErrClosed) {
		t.Errorf("Launch after Close: %v, want ErrClosed", err)
	}
}

func TestElapsed(t *testing.T) {
	s := NewHostStream()
	defer s.Close()
	e0, _ := s.Record()
	s.Launch(func() error { time.Sleep(5 * time.Millisecond); return nil })
	e1, _ := s.Record()
	d, err := Elapsed(e0, e1)
	if err != nil || d < 5*time.Millisecond {
		t.Errorf("Elapsed = %v, %v; want ≥ 5ms", d, err)
	}
}

// TestHostAllocStagger: allocations are 64-byte aligned and do not all sit
// at one offset modulo a large power of two.
func TestHostAllocStagger(t *testing.T) {
	seen := map[uintptr]bool{}
	for range 8 {
		x, err := CPU().Alloc(1<<20, FP32)
		if err != nil {
			t.Fatal(err)
		}
		defer CPU().Free(x)
		if x.ptr%64 != 0 {
			t.Errorf("%#x is not 64-byte aligned", x.ptr)
		}
		for _, v := range x.hostFloats()[:1024] {
			if v != 0 {
				t.Fatal("Alloc did not zero")
			}
		}
		seen[x.ptr%(1<<16)] = true
	}
	if len(seen) < 8 {
		t.Errorf("8 buffers share %d offsets modulo 64 KiB", len(seen))
	}
}

// foreignEvent is an event of another device: it fires when fire is closed.
type foreignEvent struct{ fire chan struct{} }

func (e foreignEvent) Sync() error { <-e.fire; return nil }
func (e foreignEvent) Done() bool {
	select {
	case <-e.fire:
		return true
	default:
		return false
	}
}

// TestHostStreamWaitsOnAnotherDevice: a host stream waits on an event of
// another device on its worker: Wait returns at once, and the work after
// it runs only once the event fires.
func TestHostStreamWaitsOnAnotherDevice(t *testing.T) {
	s := NewHostStream()
	defer s.Close()
	ev := foreignEvent{make(chan struct{})}
	if err := s.Wait(ev); err != nil { // must not block: nothing fires ev yet
		t.Fatal(err)
	}
	var ran atomic.Bool
	s.Launch(func() error { ran.Store(true); return nil })
	after, _ := s.Record()
	if after.Done() || ran.Load() {
		t.Fatal("work after the Wait ran before the event fired")
	}
	close(ev.fire)
	if err := after.Sync(); err != nil || !ran.Load() {
		t.Fatalf("after the event fired: %v, ran %v", err, ran.Load())
	}
}

// TestHostEventsArePoints: an untimed event is a point of the queue: it
// fires when the work before it has run, carries the error of that work
// only, and can be re-recorded from a pool; a Wait keeps the point it saw.
func TestHostEventsArePoints(t *testing.T) {
	a, b := NewHostStream(), NewHostStream()
	defer b.Close()
	gate := make(chan struct{})
	a.Launch(func() error { <-gate; return nil })
	var pool eventPool
	before, err := pool.record(a)
	if err != nil {
		t.Fatal(err)
	}
	boom := errors.New("boom")
	a.Launch(func() error { return boom })
	failed, _ := pool.record(a)
	if before.Done() || failed.Done() {
		t.Fatal("events fired before their work ran")
	}
	if err := b.Wait(before); err != nil {
		t.Fatal(err)
	}
	var sawGate atomic.Bool
	b.Launch(func() error {
		select {
		case <-gate:
			sawGate.Store(true)
		default:
		}
		return nil
	})
	close(gate)
	if err := before.Sync(); err != nil {
		t.Errorf("event before the failing item: %v, want no error", err)
	}
	if err := failed.Sync(); !errors.Is(err, boom) {
		t.Errorf("event after the failing item: %v, want boom", err)
	}
	if err := b.Sync(); err != nil || !sawGate.Load() {
		t.Errorf("waiter on the earlier point: %v, ran after the gate %v", err, sawGate.Load())
	}
	if _, err := Elapsed(before, failed); !errors.Is(err, ErrStream) {
		t.Errorf("Elapsed of untimed events: %v, want ErrStream", err)
	}
	// Re-recorded on another stream, a pooled event is that stream's point.
	pool.recycle()
	reused, err := pool.record(b)
	if err != nil {
		t.Fatal(err)
	}
	if reused != failed && reused != before {
		t.Error("the pool did not reuse an event")
	}
	if err := reused.Sync(); err != nil {
		t.Errorf("reused on a good stream: %v", err)
	}
	a.Close()
}

// TestBufferPoolOrder: buffers of one size come back first-freed-first, so
// the next bucket takes the buffer whose reduction was issued longest ago
// (not the one just handed back, whose reduction may still run).
func TestBufferPoolOrder(t *testing.T) {
	var meter memoryMeter
	p := newBufferPool(CPU(), FP32, &meter)
	if err := p.grow(64, 3); err != nil {
		t.Fatal(err)
	}
	defer p.trim(0)
	var got []*buffer
	for range 3 {
		b, err := p.get(64)
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, b)
	}
	for _, i := range []int{1, 2, 0} { // handed back in this order
		p.put(got[i], nil)
	}
	for _, i := range []int{1, 2, 0} {
		b, err := p.get(64)
		if err != nil {
			t.Fatal(err)
		}
		if b != got[i] {
			t.Fatalf("the pool handed out another buffer than the one freed longest ago (buffer %d)", i)
		}
		p.put(b, nil)
	}
	if p.held != 3 || meter.cur != 3*64*4 {
		t.Fatalf("%d buffers and %d bytes held, want 3 and %d", p.held, meter.cur, 3*64*4)
	}
}
