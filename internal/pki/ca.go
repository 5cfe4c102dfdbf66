package pki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/gpupool/gpupool/internal/atomicfile"
)

// Files of a CA directory.
const (
	CACertFile = "ca.pem"     // the CA certificate, given to everyone as --tls-ca
	CAKeyFile  = "ca-key.pem" // the CA's private key (0600); keep it offline
)

// Algorithm is the key type of the CA and the certificates it issues.
type Algorithm string

// The supported key types.
const (
	ECDSAP256 Algorithm = "ecdsa-p256"
	Ed25519   Algorithm = "ed25519"
)

// Algorithms lists the supported key types, the default first.
var Algorithms = []Algorithm{ECDSAP256, Ed25519}

// Validity defaults.
const (
	DefaultCAValidity   = 10 * 365 * 24 * time.Hour
	DefaultCertValidity = 365 * 24 * time.Hour
	// clockSkew backdates NotBefore so that a certificate issued on one
	// machine is valid at once on another whose clock is a little behind.
	clockSkew = 5 * time.Minute
)

// Errors of the CA directory.
var (
	ErrCAExists = errors.New("a CA already exists")
	ErrNoCA     = errors.New("no CA")
)

// CA is a loaded certificate authority: its certificate and signing key.
type CA struct {
	Cert    *x509.Certificate
	CertPEM []byte
	key     crypto.Signer
}

// InitCA creates a new CA in dir (created 0700 if missing): a self-signed
// certificate named name, valid from now for validity, and its key. It
// refuses to overwrite an existing CA, so that no certificate issued by it
// is orphaned by accident.
func InitCA(dir string, alg Algorithm, name string, now time.Time, validity time.Duration) (*CA, error) {
	if validity <= 0 {
		return nil, fmt.Errorf("pki: CA validity %s: must be positive", validity)
	}
	for _, f := range []string{CACertFile, CAKeyFile} {
		if _, err := os.Stat(filepath.Join(dir, f)); err == nil {
			return nil, fmt.Errorf("%s: %w (%s); use it, or give another directory", dir, ErrCAExists, f)
		}
	}
	key, err := newKey(alg)
	if err != nil {
		return nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: name, Organization: []string{"gpupool"}},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, fmt.Errorf("pki: create CA certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, err
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	// The key first: a directory with a certificate but no key is a CA
	// nobody can issue from.
	if err := atomicfile.Write(filepath.Join(dir, CAKeyFile), keyPEM); err != nil {
		return nil, fmt.Errorf("pki: write CA key: %w", err)
	}
	if err := atomicfile.WriteMode(filepath.Join(dir, CACertFile), certPEM, 0o644); err != nil {
		return nil, fmt.Errorf("pki: write CA certificate: %w", err)
	}
	return &CA{Cert: cert, CertPEM: certPEM, key: key}, nil
}

// LoadCA reads the CA that InitCA wrote into dir.
func LoadCA(dir string) (*CA, error) {
	certPEM, err := os.ReadFile(filepath.Join(dir, CACertFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: %w: no %s in it (create one with 'gpupool operator tls init --dir %s')", dir, ErrNoCA, CACertFile, dir)
	}
	if err != nil {
		return nil, fmt.Errorf("pki: %w", err)
	}
	keyPEM, err := os.ReadFile(filepath.Join(dir, CAKeyFile))
	if err != nil {
		return nil, fmt.Errorf("%s: %w: cannot read the CA key %s: %v", dir, ErrNoCA, CAKeyFile, err)
	}
	ca, err := ParseCA(certPEM, keyPEM)
	if err != nil {
		return nil, fmt.Errorf("pki: CA in %s: %w", dir, err)
	}
	return ca, nil
}

// ParseCA loads a CA from its certificate and key in PEM, as InitCA
// writes them (e.g. kept in a Kubernetes Secret).
func ParseCA(certPEM, keyPEM []byte) (*CA, error) {
	pair, err := parseKeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, err
	}
	if !pair.leaf.IsCA {
		return nil, errors.New("not a CA certificate")
	}
	signer, ok := pair.cert.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, errors.New("the CA key cannot sign")
	}
	return &CA{Cert: pair.leaf, CertPEM: certPEM, key: signer}, nil
}

// Request asks the CA for a certificate.
type Request struct {
	// Name is the subject's common name; it also names the files
	// WriteKeyPair writes.
	Name string
	Role Role
	// Hosts are the IP addresses and DNS names the holder serves at; only
	// brokers serve, and a broker needs at least one.
	Hosts []string
	// HostID binds an agent certificate to one pool host; agents only.
	HostID string
	// NotBefore and NotAfter bound the validity; NotAfter must not be
	// after the CA's own.
	NotBefore, NotAfter time.Time
}

// validName is what --name may be: it becomes file names.
var validName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

// CheckName says why name cannot name a certificate, or returns nil.
func CheckName(name string) error {
	if !validName.MatchString(name) {
		return fmt.Errorf("%q: must be 1 to 63 letters, digits, '.', '-' or '_', starting with a letter or digit", name)
	}
	return nil
}

