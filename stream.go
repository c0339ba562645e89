package zero

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Stream is an ordered queue of work on a device, with CUDA's semantics:
// work runs in the order it was enqueued; Wait makes later work wait for
// an event recorded on any stream; Sync blocks the caller until the stream
// is idle and returns the first error the stream met (errors are sticky).
type Stream interface {
	// Record enqueues a marker and returns the event that fires when the
	// stream's work enqueued so far has completed.
	Record() (Event, error)
	// Wait makes work enqueued on this stream after the call wait for e.
	// A nil event is a no-op, as for an event that was never recorded.
	Wait(e Event) error
	// Sync waits until all work enqueued so far has completed.
	Sync() error
	// Close waits for the queue to drain and releases the stream.
	Close() error
}

// Event marks a point in a stream's work.
type Event interface {
	// Sync blocks until the event has fired and returns the error, if any,
	// of the work before it.
	Sync() error
	// Done reports whether the event has fired, without blocking.
	Done() bool
}

// Elapsed returns the time between two fired events of one device.
func Elapsed(start, end Event) (time.Duration, error) {
	type timed interface {
		elapsedSince(Event) (time.Duration, error)
	}
	if t, ok := end.(timed); ok {
		return t.elapsedSince(start)
	}
	return 0, errorf(ErrStream, "Elapsed: events of different devices")
}

// untimedRecorder is a stream that can record an event without timing,
// into an event of its own kind that it re-records (reuse), or into a new
// one when reuse is nil or of another kind.
type untimedRecorder interface {
	recordUntimed(reuse Event) (Event, error)
}

// eventPool hands out untimed events for the producers of a window and
// takes them back all at once, when the window's reductions have waited on
// every one of them.
type eventPool struct {
	free, used []Event
}

// record records an event on s, reusing a pooled one where s can.
func (p *eventPool) record(s Stream) (Event, error) {
	u, ok := s.(untimedRecorder)
	if !ok {
		return s.Record()
	}
	var reuse Event
	if n := len(p.free); n > 0 {
		reuse, p.free = p.free[n-1], p.free[:n-1]
	}
	ev, err := u.recordUntimed(reuse)
	if err != nil {
		if reuse != nil {
			p.free = append(p.free, reuse)
		}
		return nil, err
	}
	p.used = append(p.used, ev)
	return ev, nil
}

// recycle takes back every event handed out; all of them must have fired.
func (p *eventPool) recycle() {
	p.free = append(p.free, p.used...)
	clear(p.used)
	p.used = p.used[:0]
}

// HostStream is the CPU twin of a CUDA stream: one goroutine runs its
// queue. Its events are positions in the queue: an event fires when the
// stream has finished that many items, so recording one enqueues nothing.
type HostStream struct {
	mu       sync.Mutex
	wake     *sync.Cond // the worker waits for work
	finished *sync.Cond // Syncs wait for the work before their event
	queue    []hostOp
	enqueued uint64        // items enqueued so far
	done     atomic.Uint64 // items finished (run or skipped); written under mu
	err      error         // sticky: the first error an item returned
	errAt    uint64        // the number of that item, counting from 1
	syncers  int           // Syncs waiting on finished
	closed   bool
	exited   chan struct{}

	// For tests that must know the stream cannot move on by itself.
	idle      bool                     // the worker waits for work
	blockedOn atomic.Pointer[hostWait] // what a Wait item is blocked on
}

type hostOp struct {
	fn      func() error
	control bool // runs even after an error: waits, timing marks
}

// hostWait is a point of a host stream: its first seq items.
type hostWait struct {
	s   *HostStream
	seq uint64
}

// NewHostStream starts a stream on the host.
func NewHostStream() *HostStream {
	s := &HostStream{exited: make(chan struct{})}
	s.wake = sync.NewCond(&s.mu)
	s.finished = sync.NewCond(&s.mu)
	go s.run()
	return s
}

func (s *HostStream) run() {
	defer close(s.exited)
	s.mu.Lock()
	for {
		for len(s.queue) == 0 && !s.closed {
			s.idle = true
			s.wake.Wait()
		}
		s.idle = false
		if len(s.queue) == 0 {
			s.mu.Unlock()
			return
		}
		op := s.queue[0]
		s.queue[0] = hostOp{}
		s.queue = s.queue[1:]
		failed := s.err != nil
		s.mu.Unlock()
		var err error
		if !failed || op.control {
			err = op.fn()
		}
		s.mu.Lock()
		n := s.done.Load() + 1
		if err != nil && s.err == nil {
			s.err, s.errAt = err, n
		}
		s.done.Store(n)
		if s.syncers > 0 {
			s.finished.Broadcast()
		}
	}
}

