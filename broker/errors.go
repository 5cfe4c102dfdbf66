package broker

import (
	"context"
	"errors"

	"github.com/hashicorp/raft"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/broker/fsm"
	"github.com/gpupool/gpupool/broker/lease"
	"github.com/gpupool/gpupool/broker/placement"
)

var (
	// ErrNoLeader means the cluster has no leader this server knows of.
	ErrNoLeader = errors.New("no leader elected yet; retry shortly")
	// ErrLeadershipLost means this server stopped leading mid-call.
	ErrLeadershipLost = errors.New("leadership changed during the call; retry")
)

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
		return err
	}
	var fe *lease.FieldError
	var pe *placement.Error
	var ce *fsm.ConflictError
	var pce *fsm.PreconditionError
	var qe *fsm.QuotaError
	var ie *fsm.IdentityError
	switch {
	case errors.As(err, &ie):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.As(err, &fe):
		return status.Error(codes.InvalidArgument, err.Error())
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
