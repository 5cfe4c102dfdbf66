package dataplane

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestLoadOrCreateCertKeepsTheSameCertificate(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "agent")
	_, first, err := LoadOrCreateCert(dir)
	if err != nil {
		t.Fatal(err)
	}
	cert, again, err := LoadOrCreateCert(dir)
	if err != nil {
		t.Fatal(err)
	}
	if again != first {
		t.Fatalf("got fingerprint %s after a restart, want %s", again, first)
	}
	if got := fingerprint(cert.Certificate[0]); got != first {
		t.Fatalf("got fingerprint %s for the loaded certificate, want %s", got, first)
	}
	for _, name := range []string{certFile, keyFile} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if mode := fi.Mode().Perm(); mode != 0o600 {
			t.Errorf("%s: got mode %#o, want 0600", name, mode)
		}
	}
}

func TestLoadOrCreateCertRefusesAHalfPair(t *testing.T) {
	dir := t.TempDir()
	if _, _, err := LoadOrCreateCert(dir); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, certFile)); err != nil {
		t.Fatal(err)
	}
	_, _, err := LoadOrCreateCert(dir)
	if err == nil || !strings.Contains(err.Error(), "remove") {
		t.Fatalf("got %v, want an error that says which file to remove", err)
	}
}

func TestDialRefusesAnotherCertificate(t *testing.T) {
	a := newTestAgent(t)
	_, other, err := LoadOrCreateCert(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		pin     string
		wantErr func(error) bool
	}{
		{name: "another certificate's fingerprint", pin: other, wantErr: func(err error) bool { return errors.Is(err, ErrCertMismatch) }},
		{name: "a fingerprint that is not one", pin: "abc", wantErr: func(err error) bool { return strings.Contains(err.Error(), "must be 64 hex digits") }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := Dial(t.Context(), a.srv.Addr().String(), tt.pin)
			if err == nil {
				c.Close()
				t.Fatal("Dial succeeded")
			}
			if !tt.wantErr(err) {
				t.Fatalf("got %v, not the error expected", err)
			}
		})
	}
}

func TestDialAcceptsTheFingerprintInUpperCaseWithColons(t *testing.T) {
	a := newTestAgent(t)
	var parts []string
	for i := 0; i < len(a.certFP); i += 2 {
		parts = append(parts, strings.ToUpper(a.certFP[i:i+2]))
	}
	c, err := Dial(t.Context(), a.srv.Addr().String(), strings.Join(parts, ":"))
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
}