// enqueue appends op and returns its number.
func (s *HostStream) enqueue(op hostOp) (uint64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return 0, errorf(ErrClosed, "enqueue on a closed stream")
	}
	s.queue = append(s.queue, op)
	s.enqueued++
	s.wake.Signal()
	return s.enqueued, nil
}

// usable refuses a stream that is closed or has failed: work enqueued on
// it would never run, and the engine would fail with it.
func (s *HostStream) usable() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return errorf(ErrStream, "the stream is closed; pass an open stream")
	case s.err != nil:
		return fmt.Errorf("%w: the stream failed before this call (its work is skipped); fix the work that failed, or pass another stream: %w", ErrStream, s.err)
	}
	return nil
}

// ranAll reports whether every item enqueued so far has run (or been
// skipped): nothing queued can touch memory any more.
func (s *HostStream) ranAll() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.done.Load() >= s.enqueued
}

// failure is the stream's sticky error, or nil.
func (s *HostStream) failure() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err
}

// failedWith reports whether the stream failed with err (or an error that
// wraps it).
func (s *HostStream) failedWith(err error) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.err != nil && errors.Is(err, s.err)
}

// Launch enqueues host work. It is skipped once the stream has failed; an
// error it returns makes the stream fail.
func (s *HostStream) Launch(fn func() error) error {
	_, err := s.enqueue(hostOp{fn: fn})
	return err
}

// waitFor blocks until the stream has finished its first seq items and
// returns the stream's error if one of them failed.
func (s *HostStream) waitFor(seq uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.done.Load() < seq {
		hostSyncsBlocked.Add(1)
		for s.done.Load() < seq {
			s.syncers++
			s.finished.Wait()
			s.syncers--
		}
	}
	return s.errBefore(seq)
}

// errBefore is the stream's error if it came from one of the first seq items.
func (s *HostStream) errBefore(seq uint64) error {
	if s.err != nil && s.errAt <= seq {
		return s.err
	}
	return nil
}

// hostEvent is a point of a host stream's queue. Timed events also take
// the time at which the stream reached them.
type hostEvent struct {
	hostWait
	timed bool
	at    time.Time
}

// hostSyncsBlocked counts the event Syncs that had to wait, for tests that
// must know a caller is waiting.
var hostSyncsBlocked atomic.Int64

// Record returns an event that fires when the work enqueued so far has
// run, and that takes the time it fired (for Elapsed).
func (s *HostStream) Record() (Event, error) {
	e := &hostEvent{timed: true}
	seq, err := s.enqueue(hostOp{control: true, fn: func() error {
		e.at = time.Now()
		return nil
	}})
	if err != nil {
		return nil, err
	}
	e.hostWait = hostWait{s, seq}
	return e, nil
}

// recordTimed points reuse (or a new event) at the work enqueued so far,
// with its time.
func (s *HostStream) recordTimed(reuse Event) (Event, error) {
	e, _ := reuse.(*hostEvent)
	if e == nil {
		e = &hostEvent{}
	}
	seq, err := s.enqueue(hostOp{control: true, fn: func() error {
		e.at = time.Now()
		return nil
	}})
	if err != nil {
		return nil, err
	}
	e.hostWait, e.timed = hostWait{s, seq}, true
	return e, nil
}

// recordUntimed points reuse (or a new event) at the work enqueued so far.
func (s *HostStream) recordUntimed(reuse Event) (Event, error) {
	e, _ := reuse.(*hostEvent)
	if e == nil {
		e = &hostEvent{}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, errorf(ErrClosed, "Record on a closed stream")
	}
	e.hostWait, e.timed = hostWait{s, s.enqueued}, false
	return e, nil
}

// Wait makes the stream's later work wait for e, which may be an event of
// any device: the stream's worker waits, never the caller. An error of the
// work before e fails this stream too, so errors travel along
// dependencies instead of being read as good data.
func (s *HostStream) Wait(e Event) error {
	if e == nil {
		return nil
	}
	he, ok := e.(*hostEvent)
	if !ok {
		_, err := s.enqueue(hostOp{control: true, fn: e.Sync})
		return err
	}
	w := he.hostWait // the point as it is now, whatever e is re-recorded to later
	if w.s == s {
		return nil // in order already; an error is sticky on this stream anyway
	}
	if w.s.done.Load() >= w.seq {
		w.s.mu.Lock()
		err := w.s.errBefore(w.seq)
		w.s.mu.Unlock()
		if err == nil {
			return nil // fired
		}
	}
	_, err := s.enqueue(hostOp{control: true, fn: func() error {
		s.blockedOn.Store(&w)
		defer s.blockedOn.Store(nil)
		return w.s.waitFor(w.seq)
	}})
	return err
}

