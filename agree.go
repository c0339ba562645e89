package zero

import (
	"errors"
	"fmt"
	"math"
	"strings"
)

// Every comparison across ranks: Step's check (below) and, at New, the
// settings record's (checkSettings, after it).
//
// Step's first collective: one small max-all-reduce from which every rank
// learns what every rank claims about the window, so every rank refuses the
// same windows before anything changes. It carries (G, −G), the largest
// and smallest number of backwards taken; at stage 3 with parameter shards
// the references still gathered; with an optimizer the digest of the
// groups' settings as three 16-bit pieces and their negations (equal maxima:
// every rank has the same groups), then whether each parameter was
// reported on any rank (the optimizer skips the others).

// stepCheck is that collective's buffer and its layout.
type stepCheck struct {
	dev  Device
	comm Comm
	s    Stream
	buf  Tensor       // fp32, the all-reduce's
	refs int          // where the references go (−1: absent)
	dig  int          // where the digest and its negation go (−1: absent)
	used int          // where the used flags start (−1: absent)
	sent CommCounters // the all-reduces, for the stats
}

// digestWords is how many 16-bit pieces of a digest the all-reduce
// carries: each an integer that fp32 holds exactly.
const digestWords = 3

// errCheckFailed marks a failure of the collective itself (not a refused
// window): the engine cannot go on. checkFailed carries the mark without
// a word in the message, which starts with what was seen.
var errCheckFailed = errors.New("the window check failed")

type checkFailed struct{ error }

func (c checkFailed) Is(target error) bool { return target == errCheckFailed }
func (c checkFailed) Unwrap() error        { return c.error }

func newStepCheck(dev Device, comm Comm, s Stream, params int, refs, optimizer bool) (*stepCheck, error) {
	c := &stepCheck{dev: dev, comm: comm, s: s}
	var words int
	c.refs, c.dig, c.used, words = stepCheckLayout(params, refs, optimizer)
	var err error
	c.buf, err = dev.Alloc(words, FP32)
	return c, err
}

// stepCheckLayout places the check's words: (G, −G) first, then (refs)
// the gathered references, then (optimizer) the groups' digest and its
// negation and a word per parameter; -1 for a part it does not have. words is the fp32 words of its one all-reduce.
func stepCheckLayout(params int, refs, optimizer bool) (refsAt, digestAt, usedAt, words int) {
	refsAt, digestAt, usedAt, words = -1, -1, -1, 2
	if refs {
		refsAt, words = words, words+1
	}
	if optimizer {
		digestAt, usedAt, words = words, words+2*digestWords, words+2*digestWords+params
	}
	return refsAt, digestAt, usedAt, words
}

// stepCheckSize is what newStepCheck allocates.
func stepCheckSize(params int, refs, optimizer bool) DeviceBytes {
	_, _, _, words := stepCheckLayout(params, refs, optimizer)
	return DeviceBytes{Control: int64(words) * 4}
}

// windowClaims is what this rank claims about the window.
type windowClaims struct {
	backwards  int
	gathered   int    // parameter references still gathered (stage 3)
	digest     uint64 // of the groups' settings
	groups     []Optimizer
	used       []bool // per parameter: reported on this rank
	accumSteps int    // Grads.AccumSteps (0: any)
}

// agree runs the check and returns G and whether each parameter was
// reported on any rank. A refused window comes back as its typed error,
// the same on every rank; a failed collective wraps errCheckFailed.
func (c *stepCheck) agree(w windowClaims) (int, []bool, error) {
	n := float32(w.backwards)
	buf := make([]float32, c.buf.count)
	buf[0], buf[1] = n, -n
	if c.refs >= 0 {
		buf[c.refs] = float32(w.gathered)
	}
	if c.dig >= 0 {
		for i := range digestWords {
			x := float32(w.digest >> (16 * i) & 0xffff)
			buf[c.dig+i], buf[c.dig+digestWords+i] = x, -x
		}
	}
	for p, used := range w.used {
		if used && c.used >= 0 {
			buf[c.used+p] = 1
		}
	}
	failed := func(err error) (int, []bool, error) {
		return 0, nil, checkFailed{divergence("Step", w.backwards, err)}
	}
	if err := c.dev.copy(c.s, c.buf, Float32s(buf)); err != nil {
		return failed(err)
	}
	if err := c.comm.AllReduce(c.s, c.buf, OpMax); err != nil {
		return failed(err)
	}
	c.sent.add(KindAllReduce, c.buf.Bytes(), c.comm.Size())
	if err := c.dev.copy(c.s, Float32s(buf), c.buf); err != nil {
		return failed(err)
	}
	if err := c.s.Sync(); err != nil {
		return failed(err)
	}
	groupsDiffer := false
	for i := 0; c.dig >= 0 && i < digestWords; i++ {
		groupsDiffer = groupsDiffer || buf[c.dig+i] != -buf[c.dig+digestWords+i]
	}
	most, least := int(buf[0]), int(-buf[1])
	switch {
	case groupsDiffer: // every rank sees it: every rank takes part in naming it
		records, err := allGatherBytes(c.dev, c.comm, c.s, encodeRecord(groupsRecord(w.groups), ""))
		if err != nil {
			return failed(err)
		}
		return 0, nil, settingsError(records, "Step after SetGroup")
	case c.refs >= 0 && buf[c.refs] > 0:
		return 0, nil, errorf(ErrProtocol, "Step with parameters still gathered (%d references on some rank, %d here); Release what Gather returned first", int(buf[c.refs]), w.gathered)
	case most != least:
		return 0, nil, errorf(ErrCollectiveMismatch, "Step: ranks took between %d and %d backwards since the last Step (this rank %d); every rank must take the same number", least, most, w.backwards)
	case most == 0:
		return 0, nil, errorf(ErrProtocol, "Step with no backward since the last Step; report gradients and call EndBackward first")
	case w.accumSteps > 0 && most != w.accumSteps:
		return 0, nil, errorf(ErrProtocol, "Step after %d backwards with Grads.AccumSteps %d; take %d backwards per step, or leave AccumSteps at 0 to divide by the backwards taken", most, w.accumSteps, w.accumSteps)
	}
	used := make([]bool, len(w.used))
	for p := range used {
		used[p] = c.used < 0 || buf[c.used+p] != 0
	}
	return most, used, nil
}

