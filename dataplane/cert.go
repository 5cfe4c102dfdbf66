package dataplane

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/gpupool/gpupool/internal/atomicfile"
)

// ALPN is the TLS application protocol of the data plane.
const ALPN = "gpupool-dp/1"

// The files LoadOrCreateCert keeps in its directory.
const (
	certFile = "dataplane-cert.pem"
	keyFile  = "dataplane-key.pem"
)

// LoadOrCreateCert returns the agent's data-plane certificate kept in dir
// and the SHA-256 (lowercase hex) of its DER, which clients pin. The first
// call creates a self-signed ECDSA P-256 certificate and its key (files
// mode 0600, dir created 0700 if missing); later calls, across restarts,
// return the same one.
func LoadOrCreateCert(dir string) (tls.Certificate, string, error) {
	certPath, keyPath := filepath.Join(dir, certFile), filepath.Join(dir, keyFile)
	_, certErr := os.Stat(certPath)
	_, keyErr := os.Stat(keyPath)
	switch {
	case certErr == nil && keyErr == nil:
		cert, err := tls.LoadX509KeyPair(certPath, keyPath)
		if err != nil {
			return tls.Certificate{}, "", fmt.Errorf("dataplane: loading the agent certificate: %w", err)
		}
		return cert, fingerprint(cert.Certificate[0]), nil
	case errors.Is(certErr, fs.ErrNotExist) && errors.Is(keyErr, fs.ErrNotExist):
		return createCert(dir, certPath, keyPath)
	case certErr == nil && errors.Is(keyErr, fs.ErrNotExist):
		return tls.Certificate{}, "", fmt.Errorf("dataplane: %s exists but %s does not: remove %s to create a new certificate", certPath, keyPath, certPath)
	case keyErr == nil && errors.Is(certErr, fs.ErrNotExist):
		return tls.Certificate{}, "", fmt.Errorf("dataplane: %s exists but %s does not: remove %s to create a new certificate", keyPath, certPath, keyPath)
	default:
		return tls.Certificate{}, "", fmt.Errorf("dataplane: agent certificate: %w", errors.Join(certErr, keyErr))
	}
}

func createCert(dir, certPath, keyPath string) (tls.Certificate, string, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: generating the agent key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: generating a serial number: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: "gpupool agent data plane"},
		// Clients pin the certificate itself, so its validity period only
		// has to cover the agent's life.
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(30, 0, 0),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: creating the agent certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: encoding the agent key: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: %w", err)
	}
	// The key first: a crash between the two writes leaves a key without a
	// certificate, which the next call reports instead of ignoring.
	if err := atomicfile.Write(keyPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})); err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: writing %s: %w", keyPath, err)
	}
	if err := atomicfile.Write(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})); err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: writing %s: %w", certPath, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, "", fmt.Errorf("dataplane: parsing the agent certificate: %w", err)
	}
	cert := tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
	return cert, fingerprint(der), nil
}

// fingerprint is the lowercase hex SHA-256 of a certificate's DER.
func fingerprint(der []byte) string {
	sum := sha256.Sum256(der)
	return hex.EncodeToString(sum[:])
}

// parseFingerprint accepts a SHA-256 fingerprint in hex, either case, with
// or without colons between bytes.
func parseFingerprint(s string) ([]byte, error) {
	b, err := hex.DecodeString(strings.ReplaceAll(s, ":", ""))
	if err != nil || len(b) != sha256.Size {
		return nil, fmt.Errorf("dataplane: certificate sha256 %q: must be %d hex digits", s, 2*sha256.Size)
	}
	return b, nil
}

// serverTLS is the TLS configuration of the agent.
func serverTLS(cert tls.Certificate) *tls.Config {
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS13,
		NextProtos:   []string{ALPN},
	}
}

// pinCheck remembers why a handshake failed the pin, for Dial to report:
// the handshake runs on a goroutine of quic-go's.
type pinCheck struct {
	mu  sync.Mutex
	err error // guarded by mu
}

func (p *pinCheck) fail(err error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.err = err
	return err
}

func (p *pinCheck) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// clientTLS is the TLS configuration of a client that trusts exactly the
// certificate whose SHA-256 is pin. A mismatch fails the handshake with an
// error wrapping ErrCertMismatch, which check remembers.
func clientTLS(addr string, pin []byte, check *pinCheck) *tls.Config {
	return &tls.Config{
		// The chain is not verified: the pin is the whole trust.
		InsecureSkipVerify: true,
		MinVersion:         tls.VersionTLS13,
		NextProtos:         []string{ALPN},
		// VerifyConnection runs on every handshake, resumed or not.
		VerifyConnection: func(cs tls.ConnectionState) error {
			if len(cs.PeerCertificates) == 0 {
				return check.fail(fmt.Errorf("%w: %s presented no certificate", ErrCertMismatch, addr))
			}
			got := sha256.Sum256(cs.PeerCertificates[0].Raw)
			if subtle.ConstantTimeCompare(got[:], pin) != 1 {
				return check.fail(fmt.Errorf("%w: %s presented sha256 %x, want %x", ErrCertMismatch, addr, got, pin))
			}
			return nil
		},
	}
}
