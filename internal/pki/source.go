package pki

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
)

// Files names the PEM files of one TLS identity: the CA bundle to trust,
// and this holder's certificate and key.
type Files struct {
	CA, Cert, Key string
}

// Source serves a holder's certificate and the CA pool from Files, and
// reloads them when a file changes on disk (another modification time,
// size or inode): every TLS handshake looks, so a rotated certificate is
// used from the next handshake on, without a restart. A rotation that
// leaves the files inconsistent for a moment (a new certificate with the
// old key, a certificate the CA did not sign) is not taken: the source
// keeps serving the last good set and logs why, and takes the new one as
// soon as the files agree.
type Source struct {
	files Files
	log   *slog.Logger

	mu      sync.Mutex
	cur     *material     // guarded by mu; never nil after NewSource
	stamps  []os.FileInfo // guarded by mu; of files, when cur was read
	lastErr string        // guarded by mu; the last reload error logged
}

// material is one consistent set read from Files. It is never modified.
type material struct {
	cert *tls.Certificate // with Leaf
	pool *x509.CertPool
	id   Identity
}

// NewSource reads files and checks that they are usable: the key matches
// the certificate, the certificate is a gpupool one signed by the CA and
// valid now. logger (nil: discard) hears of reloads.
func NewSource(files Files, logger *slog.Logger) (*Source, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	s := &Source{files: files, log: logger}
	stamps := statAll(files)
	m, err := load(files, time.Now())
	if err != nil {
		return nil, err
	}
	s.cur, s.stamps = m, stamps
	return s, nil
}

// Identity is who this source's current certificate says its holder is.
func (s *Source) Identity() Identity { return s.current().id }

// NotAfter is when the current certificate expires.
func (s *Source) NotAfter() time.Time { return s.current().cert.Leaf.NotAfter }

// current returns the material to use now, reloading it first when a file
// changed and the new set is consistent.
func (s *Source) current() *material {
	s.mu.Lock()
	defer s.mu.Unlock()
	stamps := statAll(s.files)
	if sameStamps(stamps, s.stamps) {
		return s.cur
	}
	m, err := load(s.files, time.Now())
	if err != nil {
		if msg := err.Error(); msg != s.lastErr {
			s.lastErr = msg
			s.log.Error("TLS files changed but cannot be used; still serving the previous certificate", "err", err)
		}
		return s.cur
	}
	s.cur, s.stamps, s.lastErr = m, stamps, ""
	s.log.Info("TLS certificate reloaded", "cert", s.files.Cert, "name", m.id.Name, "role", m.id.Role, "not_after", m.cert.Leaf.NotAfter.Format(time.RFC3339))
	return s.cur
}

// Protocol versions and cipher suites of every connection. TLS 1.2,
// because a TLS 1.3 server judges the client's certificate after the
// client's handshake has ended: a client that writes first (gRPC does)
// reads a reset connection ("broken pipe") instead of the server's reason
// ("expired certificate"). In TLS 1.2 the verdict is part of the client's
// handshake, so users read why they were refused. Forward-secret AEAD
// suites only.
const tlsVersion = tls.VersionTLS12

var cipherSuites = []uint16{
	tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
	tls.TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
}

// ServerConfig is the configuration of a TLS server that requires every
// peer to present a certificate signed by the CA with one of the allowed
// roles (any role when none are given). Each handshake uses the current
// certificate and CA pool.
func (s *Source) ServerConfig(allowed ...Role) *tls.Config {
	return &tls.Config{
		MinVersion: tlsVersion,
		MaxVersion: tlsVersion,
		GetConfigForClient: func(*tls.ClientHelloInfo) (*tls.Config, error) {
			m := s.current()
			return &tls.Config{
				MinVersion:       tlsVersion,
				MaxVersion:       tlsVersion,
				CipherSuites:     cipherSuites,
				Certificates:     []tls.Certificate{*m.cert},
				ClientCAs:        m.pool,
				ClientAuth:       tls.RequireAndVerifyClientCert,
				VerifyConnection: requireRole("client", allowed),
			}, nil
		},
	}
}

// WebConfig is the configuration of an HTTPS server for browsers (the
// broker's web console): the current certificate, and no client
// certificate asked for (the console asks for an ACL token instead).
func (s *Source) WebConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tlsVersion,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return s.current().cert, nil
		},
	}
}

