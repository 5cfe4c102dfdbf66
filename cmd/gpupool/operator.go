package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/mattn/go-isatty"
	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

func newOperatorCmd() *cobra.Command {
	return newGroupCmd(&cobra.Command{
		Use:   "operator",
		Short: "Manage the broker cluster: Raft membership, leadership, snapshots, tenant quotas, ACL tokens, audit log, TLS certificates",
		Long: `Operator commands act on the broker cluster itself rather than on the pool:
list and remove Raft peers, move leadership, save or restore a snapshot
of the whole state (hosts, devices, leases), cap what each tenant may
hold with quotas, manage the ACL tokens that say who may call the brokers,
read the audit log of who did what, and make the certificates of the
cluster's mutual TLS.`,
		Example: `  gpupool operator members
  gpupool operator raft peers
  gpupool operator raft transfer-leadership --to broker-2
  gpupool operator snapshot save backup.snap
  gpupool operator snapshot restore backup.snap
  gpupool operator quota set sim --gpus 8 --memory 320GiB --compute 800
  gpupool operator tls init --dir /etc/gpupool/ca
  gpupool operator acl bootstrap
  gpupool operator audit --follow`,
	},
		newMembersCmd(),
		newGroupCmd(&cobra.Command{
			Use:   "raft",
			Short: "Inspect and change the Raft configuration of the brokers",
			Long:  `Raft commands list the broker servers that replicate the state, remove a dead one, and move leadership.`,
			Example: `  gpupool operator raft peers
  gpupool operator raft remove-peer broker-3`,
		},
			newRaftPeersCmd(),
			newRaftRemovePeerCmd(),
			newRaftTransferLeadershipCmd(),
		),
		newGroupCmd(&cobra.Command{
			Use:   "snapshot",
			Short: "Save or restore a snapshot of the whole cluster state",
			Long: `A snapshot holds the whole replicated state at one Raft index: hosts, devices,
leases, quotas, and the private token signing keys. Whoever holds a snapshot
can sign lease tokens: keep snapshots as secret as the brokers' data dirs, and
rotate the keys ('gpupool operator keys rotate') if one leaks.`,
			Example: `  gpupool operator snapshot save backup.snap
  gpupool operator snapshot restore backup.snap --yes`,
		},
			newSnapshotSaveCmd(),
			newSnapshotRestoreCmd(),
		),
		newGroupCmd(&cobra.Command{
			Use:   "keys",
			Short: "List or rotate the keys that sign lease tokens",
			Long: `The brokers sign a token for each lease and host with an Ed25519 key kept in
the replicated state; agents verify tokens with the public keys the brokers
hand them. Rotating makes a new key sign at once; the old one keeps verifying
until every token it signed has expired (the longest TTL of a granted lease,
plus a minute), then is dropped.`,
			Example: `  gpupool operator keys ls
  gpupool operator keys rotate`,
		},
			newKeysListCmd(),
			newKeysRotateCmd(),
		),
		newQuotaCmd(),
		newACLCmd(),
		newAuditCmd(),
		newTLSCmd(),
		newK8sInitCmd(),
	)
}

func newKeysListCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the token signing keys agents accept",
		Long:    `Ls lists the key that signs lease tokens now and the rotated ones that still verify, with how long they will.`,
		Example: `  gpupool operator keys ls -o json`,
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.ListSigningKeys(ctx, &gpupoolv1.ListSigningKeysRequest{})
				if err != nil {
					return err
				}
				ids := idsOf(resp.GetKeys(), (*gpupoolv1.PublicKey).GetId)
				return renderList(cmd.OutOrStdout(), resp, "signing keys", ids, func(w io.Writer) error { return printKeys(w, resp.GetKeys(), time.Now()) })
			})
		},
	}
}

func newKeysRotateCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rotate",
		Short: "Make a new key sign lease tokens; the old one verifies until its tokens expire",
		Long: `Rotate generates a new Ed25519 key, replicates it and signs every token from
now on with it. The key it replaces keeps verifying until the tokens it signed
have expired, so no lease holder is cut off; agents learn the new key with
their next heartbeat.`,
		Example: `  gpupool operator keys rotate`,
		Args:    exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.RotateSigningKey(ctx, &gpupoolv1.RotateSigningKeyRequest{})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					fmt.Fprintf(w, "now signing with %s\n\n", resp.GetKeyId())
					return printKeys(w, resp.GetKeys(), time.Now())
				})
			})
		},
	}
}