// Validate checks a request against the CA; the error names the field.
func (ca *CA) Validate(req Request) error {
	if err := CheckName(req.Name); err != nil {
		return fmt.Errorf("name %w", err)
	}
	if _, err := ParseRole(string(req.Role)); err != nil {
		return fmt.Errorf("role %w", err)
	}
	switch {
	case req.Role == RoleBroker && len(req.Hosts) == 0:
		return errors.New("host: a broker certificate needs the IP addresses or DNS names clients and agents dial it at, e.g. 10.0.0.1,broker-1.example")
	case req.Role != RoleBroker && len(req.Hosts) > 0:
		return fmt.Errorf("host: only broker certificates carry addresses; a %s only dials brokers", req.Role)
	case req.Role != RoleAgent && req.HostID != "":
		return fmt.Errorf("host-id: only agent certificates are bound to a host, not %s certificates", req.Role)
	}
	for _, h := range req.Hosts {
		if err := checkHost(h); err != nil {
			return fmt.Errorf("host %w", err)
		}
	}
	if req.HostID != "" && !validHostID.MatchString(req.HostID) {
		return fmt.Errorf("host-id %q: must be 1 to 253 letters, digits, '.', '-' or '_', starting with a letter or digit", req.HostID)
	}
	if !req.NotAfter.After(req.NotBefore) {
		return fmt.Errorf("validity: ends %s, not after its start %s", req.NotAfter.Format(time.RFC3339), req.NotBefore.Format(time.RFC3339))
	}
	if req.NotAfter.After(ca.Cert.NotAfter) {
		return fmt.Errorf("validity: ends %s, after the CA itself (%s)", req.NotAfter.Format(time.RFC3339), ca.Cert.NotAfter.Format(time.RFC3339))
	}
	return nil
}

// validHostID matches the agent's own host id rule.
var validHostID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$`)

// validDNS is a DNS name, optionally with a leading wildcard label.
var validDNS = regexp.MustCompile(`^(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$`)

func checkHost(h string) error {
	if net.ParseIP(h) != nil {
		return nil
	}
	if len(h) > 253 || !validDNS.MatchString(h) {
		return fmt.Errorf("%q: must be an IP address or a DNS name", h)
	}
	return nil
}

// BrokerPeerName is a DNS name every broker certificate carries besides
// its --host addresses. Brokers verify each other by it (and the broker
// role), not by the address they dial: a broker's Raft and gRPC addresses
// may change (a new pod IP) without a new certificate.
const BrokerPeerName = "broker.gpupool.internal"

// Issue signs a certificate for req with a new key and returns both as
// PEM. Brokers get server and client authentication (they dial each
// other) and the DNS name BrokerPeerName; agents and clients client
// authentication only.
func (ca *CA) Issue(req Request) (certPEM, keyPEM []byte, err error) {
	if err := ca.Validate(req); err != nil {
		return nil, nil, fmt.Errorf("pki: %w", err)
	}
	key, err := newKey(algorithmOf(ca.key))
	if err != nil {
		return nil, nil, err
	}
	serial, err := newSerial()
	if err != nil {
		return nil, nil, err
	}
	id := Identity{Name: req.Name, Role: req.Role, HostID: req.HostID}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: req.Name, Organization: []string{"gpupool"}, OrganizationalUnit: []string{string(req.Role)}},
		NotBefore:    req.NotBefore,
		NotAfter:     req.NotAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		URIs:         id.uris(),
	}
	if req.Role == RoleBroker {
		tmpl.ExtKeyUsage = append(tmpl.ExtKeyUsage, x509.ExtKeyUsageServerAuth)
		tmpl.DNSNames = append(tmpl.DNSNames, BrokerPeerName)
	}
	for _, h := range req.Hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, key.Public(), ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("pki: sign certificate %q: %w", req.Name, err)
	}
	if keyPEM, err = encodeKey(key); err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM, nil
}

// KeyPairPaths are the files WriteKeyPair writes for name in dir.
func KeyPairPaths(dir, name string) (certPath, keyPath string) {
	return filepath.Join(dir, name+".pem"), filepath.Join(dir, name+"-key.pem")
}

// WriteKeyPair writes NAME.pem (0644) and NAME-key.pem (0600) into dir,
// each replaced atomically, the key first.
func WriteKeyPair(dir, name string, certPEM, keyPEM []byte) (certPath, keyPath string, err error) {
	certPath, keyPath = KeyPairPaths(dir, name)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", fmt.Errorf("pki: %w", err)
	}
	if err := atomicfile.Write(keyPath, keyPEM); err != nil {
		return "", "", fmt.Errorf("pki: write %s: %w", keyPath, err)
	}
	if err := atomicfile.WriteMode(certPath, certPEM, 0o644); err != nil {
		return "", "", fmt.Errorf("pki: write %s: %w", certPath, err)
	}
	return certPath, keyPath, nil
}

func newKey(alg Algorithm) (crypto.Signer, error) {
	switch alg {
	case ECDSAP256:
		return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	case Ed25519:
		_, k, err := ed25519.GenerateKey(rand.Reader)
		return k, err
	}
	return nil, fmt.Errorf("pki: algorithm %q: must be one of %s", alg, nameList(Algorithms))
}

// ParseAlgorithm checks s names a supported key type.
func ParseAlgorithm(s string) (Algorithm, error) { return parseName(s, Algorithms) }

// parseName returns s as the one of names it spells, or an error that
// lists names.
func parseName[T ~string](s string, names []T) (T, error) {
	if v := T(s); slices.Contains(names, v) {
		return v, nil
	}
	return "", fmt.Errorf("%q: must be one of %s", s, nameList(names))
}

// nameList is names separated by commas, in their order.
func nameList[T ~string](names []T) string {
	ss := make([]string, len(names))
	for i, n := range names {
		ss[i] = string(n)
	}
	return strings.Join(ss, ", ")
}

func algorithmOf(k crypto.Signer) Algorithm {
	if _, ok := k.(ed25519.PrivateKey); ok {
		return Ed25519
	}
	return ECDSAP256
}

func encodeKey(k crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, fmt.Errorf("pki: encode key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

func newSerial() (*big.Int, error) {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("pki: serial: %w", err)
	}
	return n.Add(n, big.NewInt(1)), nil
}
