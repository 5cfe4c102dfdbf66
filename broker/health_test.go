package broker

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func TestHealthServesWithoutATokenOnceALeaderIsKnown(t *testing.T) {
	ts := startServer(t, func(c *Config) { c.ACL = true })
	if err := ts.s.Ready(); err != nil {
		t.Fatalf("Ready of a leader: got %v, want nil", err)
	}
	h := healthpb.NewHealthClient(ts.c.Conn())
	// Watch waits for the status to change, unlike polling Check.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	w, err := h.Watch(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	for {
		resp, err := w.Recv()
		if err != nil {
			t.Fatalf("health watch without a token on an ACL broker: %v", err)
		}
		if resp.GetStatus() == healthpb.HealthCheckResponse_SERVING {
			break
		}
	}
	if _, err := h.Check(ctx, &healthpb.HealthCheckRequest{Service: "nosuch"}); err == nil {
		t.Errorf("Check of an unknown service: got no error, want NotFound")
	}
}

func TestServerInfoNamesRoleTermVersionAndPeers(t *testing.T) {
	ts := startServer(t)
	info, err := gpupoolv1.NewClusterServiceClient(ts.c.Conn()).ServerInfo(ctx(t), &gpupoolv1.ServerInfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info.GetRaftState() != "leader" || info.GetTerm() == 0 || info.GetLastContactMs() != 0 || info.GetVersion() == "" {
		t.Errorf("got state %q term %d last contact %d version %q, want leader, a term, 0 and a version",
			info.GetRaftState(), info.GetTerm(), info.GetLastContactMs(), info.GetVersion())
	}
	if len(info.GetPeers()) != 1 || info.GetPeers()[0].GetId() != ts.s.ID() || info.GetPeers()[0].GetRpcAddress() != ts.s.Addr() || !info.GetPeers()[0].GetVoter() {
		t.Errorf("peers: got %v, want this server as the one voter", info.GetPeers())
	}
}
