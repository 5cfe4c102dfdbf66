package quantity

import (
	"errors"
	"strconv"
	"strings"
	"testing"
)

func TestParseMemoryMiB(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want int64
	}{
		{"a plain number is MiB", "20480", 20480},
		{"GiB converts to MiB", "20GiB", 20480},
		{"MiB stays MiB", "512MiB", 512},
		{"TiB converts to MiB", "1TiB", 1 << 20},
		{"the Kubernetes-style Gi suffix is binary", "20Gi", 20480},
		{"the Kubernetes-style Mi suffix is binary", "512Mi", 512},
		{"units are case-insensitive", "20gib", 20480},
		{"upper-case units are accepted", "20GIB", 20480},
		{"a space before the unit is accepted", "20 GiB", 20480},
		{"surrounding space is ignored", "  8GiB ", 8192},
		{"a fraction that is whole MiB is accepted", "1.5GiB", 1536},
		{"trailing zeros in a fraction are fine", "2.50Gi", 2560},
		{"zero is zero", "0", 0},
		{"the largest size is accepted", "8388608TiB", MaxMiB},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseMemoryMiB(tt.in)
			if err != nil {
				t.Fatalf("ParseMemoryMiB(%q): %v", tt.in, err)
			}
			if got != tt.want {
				t.Errorf("ParseMemoryMiB(%q) = %d, want %d", tt.in, got, tt.want)
			}
		})
	}
}

func TestParseMemoryMiBRejects(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want []string // substrings of the error
	}{
		{"an empty value", "", []string{`memory ""`, "empty", "20GiB"}},
		{"decimal GB, pointing at GiB", "20GB", []string{`"20GB"`, "decimal", "binary", "20GiB"}},
		{"decimal MB, pointing at MiB", "512MB", []string{"decimal", "512MiB"}},
		{"a bare G, which is decimal in Kubernetes", "20G", []string{"decimal", "20GiB"}},
		{"decimal TB", "1tb", []string{"decimal", "1TiB"}},
		{"a negative size", "-5GiB", []string{"negative"}},
		{"a fraction of a MiB", "0.0001GiB", []string{"fraction of a MiB", "whole number of MiB"}},
		{"a fractional plain MiB", "1.5", []string{"fraction of a MiB"}},
		{"a size past int64", "99999999999999999999", []string{"too large"}},
		{"a size past MaxMiB", "8388609TiB", []string{"too large"}},
		{"an unknown unit", "20XiB", []string{`unknown unit "XiB"`, "MiB, GiB or TiB"}},
		{"KiB, finer than MiB", "1024KiB", []string{"unknown unit"}},
		{"no number at all", "GiB", []string{"not a number"}},
		{"two dots", "1.2.3GiB", []string{"not a number"}},
		{"a dot with no digits after it", "1.GiB", []string{"not a number"}},
		{"a leading dot", ".5GiB", []string{"not a number"}},
		{"a plus sign", "+5GiB", []string{"not a number"}},
		{"an exponent", "1e3", []string{"unknown unit"}},
		{"a very long value", strings.Repeat("9", 100), []string{"too long"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseMemoryMiB(tt.in)
			if err == nil {
				t.Fatalf("ParseMemoryMiB(%q) = %d, want an error", tt.in, got)
			}
			var qe *Error
			if !errors.As(err, &qe) || qe.Value != tt.in || qe.Quantity != "memory" {
				t.Errorf("ParseMemoryMiB(%q) error = %#v, want *Error with Value %q", tt.in, err, tt.in)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("ParseMemoryMiB(%q) error = %q, want it to contain %q", tt.in, err, w)
				}
			}
		})
	}
}

func TestParsePercent(t *testing.T) {
	tests := []struct {
		in   string
		want int32
	}{
		{"25", 25},
		{"25%", 25},
		{" 25 % ", 25},
		{"1", 1},
		{"100", 100},
		{"007", 7},
	}
	for _, tt := range tests {
		got, err := ParsePercent(tt.in)
		if err != nil || got != tt.want {
			t.Errorf("ParsePercent(%q) = %d, %v; want %d, nil", tt.in, got, err, tt.want)
		}
	}
}

