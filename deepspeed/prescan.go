package deepspeed

import (
	"bytes"
	"encoding/binary"
)

// prescan walks a pickle's opcodes before the unpickler sees them, and
// refuses what the unpickler must never act on:
//   - any length or frame size beyond the bytes that follow it (the
//     unpickler allocates a declared length before reading it, so a
//     pickle of a few bytes could otherwise ask for gigabytes);
//   - every opcode that imports or calls by any route other than GLOBAL
//     (STACK_GLOBAL, INST, OBJ, the extension registry, out-of-band
//     buffers, text persistent ids), and an unknown opcode;
//   - a GLOBAL outside the allow-list (the unpickler's FindClass checks
//     it again).
//
// torch.save writes protocol 2, which needs none of the refused opcodes.
func prescan(p []byte) error {
	i, depth := 0, 0
	need := func(n uint64) error {
		if n > uint64(len(p)-i) {
			return errorf(ErrFormat, "", "pickle: an argument of %d bytes at offset %d runs past the end (%d bytes)", n, i, len(p))
		}
		return nil
	}
	line := func() ([]byte, error) {
		j := bytes.IndexByte(p[i:], '\n')
		if j < 0 {
			return nil, errorf(ErrFormat, "", "pickle: unterminated text argument at offset %d", i)
		}
		l := p[i : i+j]
		i += j + 1
		return l, nil
	}
	for i < len(p) {
		op := p[i]
		at := i
		i++
		var n uint64 // bytes of a fixed or length-prefixed argument
		switch op {
		case '(':
			if depth++; depth > maxMarkDepth {
				return errorf(ErrFormat, "", "pickle: more than %d nested marks at offset %d", maxMarkDepth, at)
			}
			continue
		case '1', 'e', 'u', 't', 'd', 'l', 0x90, 0x91: // they pop a mark
			depth = max(depth-1, 0)
			continue
		// no argument
		case '.', '0', '2', 'N', 'Q', 'R', 'a', 'b', '}', ']', 's', ')',
			0x81, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8f, 0x94:
			if op == '.' {
				return nil
			}
			continue
		// fixed-size arguments
		case 'K', 'h', 'q', 0x80:
			n = 1
		case 'M':
			n = 2
		case 'J', 'j', 'r':
			n = 4
		case 'G':
			n = 8
		case 0x95: // FRAME: its size must fit in what follows
			if err := need(8); err != nil {
				return err
			}
			size := binary.LittleEndian.Uint64(p[i:])
			i += 8
			if err := need(size); err != nil {
				return err
			}
			continue
		// text arguments
		case 'I', 'L', 'F', 'S', 'V', 'g', 'p':
			l, err := line()
			if err != nil {
				return err
			}
			if (op == 'I' || op == 'L') && len(l) > 24 {
				return errorf(ErrFormat, "", "pickle: an integer of %d digits at offset %d (a checkpoint's integers fit in 64 bits)", len(l), at)
			}
			continue
		case 'c': // GLOBAL module\nname\n
			mod, err := line()
			if err != nil {
				return err
			}
			name, err := line()
			if err != nil {
				return err
			}
			if !allowed(string(mod), string(name)) {
				return errorf(ErrUnsafe, "", "pickle: class %s.%s is not one a DeepSpeed checkpoint holds; refused, nothing of it built", mod, name)
			}
			continue
		// length-prefixed arguments
		case 'U', 'C', 0x8c, 0x8a: // 1-byte length
			if err := need(1); err != nil {
				return err
			}
			n = uint64(p[i])
			i++
			if op == 0x8a && (n == 0 || n > 8) {
				return errorf(ErrFormat, "", "pickle: an integer of %d bytes at offset %d (a checkpoint's integers take 1 to 8)", n, at)
			}
		case 'T', 'X', 'B', 0x8b: // 4-byte length
			if err := need(4); err != nil {
				return err
			}
			n = uint64(binary.LittleEndian.Uint32(p[i:]))
			i += 4
			if op == 'T' && int32(n) < 0 {
				return errorf(ErrFormat, "", "pickle: negative length at offset %d", at)
			}
			if op == 0x8b && n > 8 {
				return errorf(ErrFormat, "", "pickle: an integer of %d bytes at offset %d (a checkpoint's integers fit in 64 bits)", n, at)
			}
		case 0x8d, 0x8e, 0x96: // 8-byte length
			if err := need(8); err != nil {
				return err
			}
			n = binary.LittleEndian.Uint64(p[i:])
			i += 8
		case 'P', 'i', 'o', 0x82, 0x83, 0x84, 0x92, 0x93, 0x97, 0x98:
			return errorf(ErrUnsafe, "", "pickle: opcode 0x%02x at offset %d imports or calls outside the allow-list (PyTorch's files never use it); refused", op, at)
		default:
			return errorf(ErrFormat, "", "pickle: unknown opcode 0x%02x at offset %d", op, at)
		}
		if err := need(n); err != nil {
			return err
		}
		i += int(n)
	}
	return errorf(ErrFormat, "", "pickle: no STOP opcode (truncated?)")
}
