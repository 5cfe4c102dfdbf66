package cudaserver

import (
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// leaseServerArg is LeaseServer on a command line: the agent passes it to
// the per-lease server process it starts, as an argument, which the
// lease's own processes cannot change (a file in the lease's directory
// they could).
type leaseServerArg struct {
	Lease      json.RawMessage   `json:"lease"`
	HostID     string            `json:"host_id"`
	Inventory  []json.RawMessage `json:"inventory"`
	Backend    string            `json:"backend"`
	DriverPath string            `json:"driver_path,omitempty"`
	Limits     *SessionLimits    `json:"limits,omitempty"`
}

// Arg encodes ls, all but its Logger, as one command-line argument that
// ParseArg reads back.
func (ls LeaseServer) Arg() (string, error) {
	lease, err := protojson.Marshal(ls.Lease)
	if err != nil {
		return "", fmt.Errorf("cudaserver: lease: %w", err)
	}
	a := leaseServerArg{Lease: lease, HostID: ls.HostID, Backend: ls.Backend, DriverPath: ls.DriverPath, Limits: ls.Limits}
	for _, d := range ls.Inventory {
		b, err := protojson.Marshal(d)
		if err != nil {
			return "", fmt.Errorf("cudaserver: inventory: %w", err)
		}
		a.Inventory = append(a.Inventory, b)
	}
	b, err := json.Marshal(a)
	return string(b), err
}

// ParseArg reads what Arg wrote and checks it as NewServer will.
func ParseArg(s string) (LeaseServer, error) {
	var a leaseServerArg
	if err := json.Unmarshal([]byte(s), &a); err != nil {
		return LeaseServer{}, fmt.Errorf("cudaserver: the lease's description: %w", err)
	}
	ls := LeaseServer{Lease: &gpupoolv1.Lease{}, HostID: a.HostID, Backend: a.Backend, DriverPath: a.DriverPath, Limits: a.Limits}
	if err := protojson.Unmarshal(a.Lease, ls.Lease); err != nil {
		return LeaseServer{}, fmt.Errorf("cudaserver: the lease's description: lease: %w", err)
	}
	for i, raw := range a.Inventory {
		d := &gpupoolv1.Device{}
		if err := protojson.Unmarshal(raw, d); err != nil {
			return LeaseServer{}, fmt.Errorf("cudaserver: the lease's description: inventory[%d]: %w", i, err)
		}
		ls.Inventory = append(ls.Inventory, d)
	}
	if _, err := LeaseDevices(ls.Lease, ls.HostID, ls.Inventory); err != nil {
		return LeaseServer{}, err
	}
	if ls.Backend != BackendReal && ls.Backend != BackendSimulated {
		return LeaseServer{}, fmt.Errorf("cudaserver: backend %q: must be %q or %q", ls.Backend, BackendReal, BackendSimulated)
	}
	if ls.Limits != nil {
		if err := ls.Limits.Validate(); err != nil {
			return LeaseServer{}, err
		}
	}
	return ls, nil
}