func TestParsePercentRejects(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want string
	}{
		{"zero", "0", "out of range"},
		{"more than one GPU", "101", "out of range"},
		{"a huge number", "99999999999", "out of range"},
		{"a negative share", "-5", "negative"},
		{"a fraction", "12.5", "whole percent"},
		{"a word", "half", "not a number"},
		{"empty", "", "empty"},
		{"only a percent sign", "%", "empty"},
		{"two percent signs", "25%%", "not a number"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParsePercent(tt.in)
			if err == nil {
				t.Fatalf("ParsePercent(%q) = %d, want an error", tt.in, got)
			}
			msg := err.Error()
			for _, w := range []string{tt.want, strconv.Quote(tt.in), "1 to 100"} {
				if !strings.Contains(msg, w) {
					t.Errorf("ParsePercent(%q) error = %q, want it to contain %q", tt.in, msg, w)
				}
			}
		})
	}
}

func TestFormatMiB(t *testing.T) {
	tests := []struct {
		in   int64
		want string
	}{
		{0, "0 MiB"},
		{1, "1 MiB"},
		{1536, "1536 MiB"},
		{1024, "1 GiB"},
		{20480, "20 GiB"},
		{81920, "80 GiB"},
		{1 << 20, "1 TiB"},
		{3 << 20, "3 TiB"},
		{(1 << 20) + 1024, "1025 GiB"},
	}
	for _, tt := range tests {
		if got := FormatMiB(tt.in); got != tt.want {
			t.Errorf("FormatMiB(%d) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

// FuzzParseMemoryMiB checks that ParseMemoryMiB never panics, that what it
// accepts is within range, and that an accepted size reads back the same
// from both its table form and its plain MiB form.
func FuzzParseMemoryMiB(f *testing.F) {
	for _, s := range []string{
		"20GiB", "512MiB", "1TiB", "20480", "20Gi", "512mi", "1.5GiB", "0.0001GiB",
		"20GB", "-1", "", " ", "1.", ".5", "8388608TiB", "8388609TiB", "1e9", "20 GiB",
		"99999999999999999999999", "1.0000000000000000001TiB", "%", "\x00",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParseMemoryMiB(s)
		if err != nil {
			var qe *Error
			if !errors.As(err, &qe) || qe.Value != s {
				t.Fatalf("ParseMemoryMiB(%q) error %#v is not an *Error naming the value", s, err)
			}
			return
		}
		if n < 0 || n > MaxMiB {
			t.Fatalf("ParseMemoryMiB(%q) = %d, outside 0..%d", s, n, MaxMiB)
		}
		for _, form := range []string{FormatMiB(n), strconv.FormatInt(n, 10), strconv.FormatInt(n, 10) + "MiB"} {
			back, err := ParseMemoryMiB(form)
			if err != nil || back != n {
				t.Fatalf("ParseMemoryMiB(%q) = %d, but ParseMemoryMiB(%q) = %d, %v", s, n, form, back, err)
			}
		}
	})
}

func FuzzParsePercent(f *testing.F) {
	for _, s := range []string{
		"25", "25%", " 25 % ", "1", "100", "007", "0", "101", "-5", "12.5", "half", "", "%", "25%%",
		"99999999999", "+5", "1e2", "٣", "\x00", "100%\n",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := ParsePercent(s)
		if err != nil {
			var qe *Error
			if !errors.As(err, &qe) || qe.Value != s || !strings.Contains(err.Error(), "1 to 100") {
				t.Fatalf("ParsePercent(%q) error %#v is not an *Error naming the value and the allowed range", s, err)
			}
			return
		}
		if n < 1 || n > 100 {
			t.Fatalf("ParsePercent(%q) = %d, outside 1..100", s, n)
		}
		for _, form := range []string{strconv.Itoa(int(n)), strconv.Itoa(int(n)) + "%"} {
			back, err := ParsePercent(form)
			if err != nil || back != n {
				t.Fatalf("ParsePercent(%q) = %d, but ParsePercent(%q) = %d, %v", s, n, form, back, err)
			}
		}
	})
}
