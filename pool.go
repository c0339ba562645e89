package zero

// allocator is where a pool's buffers come from: a Device, or the host's
// page-locked memory of an offloading engine.
type allocator interface {
	Alloc(count int, d DType) (Tensor, error)
	Free(t Tensor) error
}

// buffer is a pooled device buffer. free fires when the last work that
// read or wrote it has finished; whoever takes it next waits on that.
type buffer struct {
	t    Tensor
	free Event
	from *bufferPool
}

// release gives the buffer back to its pool; free fires when its last
// user is done with it.
//
// A buffer of no pool lends memory another owns (the shard's, hosting local
// sums): there is nothing to give back.
func (b *buffer) release(free Event) {
	if b.from != nil {
		b.from.put(b, free)
	}
}

// bufferPool keeps buffers of one dtype between uses, by element count, so
// the steady state allocates nothing. Buffers of one size come back
// first-freed-first: two staging buffers ping-pong, the next bucket filling
// one while the other is reduced.
type bufferPool struct {
	dev   allocator
	dtype DType
	mem   *memoryMeter
	idle  map[int][]*buffer // by element count
	held  int               // buffers allocated, idle or handed out
	bytes int64             // bytes of the idle buffers
}

func newBufferPool(dev allocator, dtype DType, mem *memoryMeter) *bufferPool {
	return &bufferPool{dev: dev, dtype: dtype, mem: mem, idle: map[int][]*buffer{}}
}

// get hands out a buffer of n elements, allocating one if none is idle.
// Its content is whatever the last user left.
func (p *bufferPool) get(n int) (*buffer, error) {
	if q := p.idle[n]; len(q) > 0 {
		b := q[0]
		p.idle[n] = q[1:]
		p.bytes -= int64(b.t.Bytes())
		p.mem.use(int64(b.t.Bytes()))
		return b, nil
	}
	if err := p.grow(n, 1); err != nil {
		return nil, err
	}
	return p.get(n)
}

// grow adds k idle buffers of n elements.
func (p *bufferPool) grow(n, k int) error {
	for range k {
		t, err := p.dev.Alloc(n, p.dtype)
		if err != nil {
			return err
		}
		p.held++
		p.mem.hold(int64(t.Bytes()))
		p.mem.use(int64(t.Bytes())) // put counts it out again
		p.put(&buffer{t: t, from: p}, nil)
	}
	return nil
}

// put takes a buffer back; free fires when its last user is done with it.
func (p *bufferPool) put(b *buffer, free Event) {
	b.free = free
	n := b.t.count
	p.idle[n] = append(p.idle[n], b)
	p.bytes += int64(b.t.Bytes())
	p.mem.use(-int64(b.t.Bytes()))
}

// trim frees idle buffers, the longest idle first, until the pool holds
// keep buffers or none is idle. A buffer is freed only once its last user
// has finished with it.
func (p *bufferPool) trim(keep int) error {
	var first error
	for n, q := range p.idle {
		for p.held > keep && len(q) > 0 {
			b := q[0]
			q = q[1:]
			if b.free != nil {
				if err := b.free.Sync(); err != nil && first == nil {
					first = err
				}
			}
			p.bytes -= int64(b.t.Bytes())
			p.mem.hold(-int64(b.t.Bytes()))
			if err := p.dev.Free(b.t); err != nil && first == nil {
				first = err
			}
			p.held--
		}
		p.idle[n] = q
	}
	return first
}

// memoryMeter tracks the bytes a component holds (allocated: in use or
// idle in its pools) and the part in use (allocated less pooled, what
// PyTorch's memory_allocated counts, its cache being the pools), with the
// peak of each. A buffer counts as in use from get until put, even if the
// work put waits for is still running: PyTorch counts a freed tensor the
// same way.
type memoryMeter struct {
	cur, peak        int64 // held
	inUse, peakInUse int64 // held less pooled
}

// add counts n bytes allocated and in use (negative: freed).
func (m *memoryMeter) add(n int64) {
	m.hold(n)
	m.use(n)
}

// hold counts n bytes allocated idle, or (negative) an idle buffer freed.
func (m *memoryMeter) hold(n int64) {
	m.cur += n
	m.peak = max(m.peak, m.cur)
}

// use moves n bytes into use (negative: back to a pool).
func (m *memoryMeter) use(n int64) {
	m.inUse += n
	m.peakInUse = max(m.peakInUse, m.inUse)
}

// restart starts the peaks again from what is held and in use now.
func (m *memoryMeter) restart() {
	m.peak, m.peakInUse = m.cur, m.inUse
}