// ClientConfig is the configuration of a TLS client that dials brokers:
// it trusts the CA pool as it is now, presents the current certificate at
// every handshake, and accepts only a server whose certificate has the
// broker role and names the address dialed.
func (s *Source) ClientConfig() *tls.Config {
	m := s.current()
	return &tls.Config{
		MinVersion:   tlsVersion,
		MaxVersion:   tlsVersion,
		CipherSuites: cipherSuites,
		RootCAs:      m.pool,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return s.current().cert, nil
		},
		VerifyConnection: requireRole("server", []Role{RoleBroker}),
	}
}

// PeerConfig is ClientConfig for a broker dialing another broker: it
// verifies the peer by BrokerPeerName instead of the address dialed.
func (s *Source) PeerConfig() *tls.Config {
	cfg := s.ClientConfig()
	cfg.ServerName = BrokerPeerName
	return cfg
}

// requireRole checks the verified peer certificate carries one of the
// allowed roles (any, when allowed is empty).
func requireRole(peer string, allowed []Role) func(tls.ConnectionState) error {
	return func(cs tls.ConnectionState) error {
		if len(cs.PeerCertificates) == 0 {
			return fmt.Errorf("pki: the %s presented no certificate", peer)
		}
		id, err := IdentityOf(cs.PeerCertificates[0])
		if err != nil {
			return err
		}
		if len(allowed) > 0 && !slices.Contains(allowed, id.Role) {
			want := make([]string, len(allowed))
			for i, r := range allowed {
				want[i] = string(r)
			}
			return fmt.Errorf("pki: %s certificate %q has role %s; only %s may connect here", peer, id.Name, id.Role, strings.Join(want, " or "))
		}
		return nil
	}
}

// load reads and checks one set of files.
func load(f Files, now time.Time) (*material, error) {
	caPEM, err := os.ReadFile(f.CA)
	if err != nil {
		return nil, fmt.Errorf("tls-ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return nil, fmt.Errorf("tls-ca %s: no PEM certificate in it", f.CA)
	}
	certPEM, err := os.ReadFile(f.Cert)
	if err != nil {
		return nil, fmt.Errorf("tls-cert: %w", err)
	}
	keyPEM, err := os.ReadFile(f.Key)
	if err != nil {
		return nil, fmt.Errorf("tls-key: %w", err)
	}
	pair, err := parseKeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("tls-cert %s and tls-key %s: %w", f.Cert, f.Key, err)
	}
	leaf := pair.leaf
	if now.After(leaf.NotAfter) {
		return nil, fmt.Errorf("tls-cert %s: certificate %q expired at %s; issue a new one with 'gpupool operator tls issue'", f.Cert, leaf.Subject.CommonName, leaf.NotAfter.Format(time.RFC3339))
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		return nil, fmt.Errorf("tls-cert %s is not valid for tls-ca %s: %w", f.Cert, f.CA, err)
	}
	id, err := IdentityOf(leaf)
	if err != nil {
		return nil, fmt.Errorf("tls-cert %s: %w", f.Cert, err)
	}
	return &material{cert: pair.cert, pool: pool, id: id}, nil
}

type keyPair struct {
	cert *tls.Certificate
	leaf *x509.Certificate
}

func parseKeyPair(certPEM, keyPEM []byte) (keyPair, error) {
	if b, _ := pem.Decode(certPEM); b == nil || b.Type != "CERTIFICATE" {
		return keyPair{}, errors.New("the certificate file holds no PEM CERTIFICATE")
	}
	c, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return keyPair{}, err
	}
	return keyPair{cert: &c, leaf: c.Leaf}, nil
}

// statAll stats the files; a file that cannot be stat'ed has a nil entry.
func statAll(f Files) []os.FileInfo {
	out := make([]os.FileInfo, 0, 3)
	for _, p := range []string{f.CA, f.Cert, f.Key} {
		fi, err := os.Stat(p)
		if err != nil {
			fi = nil
		}
		out = append(out, fi)
	}
	return out
}

func sameStamps(a, b []os.FileInfo) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] == nil || b[i] == nil {
			return false
		}
		if !os.SameFile(a[i], b[i]) || !a[i].ModTime().Equal(b[i].ModTime()) || a[i].Size() != b[i].Size() {
			return false
		}
	}
	return true
}
