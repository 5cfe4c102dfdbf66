package fsm

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// MessageType identifies a command in the Raft log. The numbers are
// append-only: never renumber or reuse one, because logs and snapshots
// outlive binaries.
type MessageType uint8

const (
	UpsertServerType  MessageType = 1
	RegisterHostType  MessageType = 2
	SetHostStatusType MessageType = 3
	GrantLeaseType    MessageType = 4
	EndLeaseType      MessageType = 5
	FreeLeaseType     MessageType = 6
	// SetDeviceHealth and RecordAgentEvents change what placement sees
	// (health) and lease records, so they are not ignorable.
	SetDeviceHealthType   MessageType = 7
	RecordAgentEventsType MessageType = 8
	SetSigningKeysType    MessageType = 9
	DrainHostType         MessageType = 10
	// SetQuota changes which grants Apply accepts, so it is not ignorable.
	SetQuotaType MessageType = 11
	// SetHostEligibility changes which hosts take grants: not ignorable.
	SetHostEligibilityType MessageType = 12
	// The queue and preemption change which grants happen: not ignorable.
	EnqueueLeaseType  MessageType = 13
	PreemptLeasesType MessageType = 14
	// ACL tokens decide who may call: not ignorable.
	CreateACLTokenType MessageType = 15
	RevokeACLTokenType MessageType = 16
	// An operator's consent to a host's new identity: not ignorable, it
	// changes which registrations apply.
	ResetHostIdentityType MessageType = 17
	// Removing ended leases changes what reads and retries find: not
	// ignorable.
	CollectEndedLeasesType MessageType = 18
	// A tenant's claim by a Kubernetes cluster: not ignorable, it decides
	// which later claims apply.
	ClaimTenantType MessageType = 19
)

// IgnoreUnknownTypeFlag marks a command that servers which do not know its
// type may skip. Set it on new command types that older servers can safely
// ignore (for example, purely informational ones).
const IgnoreUnknownTypeFlag MessageType = 128

// ErrUnknownCommand is returned by Decode for a type this binary does not know.
var ErrUnknownCommand = errors.New("fsm: unknown command type")

func newMessage(t MessageType) proto.Message {
	switch t {
	case UpsertServerType:
		return &gpupoolv1.UpsertServerCommand{}
	case RegisterHostType:
		return &gpupoolv1.RegisterHostCommand{}
	case SetHostStatusType:
		return &gpupoolv1.SetHostStatusCommand{}
	case GrantLeaseType:
		return &gpupoolv1.GrantLeaseCommand{}
	case EndLeaseType:
		return &gpupoolv1.EndLeaseCommand{}
	case FreeLeaseType:
		return &gpupoolv1.FreeLeaseCommand{}
	case SetDeviceHealthType:
		return &gpupoolv1.SetDeviceHealthCommand{}
	case RecordAgentEventsType:
		return &gpupoolv1.RecordAgentEventsCommand{}
	case SetSigningKeysType:
		return &gpupoolv1.SetSigningKeysCommand{}
	case DrainHostType:
		return &gpupoolv1.DrainHostCommand{}
	case SetQuotaType:
		return &gpupoolv1.SetQuotaCommand{}
	case SetHostEligibilityType:
		return &gpupoolv1.SetHostEligibilityCommand{}
	case EnqueueLeaseType:
		return &gpupoolv1.EnqueueLeaseCommand{}
	case PreemptLeasesType:
		return &gpupoolv1.PreemptLeasesCommand{}
	case CreateACLTokenType:
		return &gpupoolv1.CreateAclTokenCommand{}
	case RevokeACLTokenType:
		return &gpupoolv1.RevokeAclTokenCommand{}
	case ResetHostIdentityType:
		return &gpupoolv1.ResetHostIdentityCommand{}
	case CollectEndedLeasesType:
		return &gpupoolv1.CollectEndedLeasesCommand{}
	case ClaimTenantType:
		return &gpupoolv1.ClaimTenantCommand{}
	}
	return nil
}

// TypeOf returns the message type of a command message.
func TypeOf(m proto.Message) (MessageType, error) {
	switch m.(type) {
	case *gpupoolv1.UpsertServerCommand:
		return UpsertServerType, nil
	case *gpupoolv1.RegisterHostCommand:
		return RegisterHostType, nil
	case *gpupoolv1.SetHostStatusCommand:
		return SetHostStatusType, nil
	case *gpupoolv1.GrantLeaseCommand:
		return GrantLeaseType, nil
	case *gpupoolv1.EndLeaseCommand:
		return EndLeaseType, nil
	case *gpupoolv1.FreeLeaseCommand:
		return FreeLeaseType, nil
	case *gpupoolv1.SetDeviceHealthCommand:
		return SetDeviceHealthType, nil
	case *gpupoolv1.RecordAgentEventsCommand:
		return RecordAgentEventsType, nil
	case *gpupoolv1.SetSigningKeysCommand:
		return SetSigningKeysType, nil
	case *gpupoolv1.DrainHostCommand:
		return DrainHostType, nil
	case *gpupoolv1.SetQuotaCommand:
		return SetQuotaType, nil
	case *gpupoolv1.SetHostEligibilityCommand:
		return SetHostEligibilityType, nil
	case *gpupoolv1.EnqueueLeaseCommand:
		return EnqueueLeaseType, nil
	case *gpupoolv1.PreemptLeasesCommand:
		return PreemptLeasesType, nil
	case *gpupoolv1.CreateAclTokenCommand:
		return CreateACLTokenType, nil
	case *gpupoolv1.RevokeAclTokenCommand:
		return RevokeACLTokenType, nil
	case *gpupoolv1.ResetHostIdentityCommand:
		return ResetHostIdentityType, nil
	case *gpupoolv1.CollectEndedLeasesCommand:
		return CollectEndedLeasesType, nil
	case *gpupoolv1.ClaimTenantCommand:
		return ClaimTenantType, nil
	}
	return 0, fmt.Errorf("fsm: %T is not a command", m)
}

// Encode returns a log entry: one type byte, then the message.
func Encode(m proto.Message) ([]byte, error) {
	t, err := TypeOf(m)
	if err != nil {
		return nil, err
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("fsm: encode %T: %w", m, err)
	}
	return append([]byte{byte(t)}, b...), nil
}

// Decode parses a log entry. For an unknown type it returns the type and
// ErrUnknownCommand; the caller decides, from IgnoreUnknownTypeFlag,
// whether that is fatal.
func Decode(b []byte) (MessageType, proto.Message, error) {
	if len(b) == 0 {
		return 0, nil, errors.New("fsm: empty log entry")
	}
	t := MessageType(b[0])
	m := newMessage(t &^ IgnoreUnknownTypeFlag)
	if m == nil {
		return t, nil, fmt.Errorf("%w %d", ErrUnknownCommand, t)
	}
	if err := proto.Unmarshal(b[1:], m); err != nil {
		return t, nil, fmt.Errorf("fsm: decode command type %d: %w", t, err)
	}
	return t, m, nil
}
