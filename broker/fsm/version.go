package fsm

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"

	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// Version is the newest command-set version this binary applies. A
// version names a set of command types (commandVersion): a server of
// version v applies every command whose type was added at or before v.
// Bump it, and give the new types that version, whenever a command type
// is added.
const Version uint32 = 3

// commandVersion is the command-set version that introduced each type.
// Version 1 is every command of the servers that did not report one.
var commandVersion = map[MessageType]uint32{
	UpsertServerType: 1, RegisterHostType: 1, SetHostStatusType: 1, GrantLeaseType: 1,
	EndLeaseType: 1, FreeLeaseType: 1, SetDeviceHealthType: 1, RecordAgentEventsType: 1,
	SetSigningKeysType: 1, DrainHostType: 1, SetQuotaType: 1, SetHostEligibilityType: 1,
	EnqueueLeaseType: 1, PreemptLeasesType: 1, CreateACLTokenType: 1, RevokeACLTokenType: 1,
	// Version 2: an operator's consent to a host's new identity.
	ResetHostIdentityType: 2,
	// Version 3: the leader's collection of ended leases.
	CollectEndedLeasesType: 3,
	// Version 3: a tenant claimed by one Kubernetes cluster.
	ClaimTenantType: 3,
}

// CommandVersion returns the command-set version that a server needs to
// apply commands of type t (ignoring IgnoreUnknownTypeFlag), and false
// for a type this binary does not know.
func CommandVersion(t MessageType) (uint32, bool) {
	v, ok := commandVersion[t&^IgnoreUnknownTypeFlag]
	return v, ok
}

// FieldVersion is the command-set version that the fields set in cmd
// need, beyond its type's: an older server would decode such a command
// but skip the field and apply it differently from the others.
// Version 2 added RevokeAclTokenCommand.revoke_leases.
func FieldVersion(cmd proto.Message) uint32 {
	if c, ok := cmd.(*gpupoolv1.RevokeAclTokenCommand); ok && c.RevokeLeases {
		return 2
	}
	return 1
}

// ServerVersion is the command-set version a server reported; servers
// older than the report apply version 1.
func ServerVersion(reported uint32) uint32 { return max(reported, 1) }

// SnapshotVersion is the format version of the snapshots this binary
// writes, and the newest it restores. Snapshots written before versions
// existed carry 0 and read as version 1.
const SnapshotVersion uint32 = 1

// ErrSnapshotVersion wraps a snapshot newer than this binary reads.
var ErrSnapshotVersion = errors.New("fsm: snapshot version")

// checkSnapshotVersion refuses a snapshot of a version newer than
// SnapshotVersion, naming both.
func checkSnapshotVersion(v uint32) error {
	if v > SnapshotVersion {
		return fmt.Errorf("%w %d is newer than this server reads (version %d): upgrade this server before it restores it", ErrSnapshotVersion, v, SnapshotVersion)
	}
	return nil
}

// CheckSnapshot refuses a snapshot body (as Snapshot writes it) that does
// not decode, or whose version is newer than this binary reads.
func CheckSnapshot(b []byte) error {
	var snap gpupoolv1.StateSnapshot
	if err := proto.Unmarshal(b, &snap); err != nil {
		return fmt.Errorf("body does not decode: %w", err)
	}
	return checkSnapshotVersion(max(snap.Version, 1))
}
