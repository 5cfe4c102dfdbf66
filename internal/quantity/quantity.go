// Package quantity parses and formats the units gpupool users type: GPU
// memory in binary units (MiB, GiB, TiB) and compute in whole percent.
//
// Memory is counted in whole MiB everywhere (the API's unit), so every
// size a parser accepts is an exact, non-negative number of MiB no larger
// than MaxMiB. Decimal (SI) units such as GB are refused rather than
// guessed: GPU memory is binary, and 20GB is not 20GiB.
package quantity

import (
	"fmt"
	"math/big"
	"strconv"
	"strings"
)

// MaxMiB is the largest memory size the parsers accept: the largest number
// of MiB whose size in bytes still fits in an int64 (8 EiB).
const MaxMiB int64 = 1 << 43

// Error reports a value that could not be parsed. Callers that know which
// flag or field the value came from can read Value and Reason with
// errors.As and phrase their own message.
type Error struct {
	// Quantity is what was parsed: "memory" or "percent".
	Quantity string
	// Value is the text as given.
	Value string
	// Reason says what is wrong and what is allowed.
	Reason string
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s %q: %s", e.Quantity, e.Value, e.Reason)
}

// memoryForm is the sentence every memory error ends with.
const memoryForm = "write a whole number of MiB as 20GiB, 512MiB, 1TiB or 20480 (a plain number is MiB)"

// binaryUnits maps a lower-cased unit to its size in MiB.
var binaryUnits = map[string]int64{
	"":    1,
	"mi":  1,
	"mib": 1,
	"gi":  1 << 10,
	"gib": 1 << 10,
	"ti":  1 << 20,
	"tib": 1 << 20,
}

// decimalUnits maps a lower-cased decimal or ambiguous unit to the binary
// unit the user most likely meant.
var decimalUnits = map[string]string{
	"m": "MiB", "mb": "MiB",
	"g": "GiB", "gb": "GiB",
	"t": "TiB", "tb": "TiB",
}

// ParseMemoryMiB parses a memory size and returns it in MiB. It accepts a
// number with an optional binary unit, case-insensitively and with optional
// space before the unit: "20GiB", "20Gi", "512MiB", "1TiB", "1.5GiB"
// (= 1536), "20 GiB" and "20480" (a plain number is MiB). The result is
// always between 0 and MaxMiB; a fraction must come to a whole number of
// MiB. The error, an *Error, names the value and the allowed form.
func ParseMemoryMiB(s string) (int64, error) {
	fail := func(format string, a ...any) (int64, error) {
		return 0, &Error{Quantity: "memory", Value: s, Reason: fmt.Sprintf(format, a...)}
	}
	t := strings.TrimSpace(s)
	if t == "" {
		return fail("empty; %s", memoryForm)
	}
	if len(t) > 64 {
		return fail("too long; %s", memoryForm)
	}
	if t[0] == '-' {
		return fail("must not be negative; %s", memoryForm)
	}
	num, unit := splitNumber(t)
	unit = strings.TrimSpace(unit)
	if !validNumber(num) {
		return fail("not a number; %s", memoryForm)
	}
	mult, ok := binaryUnits[strings.ToLower(unit)]
	if !ok {
		if binary, isDecimal := decimalUnits[strings.ToLower(unit)]; isDecimal {
			return fail("%s is a decimal (SI) unit but GPU memory is binary: use GiB or MiB, e.g. %s%s", unit, num, binary)
		}
		return fail("unknown unit %q; use MiB, GiB or TiB, or a plain number of MiB", unit)
	}
	r, ok := new(big.Rat).SetString(num)
	if !ok {
		return fail("not a number; %s", memoryForm)
	}
	r.Mul(r, new(big.Rat).SetInt64(mult))
	if !r.IsInt() {
		return fail("comes to a fraction of a MiB (about %s MiB); %s", r.FloatString(3), memoryForm)
	}
	n := r.Num()
	if !n.IsInt64() || n.Int64() > MaxMiB {
		return fail("too large: the most is %s (%d MiB)", FormatMiB(MaxMiB), MaxMiB)
	}
	return n.Int64(), nil
}

// splitNumber splits s after its leading run of digits and dots.
func splitNumber(s string) (num, rest string) {
	i := 0
	for i < len(s) && (s[i] >= '0' && s[i] <= '9' || s[i] == '.') {
		i++
	}
	return s[:i], s[i:]
}

// validNumber reports whether s is digits, optionally followed by a dot and
// more digits.
func validNumber(s string) bool {
	whole, frac, hasDot := strings.Cut(s, ".")
	if whole == "" || hasDot && frac == "" {
		return false
	}
	return !strings.Contains(frac, ".")
}

// ParsePercent parses a compute share in whole percent of one GPU's SMs:
// "25" or "25%", between 1 and 100. The error, an *Error, names the value
// and the allowed form.
func ParsePercent(s string) (int32, error) {
	fail := func(reason string) (int32, error) {
		return 0, &Error{Quantity: "percent", Value: s, Reason: reason + "; write a whole number from 1 to 100, e.g. 25 or 25%"}
	}
	t := strings.TrimSpace(s)
	t = strings.TrimSpace(strings.TrimSuffix(t, "%"))
	if t == "" {
		return fail("empty")
	}
	if strings.HasPrefix(t, "-") {
		return fail("must not be negative")
	}
	if strings.Contains(t, ".") {
		return fail("compute is counted in whole percent")
	}
	for _, c := range t {
		if c < '0' || c > '9' {
			return fail("not a number")
		}
	}
	n, err := strconv.ParseInt(t, 10, 32)
	if err != nil || n < 1 || n > 100 {
		return fail("out of range")
	}
	return int32(n), nil
}

// FormatMiB formats a memory size for tables in the largest binary unit
// that shows it exactly: 20480 → "20 GiB", 1536 → "1536 MiB",
// 1048576 → "1 TiB". ParseMemoryMiB reads every result back to n.
func FormatMiB(n int64) string {
	switch {
	case n != 0 && n%(1<<20) == 0:
		return strconv.FormatInt(n>>20, 10) + " TiB"
	case n != 0 && n%(1<<10) == 0:
		return strconv.FormatInt(n>>10, 10) + " GiB"
	}
	return strconv.FormatInt(n, 10) + " MiB"
}
