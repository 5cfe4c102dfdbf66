package client

import (
	"testing"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestAnAcquireGetsAFreshRequestIDInOneCopyAndKeepsAGivenOne(t *testing.T) {
	in := &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{Count: 1, Exclusive: true}, WaitMs: 5}
	a, b := withRequestID(in), withRequestID(in)
	if a.Request.RequestId == "" || a.Request.RequestId == b.Request.RequestId {
		t.Fatalf("request ids %q and %q, want two different non-empty ones", a.Request.RequestId, b.Request.RequestId)
	}
	if in.Request.RequestId != "" {
		t.Fatalf("the caller's request: got request id %q, want it left empty", in.Request.RequestId)
	}
	if a.WaitMs != 5 || a.Request.Count != 1 || !a.Request.Exclusive {
		t.Fatalf("the copy: got %v, want the caller's fields kept", a)
	}
	given := &gpupoolv1.AcquireRequest{Request: &gpupoolv1.LeaseRequest{RequestId: "mine"}}
	if got := withRequestID(given); got != given {
		t.Fatalf("a request with an id: got a copy %v, want the request itself", got)
	}
	if got := withRequestID(&gpupoolv1.AcquireRequest{}); got.Request != nil {
		t.Fatalf("an acquire without a request: got %v, want it passed on for the brokers to refuse", got)
	}
}
