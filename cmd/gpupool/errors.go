package main

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"unicode"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpupool/gpupool/client"
)

// exitInterrupted is the exit code after Ctrl-C (128 + SIGINT), as shells
// use.
const exitInterrupted = 130

// interruptedError is what a command stopped by Ctrl-C says besides
// "interrupted": what it left behind, such as the request that left the
// queue. It still exits with exitInterrupted.
type interruptedError struct{ msg string }

func (e *interruptedError) Error() string { return e.msg }

func exitCode(err error) int {
	var ee *exitError
	if errors.As(err, &ee) {
		return ee.code
	}
	var ue *usageError
	if errors.As(err, &ue) {
		return 2
	}
	if status.Code(err) == codes.InvalidArgument {
		return 2
	}
	return 1
}

// grpcWrapper is gRPC's own "rpc error: code = X desc = " wrapping, which
// a wrapped error can carry anywhere in its text.
var grpcWrapper = regexp.MustCompile(`rpc error: code = (\w+) desc = `)

// methodPath is a full gRPC method name ("/gpupool.v1.PoolService/DrainHost").
var methodPath = regexp.MustCompile(`/(?:[a-z0-9]+\.)+[A-Za-z0-9]+/([A-Za-z0-9]+)`)

// errorMessage is the one sentence a person reads for err: the broker's
// own message, prefixed by what kind of failure it is and, where it helps,
// what to do, without gRPC's wrapping or method paths. Every error the CLI
// prints goes through it.
func errorMessage(err error) string {
	var ce *client.ClusterError
	if errors.As(err, &ce) {
		msg := ce.Error()
		switch {
		case ce.LostQuorum():
			return msg + " (start the brokers that are down; 'gpupool operator members' lists them)"
		case ce.Voters == 0:
			return msg + " (is the cluster up? set --addr or GPUPOOL_ADDR" + tlsHint(ce) + ")"
		}
		return msg
	}
	st, ok := status.FromError(err)
	if !ok {
		if errors.Is(err, context.Canceled) {
			return "interrupted"
		}
		return plain(err.Error())
	}
	msg := plain(st.Message())
	switch st.Code() {
	case codes.Unavailable:
		if client.IsTLSError(err) {
			if !global.tls.set() {
				return "cannot talk to the brokers: " + msg + " (--tls-ca, --tls-cert and --tls-key, or GPUPOOL_TLS_CA, GPUPOOL_TLS_CERT and GPUPOOL_TLS_KEY)"
			}
			return "cannot talk to the brokers over TLS: " + msg + " (check --tls-ca, --tls-cert and --tls-key)"
		}
		return "no broker reachable: " + msg + " (is the cluster up? set --addr or GPUPOOL_ADDR)"
	case codes.DeadlineExceeded:
		return "timed out waiting for the brokers (--timeout " + global.timeout.String() + "): " + msg
	case codes.Unauthenticated:
		return prefixed("unauthenticated: ", msg)
	case codes.PermissionDenied:
		return prefixed("permission denied: ", msg)
	case codes.Unimplemented:
		return "the brokers do not know this call (an older version?): " + msg
	case codes.Canceled:
		return "interrupted"
	}
	return msg
}

// prefixed puts p before msg unless msg (a wrapped error whose wrapper
// plain already named) says it.
func prefixed(p, msg string) string {
	if strings.Contains(msg, p) {
		return msg
	}
	return p + msg
}

// tlsHint suggests TLS flags when a broker refused the handshake.
func tlsHint(ce *client.ClusterError) string {
	for _, m := range ce.Members {
		if m.Outcome == client.OutcomeTLS {
			return "; check --tls-ca, --tls-cert and --tls-key"
		}
	}
	return ""
}

// plain removes gRPC's wrapping and method paths from a message:
// "rpc error: code = PermissionDenied desc = /gpupool.v1.PoolService/DrainHost: x"
// becomes "permission denied: drain host: x".
func plain(msg string) string {
	msg = grpcWrapper.ReplaceAllStringFunc(msg, func(m string) string {
		code := grpcWrapper.FindStringSubmatch(m)[1]
		switch code {
		case "Unknown", "InvalidArgument", "FailedPrecondition", "NotFound", "AlreadyExists", "Aborted", "OutOfRange", "ResourceExhausted":
			return ""
		}
		return words(code) + ": "
	})
	return methodPath.ReplaceAllStringFunc(msg, func(m string) string {
		return words(methodPath.FindStringSubmatch(m)[1])
	})
}

// words turns CamelCase into lower-case words: "DrainHost" -> "drain host".
func words(s string) string {
	var b strings.Builder
	for i, r := range s {
		if unicode.IsUpper(r) {
			if i > 0 {
				b.WriteByte(' ')
			}
			r = unicode.ToLower(r)
		}
		b.WriteRune(r)
	}
	return b.String()
}
