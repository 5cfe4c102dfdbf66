// Package pkitest makes CAs and certificates for tests, with the real
// internal/pki code, in the test's temporary directory.
package pkitest

import (
	"path/filepath"
	"testing"
	"time"

	"github.com/gpupool/gpupool/internal/pki"
)

// CA is a test CA and the directory it lives in.
type CA struct {
	*pki.CA
	Dir string
}

// NewCA creates an ECDSA CA in a new temporary directory of t.
func NewCA(t testing.TB) *CA {
	t.Helper()
	return NewCAWith(t, pki.ECDSAP256)
}

// NewCAWith creates a CA with keys of alg in a new temporary directory.
func NewCAWith(t testing.TB, alg pki.Algorithm) *CA {
	t.Helper()
	dir := t.TempDir()
	ca, err := pki.InitCA(dir, alg, "gpupool test CA", time.Now(), 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return &CA{CA: ca, Dir: dir}
}

// Issue issues a certificate valid for the next hour and writes it next
// to the CA; hosts are a broker's addresses.
func (c *CA) Issue(t testing.TB, name string, role pki.Role, hosts ...string) pki.Files {
	t.Helper()
	now := time.Now()
	return c.IssueRequest(t, pki.Request{Name: name, Role: role, Hosts: hosts, NotBefore: now.Add(-time.Minute), NotAfter: now.Add(time.Hour)})
}

// IssueRequest issues the certificate req asks for and writes it next to
// the CA.
func (c *CA) IssueRequest(t testing.TB, req pki.Request) pki.Files {
	t.Helper()
	certPEM, keyPEM, err := c.CA.Issue(req)
	if err != nil {
		t.Fatal(err)
	}
	cert, key, err := pki.WriteKeyPair(c.Dir, req.Name, certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return pki.Files{CA: filepath.Join(c.Dir, pki.CACertFile), Cert: cert, Key: key}
}

// Source loads files into a source, failing the test on error.
func Source(t testing.TB, files pki.Files) *pki.Source {
	t.Helper()
	s, err := pki.NewSource(files, nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}
