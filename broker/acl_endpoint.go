package broker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/broker/fsm"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
	"github.com/gpupool/gpupool/protocol"
)

// aclService implements AclService.
type aclService struct {
	gpupoolv1.UnimplementedAclServiceServer
	*node
	membership forwarder
}

// secretBytes is the size of a token's random secret.
const secretBytes = 32

func (e aclService) Bootstrap(ctx context.Context, req *gpupoolv1.AclBootstrapRequest) (*gpupoolv1.AclTokenSecret, error) {
	name := req.GetName()
	if name == "" {
		name = "bootstrap"
	}
	t := &gpupoolv1.AclToken{Name: name, Kind: gpupoolv1.TokenKind_TOKEN_KIND_MANAGEMENT}
	if err := fsm.ValidateACLToken(t); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewAclServiceClient(conn).Bootstrap(fctx, req)
	}
	if at := e.fsm.State().ACLBootstrapIndex(); at != 0 {
		return nil, refusef(ErrPrecondition, "ACL already bootstrapped (log index %d): the bootstrap token exists; create more tokens with a management token ('gpupool operator acl token create')", at)
	}
	return e.createToken(t, &gpupoolv1.Actor{Name: "bootstrap"}, true)
}

func (e aclService) CreateToken(ctx context.Context, req *gpupoolv1.CreateAclTokenRequest) (*gpupoolv1.AclTokenSecret, error) {
	if req.TtlMs < 0 || time.Duration(req.TtlMs)*time.Millisecond > protocol.MaxTokenTTL {
		return nil, refusef(ErrInvalid, "ttl_ms %d: must be 0 (no expiry) or up to %s", req.TtlMs, protocol.MaxTokenTTL)
	}
	t := &gpupoolv1.AclToken{
		Name: req.Name, Kind: req.Kind, Tenants: req.Tenants, MaxPriority: req.MaxPriority,
		PreemptibleOnly: req.PreemptibleOnly, HostId: req.HostId,
	}
	if err := fsm.ValidateACLToken(t); err != nil {
		return nil, err
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewAclServiceClient(conn).CreateToken(fctx, req)
	}
	if req.TtlMs > 0 {
		t.ExpiresAtMs = e.nowMs() + req.TtlMs
	}
	return e.createToken(t, callerFrom(ctx).actor(), false)
}

// createToken stamps a token's accessor id, secret and times and commits
// it. Only the leader calls it.
func (e aclService) createToken(t *gpupoolv1.AclToken, by *gpupoolv1.Actor, bootstrap bool) (*gpupoolv1.AclTokenSecret, error) {
	b := make([]byte, secretBytes)
	if _, err := rand.Read(b); err != nil {
		return nil, fmt.Errorf("token secret: %v", err)
	}
	secret := hex.EncodeToString(b)
	t = proto.CloneOf(t)
	t.AccessorId = uuid.NewString()
	t.SecretSha256 = hashSecret(secret)
	t.CreatedAtMs = e.nowMs()
	t.CreatedBy = by
	res, err := e.apply(&gpupoolv1.CreateAclTokenCommand{Token: t, Bootstrap: bootstrap})
	if err != nil {
		return nil, err
	}
	e.log.Info("ACL token created", "accessor", t.AccessorId, "name", t.Name, "kind", protocol.TokenKindName(t.Kind), "by", protocol.ActorText(by))
	return &gpupoolv1.AclTokenSecret{Token: e.tokenView(res.Token), Secret: secret}, nil
}

// tokenView is a token as answers show it: without its secret's hash,
// with whether it has expired on this server's clock.
func (e aclService) tokenView(t *gpupoolv1.AclToken) *gpupoolv1.AclToken {
	v := proto.CloneOf(t)
	v.SecretSha256 = nil
	v.Expired = tokenExpired(t, e.cfg.Clock.Now())
	return v
}

func (e aclService) ListTokens(ctx context.Context, req *gpupoolv1.ListAclTokensRequest) (*gpupoolv1.ListAclTokensResponse, error) {
	if conn, fctx, err := e.membership.readConn(ctx, req.Stale); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewAclServiceClient(conn).ListTokens(fctx, req)
	}
	resp := &gpupoolv1.ListAclTokensResponse{}
	for _, t := range e.fsm.State().ACLTokens() {
		resp.Tokens = append(resp.Tokens, e.tokenView(t))
	}
	return resp, nil
}

func (e aclService) RevokeToken(ctx context.Context, req *gpupoolv1.RevokeAclTokenRequest) (*gpupoolv1.RevokeAclTokenResponse, error) {
	if req.AccessorId == "" {
		return nil, refuse(ErrInvalid, "accessor_id: is required; see 'gpupool operator acl token ls'")
	}
	if conn, fctx, err := e.membership.leaderConn(ctx); err != nil {
		return nil, err
	} else if conn != nil {
		return gpupoolv1.NewAclServiceClient(conn).RevokeToken(fctx, req)
	}
	by := callerFrom(ctx).actor()
	res, err := e.apply(&gpupoolv1.RevokeAclTokenCommand{AccessorId: req.AccessorId, NowMs: e.nowMs(), Actor: by, RevokeLeases: !req.KeepLeases})
	if err != nil {
		return nil, err
	}
	e.log.Info("ACL token revoked", "accessor", req.AccessorId, "by", protocol.ActorText(by), "leases_revoked", len(res.Ended))
	return &gpupoolv1.RevokeAclTokenResponse{Token: e.tokenView(res.Token), RevokedLeases: res.Ended}, nil
}

func (e aclService) WhoAmI(ctx context.Context, _ *gpupoolv1.WhoAmIRequest) (*gpupoolv1.WhoAmIResponse, error) {
	c := callerFrom(ctx)
	resp := &gpupoolv1.WhoAmIResponse{AclEnabled: e.cfg.ACL}
	if c.token != nil {
		resp.Token = e.tokenView(c.token)
	}
	return resp, nil
}