// settled reports whether the stream cannot move on by itself: it has no
// work left, or it is blocked on a point of another stream not yet reached.
func (s *HostStream) settled() bool {
	if w := s.blockedOn.Load(); w != nil && w.s.done.Load() < w.seq {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.queue) == 0 && s.idle
}

// Sync blocks until the work enqueued so far has run, and returns the
// stream's first error.
func (s *HostStream) Sync() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return errorf(ErrClosed, "Sync on a closed stream")
	}
	seq := s.enqueued
	s.mu.Unlock()
	return s.waitFor(seq)
}

// Close drains the queue, stops the stream and returns its error. Closing
// a closed stream does nothing.
func (s *HostStream) Close() error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return nil
	}
	err := s.Sync()
	s.mu.Lock()
	s.closed = true
	s.wake.Signal()
	s.mu.Unlock()
	<-s.exited
	return err
}

// Sync blocks until the event has fired and returns the error, if any, of
// the work before it.
func (e *hostEvent) Sync() error { return e.s.waitFor(e.seq) }

// Done reports whether the event has fired.
func (e *hostEvent) Done() bool { return e.s.done.Load() >= e.seq }

func (e *hostEvent) elapsedSince(start Event) (time.Duration, error) {
	se, ok := start.(*hostEvent)
	if !ok {
		return 0, errorf(ErrStream, "Elapsed: events of different devices")
	}
	if !se.timed || !e.timed {
		return 0, errorf(ErrStream, "Elapsed: an event recorded without timing")
	}
	if err := se.Sync(); err != nil {
		return 0, err
	}
	if err := e.Sync(); err != nil {
		return 0, err
	}
	return e.at.Sub(se.at), nil
}

// stopwatch times spans of stream work for the stats with timed events it
// recycles: mark hands one out, take measures the spans and takes their
// events back, so a steady state creates none (a CUDA event made per
// reduction would be destroyed only by the garbage collector). Its events
// are for timing only: a fence is recorded apart (mark's untimed twin,
// record), since a recycled event will mark another point.
type stopwatch struct {
	free  [2][]Event // host events, and the device's
	spans [][2]Event
}

// eventSide is where a stream's or an event's kind of event lives: 0 on
// the host, 1 on a device.
func eventSide(x any) int {
	switch x.(type) {
	case *HostStream, *hostEvent:
		return 0
	}
	return 1
}

// timedRecorder is a stream that can re-record a timed event of its own
// kind (or record a new one when reuse is nil or of another kind).
type timedRecorder interface {
	recordTimed(reuse Event) (Event, error)
}

// mark records a timed event on s, reusing a recycled one where s can.
func (w *stopwatch) mark(s Stream) (Event, error) {
	t, ok := s.(timedRecorder)
	if !ok {
		return s.Record()
	}
	side := eventSide(s)
	var reuse Event
	if n := len(w.free[side]); n > 0 {
		reuse, w.free[side] = w.free[side][n-1], w.free[side][:n-1]
	}
	ev, err := t.recordTimed(reuse)
	if err != nil && reuse != nil {
		w.free[side] = append(w.free[side], reuse)
	}
	return ev, err
}

// add counts the work between start and end, two of mark's events.
func (w *stopwatch) add(start, end Event) { w.spans = append(w.spans, [2]Event{start, end}) }

// take sums the spans' times, empties them and takes their events back.
func (w *stopwatch) take() (time.Duration, error) {
	var d time.Duration
	for _, ev := range w.spans {
		t, err := Elapsed(ev[0], ev[1])
		if err != nil {
			return 0, err
		}
		d += t
	}
	for _, ev := range w.spans {
		w.release(ev[0], ev[1])
	}
	w.spans = w.spans[:0]
	return d, nil
}

// release takes back marks that no span holds and nothing waits for.
func (w *stopwatch) release(evs ...Event) {
	for _, ev := range evs {
		if ev != nil {
			side := eventSide(ev)
			w.free[side] = append(w.free[side], ev)
		}
	}
}

// record returns a new event after the work enqueued on s so far, untimed
// where s can: a fence that others wait on, never recycled.
func record(s Stream) (Event, error) {
	if u, ok := s.(untimedRecorder); ok {
		return u.recordUntimed(nil)
	}
	return s.Record()
}

// fence returns an event after the work enqueued on s so far, for buffers
// that a failed operation leaves in use; where s cannot record one it
// waits for s instead and returns nil.
func fence(s Stream) Event {
	ev, err := record(s)
	if err != nil {
		s.Sync() // its error went to the caller that failed
		return nil
	}
	return ev
}
