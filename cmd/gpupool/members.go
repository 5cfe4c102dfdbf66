package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/client"
	"github.com/gpupool/gpupool/internal/version"
)

func newMembersCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "members",
		Short: "List every broker server, reachable or not, with its role, term, last contact and version",
		Long: `Members asks each broker of --addr, and every server of the Raft
configuration they name, about itself: whether it answers (or why not:
refused, TLS failure, timeout), its Raft role and term, how long since it
last heard from the leader, and its version. It needs no leader and no ACL
token, so it is the command to run when the cluster does not answer: it
shows which brokers are down and whether a majority is left. A version that
differs from the others is flagged with '*' (and "mismatch": true in JSON).

It exits 1 when fewer than a majority of the servers answer.`,
		Example: `  gpupool operator members
  gpupool operator members -o json
  gpupool operator members -q          # the ids of the servers`,
		Args: exactArgs(0),
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := dial()
			if err != nil {
				return err
			}
			defer c.Close()
			ctx, cancel := context.WithTimeout(cmd.Context(), min(global.timeout, max(global.connect, 2*time.Second)))
			defer cancel()
			ms, err := c.Members(ctx)
			if err != nil && len(ms) == 0 {
				return err
			}
			if err := printMembers(cmd.OutOrStdout(), ms); err != nil {
				return err
			}
			voters, up := 0, 0
			for _, m := range ms {
				if m.Voter {
					voters++
					if m.Outcome.Reachable() {
						up++
					}
				}
			}
			if voters == 0 {
				return fmt.Errorf("no broker reachable")
			}
			if up < voters/2+1 {
				return fmt.Errorf("lost quorum: %d of %d brokers reachable; a majority (%d) is needed", up, voters, voters/2+1)
			}
			return nil
		},
	}
}

// memberJSON is one member in -o json.
type memberJSON struct {
	ID            string `json:"id"`
	Address       string `json:"address"`
	RaftAddress   string `json:"raft_address,omitempty"`
	Voter         bool   `json:"voter"`
	Reachable     bool   `json:"reachable"`
	Status        string `json:"status"`
	Error         string `json:"error,omitempty"`
	Role          string `json:"role,omitempty"`
	Term          uint64 `json:"term,omitempty"`
	Leader        string `json:"leader,omitempty"`
	LastContactMs int64  `json:"last_contact_ms"`
	Version       string `json:"version,omitempty"`
	Mismatch      bool   `json:"version_mismatch"`
}

func printMembers(w io.Writer, ms []client.Member) error {
	var vs []string
	for _, m := range ms {
		if m.Version != "" {
			vs = append(vs, m.Version)
		}
	}
	odd := versionOutliers(vs)
	switch global.output {
	case "json":
		out := make([]memberJSON, 0, len(ms))
		for _, m := range ms {
			out = append(out, memberJSON{
				ID: m.ID, Address: m.Addr, RaftAddress: m.RaftAddr, Voter: m.Voter, Reachable: m.Outcome.Reachable(),
				Status: string(m.Outcome), Error: m.Detail, Role: m.Role, Term: m.Term, Leader: m.LeaderID,
				LastContactMs: m.LastContact.Milliseconds(), Version: m.Version, Mismatch: odd[m.Version],
			})
		}
		b, err := json.MarshalIndent(map[string]any{"members": out}, "", "  ")
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(w, string(b))
		return err
	case "name":
		for _, m := range ms {
			fmt.Fprintln(w, orDash(m.ID))
		}
		return nil
	}
	if len(ms) == 0 {
		_, err := fmt.Fprintln(w, "no brokers")
		return err
	}
	t := newTable(w, "ID", "ADDRESS", "STATUS", "ROLE", "TERM", "LEADER", "LAST CONTACT", "VOTER", "VERSION")
	for _, m := range ms {
		status := string(m.Outcome)
		if m.Detail != "" && !m.Outcome.Reachable() {
			status += ": " + m.Detail
		}
		role, term, leader, contact, ver := "-", "-", "-", "-", orDash(m.Version)
		if m.Outcome.Reachable() {
			role, term, leader = m.Role, fmt.Sprint(m.Term), orDash(m.LeaderID)
			switch {
			case m.Role == "leader":
				contact = "-"
			case m.LastContact < 0:
				contact = "never"
			default:
				contact = humanDuration(m.LastContact) + " ago"
			}
		}
		if odd[m.Version] {
			ver += " *"
		}
		t.row(orDash(m.ID), orDash(m.Addr), status, role, term, leader, contact, yesNo(m.Voter), ver)
	}
	if err := t.flush(); err != nil {
		return err
	}
	if len(odd) > 0 {
		fmt.Fprintf(w, "* version differs from the others (this client: %s)\n", version.Get().Version)
	}
	return nil
}

// versionOutliers returns the versions that differ from the most common
// one; none when all agree.
func versionOutliers(vs []string) map[string]bool {
	count := map[string]int{}
	for _, v := range vs {
		count[v]++
	}
	if len(count) < 2 {
		return nil
	}
	top, n := "", -1
	for v, c := range count {
		if c > n || (c == n && v > top) {
			top, n = v, c
		}
	}
	out := map[string]bool{}
	for v := range count {
		if v != top {
			out[v] = true
		}
	}
	return out
}
