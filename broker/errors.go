package broker

import (
	"context"
	"errors"
	"fmt"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/placement"
	"github.com/gpupool/gpupool/internal/limits"
	"github.com/gpupool/gpupool/protocol"
)

// Errors of the broker. The domain code returns them (the kinds below
// with the message a caller reads, through refuse and refusef, or its own
// typed errors); toStatus, and nothing else, turns them into gRPC codes,
// at the RPC boundary (the interceptors in server.go).
var (
	// ErrNoLeader means the cluster has no leader this server knows of.
	ErrNoLeader = errors.New("no leader elected yet; retry shortly")
	// ErrLeadershipLost means this server stopped leading mid-call.
	ErrLeadershipLost = errors.New("leadership changed during the call; retry")

	// ErrInvalid: the request is wrong and will stay wrong (InvalidArgument).
	ErrInvalid = errors.New("invalid request")
	// ErrNotFound: what the request names does not exist (NotFound).
	ErrNotFound = errors.New("not found")
	// ErrExists: what the request would create exists already (AlreadyExists).
	ErrExists = errors.New("already exists")
	// ErrExhausted: no capacity or quota now, or a stream fell behind; the
	// same request may succeed later (ResourceExhausted).
	ErrExhausted = errors.New("exhausted")
	// ErrPrecondition: the state does not allow it until something else
	// changes it (FailedPrecondition).
	ErrPrecondition = errors.New("failed precondition")
	// ErrUnavailable: this server cannot serve it now; retry, perhaps
	// elsewhere (Unavailable).
	ErrUnavailable = errors.New("unavailable")
	// ErrUnauthenticated: the caller's token or certificate is missing or
	// no longer valid (Unauthenticated).
	ErrUnauthenticated = errors.New("unauthenticated")
	// ErrDenied: the caller is known but may not do it (PermissionDenied).
	ErrDenied = errors.New("permission denied")
)

// codeOf maps each kind of error to its gRPC code.
var codeOf = []struct {
	kind error
	code codes.Code
}{
	{ErrInvalid, codes.InvalidArgument},
	{ErrNotFound, codes.NotFound},
	{ErrExists, codes.AlreadyExists},
	{ErrExhausted, codes.ResourceExhausted},
	{ErrPrecondition, codes.FailedPrecondition},
	{ErrUnavailable, codes.Unavailable},
	{ErrUnauthenticated, codes.Unauthenticated},
	{ErrDenied, codes.PermissionDenied},
}

// refusal is an error of one of the kinds above with the message the
// caller reads, word for word.
type refusal struct {
	kind error
	msg  string
}

func (r *refusal) Error() string { return r.msg }
func (r *refusal) Unwrap() error { return r.kind }

// refuse returns an error of kind whose message is msg.
func refuse(kind error, msg string) error { return &refusal{kind: kind, msg: msg} }

// refusef returns an error of kind whose message is formatted.
func refusef(kind error, format string, args ...any) error {
	return &refusal{kind: kind, msg: fmt.Sprintf(format, args...)}
}

// raftError turns raft's errors into errors clients can act on.
func raftError(err error) error {
	switch {
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipLost),
		errors.Is(err, raft.ErrLeadershipTransferInProgress), errors.Is(err, raft.ErrRaftShutdown):
		return status.Error(codes.Unavailable, err.Error()+"; retry")
	case errors.Is(err, raft.ErrEnqueueTimeout):
		return status.Error(codes.Unavailable, "the cluster is overloaded: "+err.Error())
	}
	return err
}

// toStatus maps every error a handler returns to a gRPC status. It is the
// one place where error types meet codes.
func toStatus(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err // from another server, or raft's (raftError)
	}
	var r *refusal
	if errors.As(err, &r) {
		for _, k := range codeOf {
			if errors.Is(r.kind, k.kind) {
				return status.Error(k.code, r.msg)
			}
		}
	}
	var fe *protocol.FieldError
	var te *protocol.TenantError
	var pe *placement.Error
	var ce *fsm.ConflictError
	var pce *fsm.PreconditionError
	var qe *fsm.QuotaError
	var ie *fsm.IdentityError
	var le *limits.Error
	var tce *fsm.TenantClaimedError
	switch {
	case errors.As(err, &le):
		return status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, ErrDiskFull):
		return status.Error(codes.Unavailable, err.Error())
	case errors.As(err, &tce):
		return status.Error(codes.AlreadyExists, err.Error())
	case errors.As(err, &ie):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.As(err, &fe):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.As(err, &te):
		return status.Error(codes.PermissionDenied, err.Error())
	case errors.As(err, &pe):
		if pe.Never {
			return status.Error(codes.FailedPrecondition, "request can never fit this pool: "+pe.Reason)
		}
		return status.Error(codes.ResourceExhausted, "no capacity now: "+pe.Reason)
	case errors.As(err, &ce):
		return status.Error(codes.Aborted, err.Error()+"; retry")
	case errors.As(err, &pce):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.As(err, &qe):
		return status.Error(codes.ResourceExhausted, err.Error()+"; see 'gpupool operator quota ls'")
	case errors.Is(err, fsm.ErrNotFound):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, fsm.ErrInvalid):
		return status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, ErrNoLeader), errors.Is(err, ErrLeadershipLost):
		return status.Error(codes.Unavailable, err.Error())
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, err.Error())
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// statusUnary is the RPC boundary of unary calls: every error a handler
// or an inner interceptor returns leaves as a gRPC status, by toStatus.
func statusUnary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	resp, err := handler(ctx, req)
	return resp, toStatus(err)
}
