package cudaserver

import (
	"bytes"
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// Param is one kernel parameter's place in the launch buffer.
type Param struct {
	Offset, Size uint32
}

// ptxModule is what the simulated backend reads from PTX text.
type ptxModule struct {
	version int // .version as 10*major+minor
	entries map[string][]Param
	globals map[string]uint64 // name -> size in bytes
}

var (
	ptxVersion = regexp.MustCompile(`(?m)^\s*\.version\s+([0-9]+)\.([0-9]+)`)
	ptxEntry   = regexp.MustCompile(`\.entry\s+([A-Za-z_$%][A-Za-z0-9_$%]*)\s*\(([^)]*)\)`)
	ptxParam   = regexp.MustCompile(`^\.param\s+(?:\.align\s+([0-9]+)\s+)?\.([a-z]+[0-9]+)\s+[A-Za-z_$%][A-Za-z0-9_$%]*(?:\[([0-9]+)\])?$`)
	ptxGlobal  = regexp.MustCompile(`(?m)^\s*(?:\.visible\s+)?\.global\s+(?:\.align\s+[0-9]+\s+)?\.([a-z]+[0-9]+)\s+([A-Za-z_$%][A-Za-z0-9_$%]*)(?:\[([0-9]+)\])?`)
)

// typeSize is the byte size of a PTX fundamental type such as u32 or f64.
func typeSize(t string) (uint32, bool) {
	if len(t) < 2 || !strings.ContainsRune("usbf", rune(t[0])) {
		return 0, false
	}
	bits, err := strconv.Atoi(t[1:])
	if err != nil || bits%8 != 0 || bits < 8 || bits > 64 {
		return 0, false
	}
	return uint32(bits / 8), true
}

// parsePTX reads the entries, their parameter layouts and the globals of a
// PTX module. It fails with CUDA_ERROR_INVALID_IMAGE for text that is not
// PTX and CUDA_ERROR_INVALID_PTX for a parameter list it cannot read.
func parsePTX(image []byte) (*ptxModule, Result, error) {
	if i := bytes.IndexByte(image, 0); i >= 0 {
		image = image[:i]
	}
	text := string(image)
	v := ptxVersion.FindStringSubmatch(text)
	if v == nil {
		return nil, ErrorInvalidImage, fmt.Errorf("no .version directive: not PTX")
	}
	major, _ := strconv.Atoi(v[1])
	minor, _ := strconv.Atoi(v[2])
	m := &ptxModule{version: 10*major + minor, entries: map[string][]Param{}, globals: map[string]uint64{}}
	for _, e := range ptxEntry.FindAllStringSubmatch(text, -1) {
		var params []Param
		var off uint32
		if strings.TrimSpace(e[2]) != "" {
			for _, raw := range strings.Split(e[2], ",") {
				p := ptxParam.FindStringSubmatch(strings.Join(strings.Fields(raw), " "))
				if p == nil {
					return nil, ErrorInvalidPtx, fmt.Errorf("entry %s: parameter %q", e[1], strings.TrimSpace(raw))
				}
				size, ok := typeSize(p[2])
				if !ok {
					return nil, ErrorInvalidPtx, fmt.Errorf("entry %s: type .%s", e[1], p[2])
				}
				align := size
				if p[1] != "" {
					a, _ := strconv.Atoi(p[1])
					align = uint32(a)
				}
				if p[3] != "" {
					n, _ := strconv.Atoi(p[3])
					size *= uint32(n)
				}
				if align == 0 || align&(align-1) != 0 || size > 4096 {
					return nil, ErrorInvalidPtx, fmt.Errorf("entry %s: parameter %q", e[1], strings.TrimSpace(raw))
				}
				off = (off + align - 1) &^ (align - 1)
				params = append(params, Param{Offset: off, Size: size})
				off += size
			}
		}
		if off > 32764 {
			return nil, ErrorInvalidPtx, fmt.Errorf("entry %s: %d bytes of parameters, at most 32764", e[1], off)
		}
		m.entries[e[1]] = params
	}
	for _, g := range ptxGlobal.FindAllStringSubmatch(text, -1) {
		size, ok := typeSize(g[1])
		if !ok {
			continue
		}
		n := uint64(1)
		if g[3] != "" {
			n, _ = strconv.ParseUint(g[3], 10, 32)
		}
		m.globals[g[2]] = uint64(size) * n
	}
	return m, Success, nil
}
