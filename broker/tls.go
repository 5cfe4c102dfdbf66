package broker

import (
	"context"
	"crypto/tls"
	"fmt"
	"net"
	"slices"
	"strings"
	"time"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/peer"

	"github.com/gpupool/gpupool/internal/pki"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// tlsStreamLayer is Raft's stream layer over mutual TLS: it accepts and
// dials only brokers of the cluster CA (verified by pki.BrokerPeerName,
// so that a server's address may change).
type tlsStreamLayer struct {
	net.Listener // a TLS listener; handshakes happen on first read, off the accept loop
	advertise    net.Addr
	src          *pki.Source
}

// newTLSStreamLayer listens on bind; advertise (nil: what was bound) is the
// address other servers dial.
func newTLSStreamLayer(bind string, advertise net.Addr, src *pki.Source) (*tlsStreamLayer, error) {
	l, err := net.Listen("tcp", bind)
	if err != nil {
		return nil, err
	}
	if advertise == nil {
		advertise = l.Addr()
	}
	if ip := advertise.(*net.TCPAddr).IP; ip == nil || ip.IsUnspecified() {
		l.Close()
		return nil, fmt.Errorf("%s is not an address other servers can dial; bind a specific address", advertise)
	}
	return &tlsStreamLayer{Listener: tls.NewListener(l, src.ServerConfig(pki.RoleBroker)), advertise: advertise, src: src}, nil
}

// Dial implements raft.StreamLayer.
func (l *tlsStreamLayer) Dial(address raft.ServerAddress, timeout time.Duration) (net.Conn, error) {
	d := tls.Dialer{NetDialer: &net.Dialer{Timeout: timeout}, Config: l.src.PeerConfig()}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	return d.DialContext(ctx, "tcp", string(address))
}

// Addr implements raft.StreamLayer: the address other servers dial.
func (l *tlsStreamLayer) Addr() net.Addr { return l.advertise }

// peerDialOptions are the options of this server's gRPC connections to
// the other servers: its own broker certificate over TLS, the peer
// verified by pki.BrokerPeerName; or plaintext without TLS.
func (m *membership) peerDialOptions() []grpc.DialOption {
	if m.cfg.TLS == nil {
		return []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	}
	return []grpc.DialOption{
		grpc.WithTransportCredentials(credentials.NewTLS(m.cfg.TLS.PeerConfig())),
		grpc.WithAuthority(pki.BrokerPeerName),
	}
}

// grpcServerOptions makes the gRPC server require mutual TLS when TLS is
// configured, and keeps the servers' own and the agents' services to
// certificates of those roles.
func (s *Server) grpcServerOptions() []grpc.ServerOption {
	if s.cfg.TLS == nil {
		return nil
	}
	return []grpc.ServerOption{
		grpc.Creds(credentials.NewTLS(s.cfg.TLS.ServerConfig())),
		grpc.ChainUnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if err := checkServiceRole(ctx, info.FullMethod); err != nil {
				return nil, err
			}
			return handler(ctx, req)
		}),
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			if err := checkServiceRole(ss.Context(), info.FullMethod); err != nil {
				return err
			}
			return handler(srv, ss)
		}),
	}
}

// serviceRoles are the certificate roles that may call a service; a
// service not listed is open to every certificate of the CA (ACL tokens
// decide the rest). Brokers may call everything: followers forward.
var serviceRoles = map[string][]pki.Role{
	gpupoolv1.ClusterService_ServiceDesc.ServiceName: {pki.RoleBroker},
	gpupoolv1.AgentService_ServiceDesc.ServiceName:   {pki.RoleAgent, pki.RoleBroker},
}

// anyRoleMethods are methods of a restricted service that every
// certificate of the CA may call: ServerInfo tells a client which brokers
// answer and who leads ('gpupool operator members', the CLI's diagnosis of
// a cluster without a leader).
var anyRoleMethods = map[string]bool{
	gpupoolv1.ClusterService_ServerInfo_FullMethodName: true,
}

// checkServiceRole refuses a call to a service the caller's certificate
// role may not use, with PermissionDenied.
func checkServiceRole(ctx context.Context, fullMethod string) error {
	if anyRoleMethods[fullMethod] {
		return nil
	}
	service, _, _ := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	allowed, ok := serviceRoles[service]
	if !ok {
		return nil
	}
	id, err := peerIdentity(ctx)
	if err != nil {
		return refuse(ErrUnauthenticated, err.Error())
	}
	if !slices.Contains(allowed, id.Role) {
		return refusef(ErrDenied, "%s: certificate %q has role %s; only %s certificates may call it", service, id.Name, id.Role, roleNames(allowed))
	}
	return nil
}

// peerIdentity is the identity of the caller's verified certificate.
func peerIdentity(ctx context.Context) (pki.Identity, error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return pki.Identity{}, fmt.Errorf("no peer")
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.VerifiedChains) == 0 || len(info.State.VerifiedChains[0]) == 0 {
		return pki.Identity{}, fmt.Errorf("the call carries no verified client certificate")
	}
	return pki.IdentityOf(info.State.VerifiedChains[0][0])
}

func roleNames(rs []pki.Role) string {
	out := make([]string, len(rs))
	for i, r := range rs {
		out[i] = string(r)
	}
	return strings.Join(out, " or ")
}