// printKeys prints one row per signing key.
func printKeys(w io.Writer, keys []*gpupoolv1.PublicKey, now time.Time) error {
	t := newTable(w, "KEY", "STATE", "PUBLIC KEY")
	for _, k := range keys {
		state := "signing"
		if k.GetVerifyUntilMs() != 0 {
			state = "verifies for " + humanDuration(time.UnixMilli(k.GetVerifyUntilMs()).Sub(now))
		}
		t.row(k.GetId(), state, base64.RawURLEncoding.EncodeToString(k.GetPublicKey()))
	}
	return t.flush()
}

func newRaftPeersCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "peers",
		Short: "List the broker servers in the Raft configuration",
		Long: `Peers lists every server in the Raft configuration, which one leads, and
which ones vote. A healthy cluster has an odd number of voters (3 or 5).`,
		Example: `  gpupool operator raft peers
  gpupool operator raft peers -o json`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.RaftPeers(ctx, &gpupoolv1.RaftPeersRequest{})
				if err != nil {
					return err
				}
				ids := idsOf(resp.GetPeers(), (*gpupoolv1.RaftPeer).GetId)
				return renderList(cmd.OutOrStdout(), resp, "peers", ids, func(w io.Writer) error { return printRaftPeers(w, resp) })
			})
		},
	}
}

// printRaftPeers prints one row per Raft peer.
func printRaftPeers(w io.Writer, resp *gpupoolv1.RaftPeersResponse) error {
	noLeader := resp.GetLeaderId() == "" && !slices.ContainsFunc(resp.GetPeers(), (*gpupoolv1.RaftPeer).GetLeader)
	t := newTable(w, "ID", "RAFT ADDRESS", "RPC ADDRESS", "ROLE", "VOTER")
	for _, p := range resp.GetPeers() {
		role := "follower"
		switch {
		case p.GetLeader():
			role = "leader"
		case noLeader:
			role = "-" // the answering server knows no leader: nobody is a follower of one
		}
		t.row(p.GetId(), orDash(p.GetRaftAddress()), orDash(p.GetRpcAddress()), role, yesNo(p.GetVoter()))
	}
	if err := t.flush(); err != nil {
		return err
	}
	if noLeader {
		_, err := fmt.Fprintln(w, "no leader known: 'gpupool operator members' shows which servers answer")
		return err
	}
	return nil
}

func newRaftRemovePeerCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "remove-peer SERVER_ID",
		Short: "Remove a broker server from the Raft configuration",
		Long: `Remove-peer takes a server out of the Raft configuration, typically one that
died for good, so the rest can keep a quorum. The server ID is the one
'gpupool operator raft peers' shows.`,
		Example: `  gpupool operator raft remove-peer broker-3`,
		Args:    exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.RemovePeer(ctx, &gpupoolv1.RemovePeerRequest{Id: args[0]})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					_, err := fmt.Fprintf(w, "removed %s from the raft configuration\n", args[0])
					return err
				})
			})
		},
	}
}

func newRaftTransferLeadershipCmd() *cobra.Command {
	var to string
	cmd := &cobra.Command{
		Use:   "transfer-leadership [--to SERVER_ID]",
		Short: "Move Raft leadership to another broker server",
		Long: `Transfer-leadership asks the leader to hand over to --to, or, without it, to
the most up-to-date follower, e.g. before restarting the leader's machine.`,
		Example: `  gpupool operator raft transfer-leadership
  gpupool operator raft transfer-leadership --to broker-2`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cmd.Flags().Changed("to") && strings.TrimSpace(to) == "" {
				return usagef("--to is empty: give a server ID from 'gpupool operator raft peers', or leave --to out to let raft choose")
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				resp, err := c.Operator.TransferLeadership(ctx, &gpupoolv1.TransferLeadershipRequest{ToId: to})
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					msg := "leadership moved to " + resp.GetLeaderId()
					if resp.GetLeaderId() == "" {
						msg = "leadership transfer started; see 'gpupool operator raft peers' for the new leader"
					}
					_, err := fmt.Fprintln(w, msg)
					return err
				})
			})
		},
	}
	cmd.Flags().StringVar(&to, "to", "", "server ID of the new leader (default: the most up-to-date follower)")
	return cmd
}

// checkSnapshotTarget checks up front that path can become a file.
func checkSnapshotTarget(path string) error {
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return usagef("FILE %q is a directory: name the snapshot file to write, e.g. %s", path, filepath.Join(path, "gpupool.snap"))
	}
	dir := filepath.Dir(path)
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return usagef("FILE %q: directory %q does not exist", path, dir)
	}
	return nil
}

// snapshotSaved is what 'snapshot save -o json' prints.
type snapshotSaved struct {
	File  string `json:"file"`
	Bytes int64  `json:"bytes"`
	Index uint64 `json:"index,omitempty"`
}

func newSnapshotSaveCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "save FILE",
		Short: "Save a snapshot of the whole cluster state to FILE",
		Long: `Save streams a point-in-time snapshot of the replicated state into FILE. The
file appears only once complete (written to a temporary file beside it, then
renamed), so an interrupted save never leaves a truncated snapshot behind.
Raise --timeout for a large state.`,
		Example: `  gpupool operator snapshot save backup.snap
  gpupool operator snapshot save /var/backups/gpupool-$(date +%F).snap --timeout 5m`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := args[0]
			if err := checkSnapshotTarget(path); err != nil {
				return err
			}
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				n, index, err := c.SaveSnapshot(ctx, path)
				if err != nil {
					return err
				}
				saved := snapshotSaved{File: path, Bytes: n, Index: index}
				return printSnapshotSaved(cmd.OutOrStdout(), saved)
			})
		},
	}
}

func printSnapshotSaved(w io.Writer, s snapshotSaved) error {
	if global.output == "json" {
		b, err := json.MarshalIndent(s, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(w, string(b))
		return err
	}
	line := fmt.Sprintf("saved %d bytes to %s", s.Bytes, s.File)
	if s.Index != 0 {
		line += fmt.Sprintf(" (raft index %d)", s.Index)
	}
	_, err := fmt.Fprintln(w, line)
	return err
}

// stdinIsTerminal reports whether r is an interactive terminal, where a
// prompt can be answered. Tests replace it.
var stdinIsTerminal = func(r io.Reader) bool {
	f, ok := r.(*os.File)
	return ok && (isatty.IsTerminal(f.Fd()) || isatty.IsCygwinTerminal(f.Fd()))
}

// confirm asks question on out and reads the answer from in: true only
// for y or yes.
func confirm(in io.Reader, out io.Writer, question string) (bool, error) {
	fmt.Fprintf(out, "%s [y/N]: ", question)
	line, err := bufio.NewReader(in).ReadString('\n')
	if err != nil && err != io.EOF {
		return false, err
	}
	switch strings.ToLower(strings.TrimSpace(line)) {
	case "y", "yes":
		return true, nil
	}
	return false, nil
}

func newSnapshotRestoreCmd() *cobra.Command {
	var yes bool
	cmd := &cobra.Command{
		Use:   "restore FILE [--yes]",
		Short: "Replace the whole cluster state with a saved snapshot",
		Long: `Restore replaces the whole replicated state (hosts, devices, leases, quotas)
with the snapshot in FILE, on every broker. Everything that happened since
the snapshot was saved is lost: leases granted since are forgotten.

Restore asks for confirmation on the terminal; give --yes to skip the
question (required when stdin is not a terminal, e.g. in scripts).`,
		Example: `  gpupool operator snapshot restore backup.snap
  gpupool operator snapshot restore backup.snap --yes`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			path := args[0]
			if err := checkOutput(); err != nil {
				return err
			}
			fi, err := os.Stat(path)
			if err != nil {
				var pe *os.PathError
				if errors.As(err, &pe) {
					err = pe.Err
				}
				return usagef("FILE %q: %v; name a snapshot file written by 'gpupool operator snapshot save'", path, err)
			}
			if fi.IsDir() {
				return usagef("FILE %q is a directory: name a snapshot file written by 'gpupool operator snapshot save'", path)
			}
			if !yes {
				if !stdinIsTerminal(cmd.InOrStdin()) {
					return usagef("restore replaces the whole cluster state and needs confirmation: stdin is not a terminal, so pass --yes")
				}
				ok, err := confirm(cmd.InOrStdin(), cmd.ErrOrStderr(), fmt.Sprintf(
					"Replace the whole cluster state with %s (%d bytes)? Everything since the snapshot is lost.", path, fi.Size()))
				if err != nil {
					return err
				}
				if !ok {
					return errors.New("restore cancelled; the cluster state is unchanged")
				}
			}
			f, err := os.Open(path)
			if err != nil {
				return err
			}
			defer f.Close()
			return withClient(cmd, func(ctx context.Context, c *client.Client) error {
				n, resp, err := c.RestoreSnapshot(ctx, f)
				if err != nil {
					return err
				}
				return render(cmd.OutOrStdout(), resp, func(w io.Writer) error {
					_, err := fmt.Fprintf(w, "restored %s (%d bytes): the cluster state is now at raft index %d\n", path, n, resp.GetIndex())
					return err
				})
			})
		},
	}
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "restore without asking for confirmation")
	return cmd
}
