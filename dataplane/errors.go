package dataplane

import (
	"errors"
	"fmt"

	"github.com/quic-go/quic-go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

var (
	// ErrLeaseEnded is returned by an operation whose lease stopped being
	// enforced on the agent while it ran: revoked, released or expired.
	ErrLeaseEnded = errors.New("dataplane: the lease ended on this host (revoked, released or expired)")
	// ErrAgentShutdown is returned by an operation the agent ended because
	// it is shutting down.
	ErrAgentShutdown = errors.New("dataplane: the agent is shutting down")
	// ErrAgentFailed is returned by an operation the agent could not
	// finish, e.g. reading a file failed; the agent's log says why.
	ErrAgentFailed = errors.New("dataplane: the agent failed the operation (its log says why)")
	// ErrProtocol is returned when the peer broke the protocol.
	ErrProtocol = errors.New("dataplane: protocol violation")
	// ErrChecksumMismatch is returned by Put and Get when the data received
	// does not hash to the SHA-256 the sender announced.
	ErrChecksumMismatch = errors.New("dataplane: sha256 mismatch")
	// ErrCertMismatch is returned by Dial when the agent's certificate is
	// not the one pinned.
	ErrCertMismatch = errors.New("dataplane: agent certificate does not match the pinned sha256")
)

// RefusedError is the agent's refusal of an operation: the StreamAccept or
// PutResult error. Its message reads like "unauthenticated: token expired".
type RefusedError struct {
	Code    gpupoolv1.AcceptCode
	Message string
}

func (e *RefusedError) Error() string {
	return codeName(e.Code) + ": " + e.Message
}

// GRPCStatus makes status.Code and status.FromError see the refusal as the
// matching gRPC code, so callers can map it like any broker error.
func (e *RefusedError) GRPCStatus() *status.Status {
	return status.New(grpcCode(e.Code), e.Message)
}

// refusef returns a RefusedError with a formatted message.
func refusef(code gpupoolv1.AcceptCode, format string, args ...any) *RefusedError {
	return &RefusedError{Code: code, Message: fmt.Sprintf(format, args...)}
}

func codeName(c gpupoolv1.AcceptCode) string {
	switch c {
	case gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED:
		return "unauthenticated"
	case gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED:
		return "permission denied"
	case gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT:
		return "invalid argument"
	case gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND:
		return "not found"
	case gpupoolv1.AcceptCode_ACCEPT_CODE_INTERNAL:
		return "internal"
	case gpupoolv1.AcceptCode_ACCEPT_CODE_RESOURCE_EXHAUSTED:
		return "resource exhausted"
	default:
		return fmt.Sprintf("code %d", int32(c))
	}
}

func grpcCode(c gpupoolv1.AcceptCode) codes.Code {
	switch c {
	case gpupoolv1.AcceptCode_ACCEPT_CODE_OK:
		return codes.OK
	case gpupoolv1.AcceptCode_ACCEPT_CODE_UNAUTHENTICATED:
		return codes.Unauthenticated
	case gpupoolv1.AcceptCode_ACCEPT_CODE_PERMISSION_DENIED:
		return codes.PermissionDenied
	case gpupoolv1.AcceptCode_ACCEPT_CODE_INVALID_ARGUMENT:
		return codes.InvalidArgument
	case gpupoolv1.AcceptCode_ACCEPT_CODE_NOT_FOUND:
		return codes.NotFound
	case gpupoolv1.AcceptCode_ACCEPT_CODE_RESOURCE_EXHAUSTED:
		return codes.ResourceExhausted
	default:
		return codes.Internal
	}
}

// Stream error codes (QUIC RESET_STREAM and STOP_SENDING) and connection
// close codes. Append-only, like every wire enum.
const (
	// codeCanceled: the side that sends it no longer wants the stream.
	codeCanceled quic.StreamErrorCode = 0x100
	// codeLeaseEnded: the lease stopped being enforced on the agent.
	codeLeaseEnded quic.StreamErrorCode = 0x101
	// codeProtocol: the peer broke the protocol.
	codeProtocol quic.StreamErrorCode = 0x102
	// codeInternal: the agent could not finish the operation.
	codeInternal quic.StreamErrorCode = 0x103

	// connShutdown closes the connections of an agent that shuts down.
	connShutdown quic.ApplicationErrorCode = 0x100
	// connLimited closes a connection over one of the agent's limits; its
	// reason names the limit.
	connLimited quic.ApplicationErrorCode = 0x101
)

// peerError turns what a stream or connection operation returned into the
// error a caller sees: the agent's stream and connection codes become the
// sentinel errors above, anything else is returned as is.
func peerError(err error) error {
	var se *quic.StreamError
	if errors.As(err, &se) && se.Remote {
		switch se.ErrorCode {
		case codeLeaseEnded:
			return ErrLeaseEnded
		case codeProtocol:
			return ErrProtocol
		case codeInternal:
			return ErrAgentFailed
		}
	}
	var ae *quic.ApplicationError
	if errors.As(err, &ae) && ae.Remote && ae.ErrorCode == connShutdown {
		return ErrAgentShutdown
	}
	if errors.As(err, &ae) && ae.Remote && ae.ErrorCode == connLimited {
		return &RefusedError{Code: gpupoolv1.AcceptCode_ACCEPT_CODE_RESOURCE_EXHAUSTED, Message: ae.ErrorMessage}
	}
	return err
}
