package deepspeed

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// WriteSafetensors writes tensors as one safetensors file, laid out as
// Python's safetensors (0.8) lays out the same tensors: the data ordered
// by dtype (widest first, in the library's order) then by name, the
// header compact JSON in that order after "__metadata__", padded with
// spaces to a multiple of 8. So a file converted here is byte for byte
// the one zero_to_fp32 writes. The file is written under a temporary
// name, synced and renamed: an error leaves no partial file at path.
// zero's own safetensors export writes an engine's parameters; this one
// writes any named tensors, which the converter needs.
func WriteSafetensors(path string, tensors []NamedTensor, metadata map[string]string) (err error) {
	ts := slices.Clone(tensors)
	seen := map[string]bool{}
	for _, t := range ts {
		switch {
		case t.Name == "" || t.Name == "__metadata__" || !utf8.ValidString(t.Name):
			return fmt.Errorf("deepspeed: safetensors: tensor name %q", t.Name)
		case seen[t.Name]:
			return fmt.Errorf("deepspeed: safetensors: tensor %q twice", t.Name)
		case !t.DType.valid():
			return fmt.Errorf("deepspeed: safetensors: tensor %q has dtype %v", t.Name, t.DType)
		case numel(t.Shape)*t.DType.Size() != len(t.Data):
			return fmt.Errorf("deepspeed: safetensors: tensor %q of shape %v holds %d bytes", t.Name, t.Shape, len(t.Data))
		}
		seen[t.Name] = true
	}
	slices.SortStableFunc(ts, func(a, b NamedTensor) int {
		if ra, rb := stRank[a.DType], stRank[b.DType]; ra != rb {
			return rb - ra
		}
		return strings.Compare(a.Name, b.Name)
	})
	var h strings.Builder
	h.WriteByte('{')
	if len(metadata) > 0 {
		h.WriteString(`"__metadata__":{`)
		keys := sortedKeys(metadata)
		for i, k := range keys {
			if i > 0 {
				h.WriteByte(',')
			}
			jsonString(&h, k)
			h.WriteByte(':')
			jsonString(&h, metadata[k])
		}
		h.WriteByte('}')
	}
	off := 0
	for i, t := range ts {
		if i > 0 || len(metadata) > 0 {
			h.WriteByte(',')
		}
		jsonString(&h, t.Name)
		h.WriteString(`:{"dtype":"` + dtypeInfo[t.DType].st + `","shape":[`)
		for j, d := range t.Shape {
			if j > 0 {
				h.WriteByte(',')
			}
			h.WriteString(strconv.Itoa(d))
		}
		h.WriteString(`],"data_offsets":[` + strconv.Itoa(off) + "," + strconv.Itoa(off+len(t.Data)) + "]}")
		off += len(t.Data)
	}
	h.WriteByte('}')
	for h.Len()%8 != 0 {
		h.WriteByte(' ')
	}

	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("deepspeed: safetensors: %w", err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(h.Len()))
	if _, err = tmp.Write(n[:]); err == nil {
		_, err = tmp.WriteString(h.String())
	}
	for _, t := range ts {
		if err == nil {
			_, err = tmp.Write(t.Data)
		}
	}
	if err == nil {
		err = tmp.Sync()
	}
	if err == nil {
		err = tmp.Close()
	}
	if err == nil {
		err = os.Rename(tmp.Name(), path)
	}
	if err != nil {
		return fmt.Errorf("deepspeed: safetensors: %w", err)
	}
	return nil
}

// stRank orders dtypes as the safetensors library does (its Dtype enum):
// a higher rank is written first.
var stRank = map[DType]int{Bool: 0, Uint8: 1, Int8: 2, Int16: 3, Float16: 5, BFloat16: 6, Int32: 7, Float32: 9, Float64: 10, Int64: 11}

// jsonString writes s as serde_json writes a string: only '"', '\\' and
// the control characters escaped, the rest as UTF-8.
func jsonString(b *strings.Builder, s string) {
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			if r < 0x20 {
				fmt.Fprintf(b, `\u%04x`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
}