// divergence names the likely cause of a collective that met another kind
// of collective, or no peer, on an engine's communicator (op failed with
// err after this rank's backwards since the last Step).
func divergence(op string, backwards int, err error) error {
	if !errors.Is(err, ErrCollectiveMismatch) && !errors.Is(err, ErrTimeout) {
		return err
	}
	// What was seen comes first (which rank did not come, or what each
	// called); the causes it may have, after.
	return fmt.Errorf("%s: %w; check that every rank takes the same number of backwards (this rank has taken %d since the last Step), calls windows, gathers, reads and Step at the same points, and at stage 3 hands over the same parameters in a backward that gathers", op, err, backwards)
}

// report counts the check's all-reduce in the step's collectives.
func (c *stepCheck) report(st *Stats) error {
	st.Collectives = st.Collectives.Add(c.sent)
	st.ControlBytes += int64(c.buf.Bytes())
	c.sent = CommCounters{}
	return nil
}

func (c *stepCheck) close() error { return c.dev.Free(c.buf) }

// ---- the settings, compared across ranks ---------------------------------------------

// allGatherWords gives every rank every rank's words (the same number on
// each), through the device's memory, on s.
func allGatherWords(dev Device, comm Comm, s Stream, mine []uint32) ([][]uint32, error) {
	n, world := len(mine), comm.Size()
	words := make([]float32, n*world)
	for i, w := range mine {
		words[comm.Rank()*n+i] = math.Float32frombits(w) // the bits travel as they are: an all-gather copies
	}
	buf, err := dev.Alloc(n*world, FP32)
	if err != nil {
		return nil, err
	}
	synced := false
	defer func() { freeSynced(dev, buf, synced, s) }()
	part := buf.slice(comm.Rank()*n, n)
	if err := dev.copy(s, part, Float32s(words[comm.Rank()*n:(comm.Rank()+1)*n])); err != nil {
		return nil, err
	}
	if err := comm.AllGather(s, part, buf); err != nil {
		return nil, err
	}
	if err := dev.copy(s, Float32s(words), buf); err != nil {
		return nil, err
	}
	if err := s.Sync(); err != nil {
		return nil, err
	}
	synced = true
	out := make([][]uint32, world)
	for r := range out {
		out[r] = make([]uint32, n)
		for i := range n {
			out[r][i] = math.Float32bits(words[r*n+i])
		}
	}
	return out, nil
}

// allGatherBytes gives every rank every rank's bytes, of any length: the
// lengths first, then the bytes padded to the longest.
func allGatherBytes(dev Device, comm Comm, s Stream, mine []byte) ([][]byte, error) {
	lens, err := allGatherWords(dev, comm, s, []uint32{uint32(len(mine))})
	if err != nil {
		return nil, err
	}
	longest := 0
	for _, l := range lens {
		longest = max(longest, int(l[0]))
	}
	words := make([]uint32, (longest+3)/4)
	for i, b := range mine {
		words[i/4] |= uint32(b) << (8 * (i % 4))
	}
	all, err := allGatherWords(dev, comm, s, words)
	if err != nil {
		return nil, err
	}
	out := make([][]byte, len(all))
	for r, ws := range all {
		out[r] = make([]byte, lens[r][0])
		for i := range out[r] {
			out[r][i] = byte(ws[i/4] >> (8 * (i % 4)))
		}
	}
	return out, nil
}

// settingsError names, the same way on every rank, the first setting in
// which a rank's record differs from rank 0's.
func settingsError(records [][]byte, what string) error {
	first := decodeRecord(records[0])
	for r := 1; r < len(records); r++ {
		path, v0, vr, found := firstDifference(first, decodeRecord(records[r]))
		if !found {
			continue
		}
		fix := "give every rank the same settings"
		if strings.HasPrefix(path, "Model[") {
			fix = "register the same parameters (name, count, shape, dtype, group, frozen) in the same order on every rank"
		}
		return errorf(ErrPlanMismatch, "%s: %s: rank 0 has %s, rank %d has %s; %s", what, path, v0, r, vr, fix)
	}
	return errorf(ErrPlanMismatch, "%s: the ranks' settings hash differently but read the same; give every rank the same settings", what)
}

// checkSettings compares every shared setting across ranks: one all-gather
// of the record's digest, and only where digests differ an exchange of the
// records, so that every rank names the same setting and both values.
func checkSettings(dev Device, comm Comm, s Stream, rec []Setting) error {
	d := recordDigest(rec, "")
	digests, err := allGatherWords(dev, comm, s, []uint32{uint32(d), uint32(d >> 32)})
	if err != nil {
		return err
	}
	same := true
	for _, w := range digests {
		same = same && w[0] == digests[0][0] && w[1] == digests[0][1]
	}
	if same {
		return nil
	}
	records, err := allGatherBytes(dev, comm, s, encodeRecord(rec, ""))
	if err != nil {
		return err
	}
	return settingsError(records, "New")
}
