package initjobs

import (
	"bytes"
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/gpupool/gpupool/internal/pki"
)

// Keys of the TLS Secrets: the shape cert-manager writes, which the
// chart mounts at /etc/gpupool/tls.
const (
	KeyCACert  = "ca.crt"
	KeyCAKey   = "ca.key" // only in the CA Secret
	KeyTLSCert = "tls.crt"
	KeyTLSKey  = "tls.key"
)

// RenewBefore: a certificate of ours that expires sooner than this is
// issued again by TLSInit.
const RenewBefore = 30 * 24 * time.Hour

// TLSConfig says which Secrets TLSInit makes.
type TLSConfig struct {
	Namespace string
	// CASecret keeps the CA's certificate and key (ca.crt, ca.key).
	CASecret string
	// BrokerSecret, AgentSecret and ClientSecret get ca.crt, tls.crt and
	// tls.key: a broker certificate for BrokerHosts, one agent certificate
	// for every node (bound to no host id), and a client certificate for
	// the controller, the node plugin and the init Jobs.
	BrokerSecret, AgentSecret, ClientSecret string
	// BrokerHosts are the DNS names and IPs clients dial the brokers at.
	BrokerHosts []string
	// Validity of the certificates (the CA gets pki.DefaultCAValidity).
	Validity time.Duration
	// Now is the time certificates are issued at; zero means time.Now.
	Now time.Time
}

// Validate names the first field that is wrong.
func (c TLSConfig) Validate() error {
	switch {
	case c.Namespace == "":
		return errors.New("namespace: required (--namespace or $POD_NAMESPACE)")
	case c.CASecret == "" || c.BrokerSecret == "" || c.AgentSecret == "" || c.ClientSecret == "":
		return errors.New("secret names: --ca-secret, --broker-secret, --agent-secret and --client-secret are required")
	case len(c.BrokerHosts) == 0:
		return errors.New("broker-hosts: give the DNS names the brokers are dialed at, e.g. *.gpupool-broker.gpupool-system.svc.cluster.local")
	case c.Validity <= 0 || c.Validity > pki.DefaultCAValidity:
		return fmt.Errorf("validity %s: must be positive and at most the CA's %s", c.Validity, pki.DefaultCAValidity)
	}
	return nil
}

// TLSInit makes the CA Secret, then each component's TLS Secret that is
// missing or holds a certificate of this CA that expires within
// RenewBefore. It reports each Secret it creates or renews to out.
func TLSInit(ctx context.Context, kube kubernetes.Interface, cfg TLSConfig, out io.Writer) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	now := cfg.Now
	if now.IsZero() {
		now = time.Now()
	}
	s := secrets{kube: kube, ns: cfg.Namespace, out: out, by: "tls-init"}
	ca, err := loadOrCreateCA(ctx, s, cfg.CASecret, now)
	if err != nil {
		return err
	}
	notAfter := now.Add(cfg.Validity)
	if notAfter.After(ca.Cert.NotAfter) {
		notAfter = ca.Cert.NotAfter
	}
	for _, c := range []struct {
		secret string
		req    pki.Request
	}{
		{cfg.BrokerSecret, pki.Request{Name: "broker", Role: pki.RoleBroker, Hosts: cfg.BrokerHosts}},
		{cfg.AgentSecret, pki.Request{Name: "agent", Role: pki.RoleAgent}},
		{cfg.ClientSecret, pki.Request{Name: "k8s", Role: pki.RoleClient}},
	} {
		c.req.NotBefore, c.req.NotAfter = now.Add(-5*time.Minute), notAfter
		if err := ensureCert(ctx, s, ca, c.secret, c.req, now); err != nil {
			return err
		}
	}
	return nil
}

// loadOrCreateCA reads the CA from its Secret, creating both first when
// the Secret does not exist.
func loadOrCreateCA(ctx context.Context, s secrets, name string, now time.Time) (*pki.CA, error) {
	sec, err := s.get(ctx, name)
	if err != nil {
		return nil, err
	}
	if sec == nil {
		dir, err := os.MkdirTemp("", "gpupool-ca-")
		if err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
		if _, err := pki.InitCA(dir, pki.Algorithms[0], "gpupool CA", now, pki.DefaultCAValidity); err != nil {
			return nil, err
		}
		certPEM, err := os.ReadFile(filepath.Join(dir, pki.CACertFile))
		if err != nil {
			return nil, err
		}
		keyPEM, err := os.ReadFile(filepath.Join(dir, pki.CAKeyFile))
		if err != nil {
			return nil, err
		}
		// Another run may have won the race: its CA is the one.
		if sec, _, err = s.create(ctx, name, map[string][]byte{KeyCACert: certPEM, KeyCAKey: keyPEM}); err != nil {
			return nil, err
		}
	}
	ca, err := pki.ParseCA(sec.Data[KeyCACert], sec.Data[KeyCAKey])
	if err != nil {
		return nil, fmt.Errorf("Secret %s/%s: keys %s and %s: %w", s.ns, name, KeyCACert, KeyCAKey, err)
	}
	return ca, nil
}

// ensureCert creates the Secret of one certificate, or renews one of
// this CA that expires within RenewBefore. A Secret with a certificate of
// another CA was made by someone else: it is kept, and said so.
func ensureCert(ctx context.Context, s secrets, ca *pki.CA, name string, req pki.Request, now time.Time) error {
	sec, err := s.get(ctx, name)
	if err != nil {
		return err
	}
	if sec != nil {
		if !bytes.Equal(sec.Data[KeyCACert], ca.CertPEM) {
			fmt.Fprintf(s.out, "kept Secret %s: its ca.crt is not this CA's (made by hand or by cert-manager?)\n", name)
			return nil
		}
		if exp, ok := notAfter(sec.Data[KeyTLSCert]); ok && exp.Sub(now) > RenewBefore {
			return nil
		}
	}
	certPEM, keyPEM, err := ca.Issue(req)
	if err != nil {
		return err
	}
	data := map[string][]byte{KeyCACert: ca.CertPEM, KeyTLSCert: certPEM, KeyTLSKey: keyPEM}
	if sec == nil {
		_, _, err = s.create(ctx, name, data)
		return err
	}
	sec = sec.DeepCopy()
	sec.Data = data
	if _, err := s.setKey(ctx, sec, KeyTLSCert, certPEM); err != nil {
		return err
	}
	fmt.Fprintf(s.out, "renewed the certificate in Secret %s (valid until %s)\n", name, req.NotAfter.Format(time.RFC3339))
	return nil
}

// notAfter is the expiry of the first certificate in PEM.
func notAfter(certPEM []byte) (time.Time, bool) {
	b, _ := pem.Decode(certPEM)
	if b == nil {
		return time.Time{}, false
	}
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return time.Time{}, false
	}
	return c.NotAfter, true
}
