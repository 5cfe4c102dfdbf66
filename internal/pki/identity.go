// Package pki is gpupool's small certificate authority: it creates the
// cluster CA, issues certificates for brokers, agents and clients, and
// serves TLS configurations from certificate files that are reloaded
// when they change on disk.
//
// Every certificate names its holder's role (broker, agent or client) in
// a URI SAN "gpupool:role:ROLE", and an agent's certificate may bind it to
// one host id with "gpupool:host-id:ID". The role is also the subject's
// organizational unit, for people reading the certificate with openssl.
// IdentityOf reads both back from a verified peer certificate.
package pki

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net/url"
	"strings"
)

// Role is what a certificate's holder is allowed to be.
type Role string

// The roles a certificate can carry.
const (
	// RoleBroker is a broker server: it serves gRPC and Raft and dials
	// the other brokers, so its certificate is both a server and a client
	// certificate, with the addresses it is reached at as SANs.
	RoleBroker Role = "broker"
	// RoleAgent is the agent of a pool host; it only dials brokers.
	RoleAgent Role = "agent"
	// RoleClient is the CLI, the SDK and the Kubernetes components; they
	// only dial brokers.
	RoleClient Role = "client"
)

// Roles lists every role, in the order the CLI shows them.
var Roles = []Role{RoleBroker, RoleAgent, RoleClient}

// ParseRole checks s names a role.
func ParseRole(s string) (Role, error) { return parseName(s, Roles) }

// URI SAN prefixes that carry the identity. They are opaque URIs:
// url.Parse gives scheme "gpupool" and the rest as Opaque.
const (
	uriScheme     = "gpupool"
	roleURIPrefix = "role:"
	hostURIPrefix = "host-id:"
)

// Identity is who a certificate says its holder is.
type Identity struct {
	// Name is the subject's common name (the --name it was issued for).
	Name string
	Role Role
	// HostID is the host an agent certificate is bound to; empty when
	// the certificate is not bound to a host.
	HostID string
}

// ErrNoIdentity is returned by IdentityOf for a certificate that was not
// issued by gpupool's CA tooling (no role SAN).
var ErrNoIdentity = errors.New("pki: certificate carries no gpupool role (issue it with 'gpupool operator tls issue')")

// IdentityOf reads the identity from a certificate. It does not verify
// the certificate: call it on a peer certificate the TLS handshake has
// already verified against the CA.
func IdentityOf(cert *x509.Certificate) (Identity, error) {
	id := Identity{Name: cert.Subject.CommonName}
	for _, u := range cert.URIs {
		if u.Scheme != uriScheme {
			continue
		}
		switch {
		case strings.HasPrefix(u.Opaque, roleURIPrefix):
			if id.Role != "" {
				return Identity{}, fmt.Errorf("pki: certificate %q carries more than one role", id.Name)
			}
			r, err := ParseRole(strings.TrimPrefix(u.Opaque, roleURIPrefix))
			if err != nil {
				return Identity{}, fmt.Errorf("pki: certificate %q: role %w", id.Name, err)
			}
			id.Role = r
		case strings.HasPrefix(u.Opaque, hostURIPrefix):
			id.HostID = strings.TrimPrefix(u.Opaque, hostURIPrefix)
		}
	}
	if id.Role == "" {
		return Identity{}, ErrNoIdentity
	}
	return id, nil
}

func (id Identity) uris() []*url.URL {
	out := []*url.URL{{Scheme: uriScheme, Opaque: roleURIPrefix + string(id.Role)}}
	if id.HostID != "" {
		out = append(out, &url.URL{Scheme: uriScheme, Opaque: hostURIPrefix + id.HostID})
	}
	return out
}
