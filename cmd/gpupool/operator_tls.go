package main

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/internal/pki"
)

func newTLSCmd() *cobra.Command {
	return newGroupCmd(&cobra.Command{
		Use:   "tls",
		Short: "Create the cluster CA and issue certificates for brokers, agents and clients",
		Long: `Brokers, agents and clients talk over mutual TLS: each side presents a
certificate of the cluster CA and checks the other's. 'tls init' creates the CA
(keep its key offline: whoever holds it can join the cluster as anything);
'tls issue' issues one certificate and key per broker, agent and client.

A certificate carries its holder's role (broker, agent or client). Only brokers
may take part in Raft and in the servers' own calls; only agents and brokers may
register hosts. An agent certificate may be bound to one host id (--host-id).
Broker certificates name the addresses clients dial (--host).

To rotate a certificate, issue it again into the same files: brokers, agents
and the Kubernetes components read them again on the next connection, without
a restart. These commands work on files only; they never contact a broker.`,
		Example: `  gpupool operator tls init --dir /etc/gpupool/ca
  gpupool operator tls issue --ca-dir /etc/gpupool/ca --name broker-1 --role broker --host 10.0.0.1,broker-1.example
  gpupool operator tls issue --ca-dir /etc/gpupool/ca --name gpu-7 --role agent --host-id gpu-7
  gpupool operator tls issue --ca-dir /etc/gpupool/ca --name alice --role client --days 30`,
	},
		newTLSInitCmd(),
		newTLSIssueCmd(),
	)
}

func newTLSInitCmd() *cobra.Command {
	var (
		dir, alg, name string
		days           int
	)
	cmd := &cobra.Command{
		Use:   "init --dir DIR",
		Short: "Create the cluster CA: a certificate and its key in DIR",
		Long: `Create a new certificate authority for one gpupool cluster: DIR/` + pki.CACertFile + ` (give it
to every broker, agent and client as --tls-ca) and DIR/` + pki.CAKeyFile + ` (mode 0600; only
'tls issue' needs it). It refuses to overwrite an existing CA.`,
		Example: `  gpupool operator tls init --dir /etc/gpupool/ca
  gpupool operator tls init --dir ./ca --algorithm ed25519 --days 1825`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" {
				return usagef("--dir is required: the directory for the CA's certificate and key")
			}
			a, err := pki.ParseAlgorithm(alg)
			if err != nil {
				return usagef("--algorithm %v", err)
			}
			if days < 1 || days > 100*365 {
				return usagef("--days %d: must be between 1 and %d", days, 100*365)
			}
			ca, err := pki.InitCA(dir, a, name, time.Now(), time.Duration(days)*24*time.Hour)
			if errors.Is(err, pki.ErrCAExists) {
				return usagef("--dir %v", err)
			}
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "created CA %q (%s), valid until %s\n", name, a, ca.Cert.NotAfter.Format(time.RFC3339))
			fmt.Fprintf(out, "  certificate  %s   give it to everyone as --tls-ca\n", filepath.Join(dir, pki.CACertFile))
			fmt.Fprintf(out, "  key          %s   keep it offline; only 'tls issue' needs it\n", filepath.Join(dir, pki.CAKeyFile))
			fmt.Fprintf(out, "next: gpupool operator tls issue --ca-dir %s --name broker-1 --role broker --host ADDRESS\n", dir)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&dir, "dir", "", "directory for the CA (created 0700 if missing)")
	f.StringVar(&alg, "algorithm", string(pki.ECDSAP256), "key type of the CA and of the certificates it issues: "+algorithmNames())
	f.StringVar(&name, "name", "gpupool cluster CA", "the CA's common name")
	f.IntVar(&days, "days", int(pki.DefaultCAValidity/(24*time.Hour)), "how many days the CA is valid")
	return cmd
}

func algorithmNames() string {
	names := make([]string, len(pki.Algorithms))
	for i, a := range pki.Algorithms {
		names[i] = string(a)
	}
	return strings.Join(names, ", ")
}

func newTLSIssueCmd() *cobra.Command {
	var (
		caDir, outDir, name, role, hostID string
		hosts                             []string
		days                              int
	)
	cmd := &cobra.Command{
		Use:   "issue --ca-dir DIR --name NAME --role broker|agent|client [--host ADDR,...] [--host-id ID] [--days N]",
		Short: "Issue a certificate and key for a broker, an agent or a client",
		Long: `Issue a certificate signed by the CA in --ca-dir and write it with its new key
to --out (default: --ca-dir) as NAME.pem and NAME-key.pem (mode 0600).

--role broker: a broker server. It serves and dials (server and client
authentication), and needs --host: every IP address and DNS name clients and
agents dial it at. Brokers check each other by role, not by address.
--role agent: the agent of a pool host; --host-id binds the certificate to that
host id (the agent then defaults --host-id to it and refuses another).
--role client: the CLI, the SDK, the Kubernetes controller and node plugin.

Issuing again into the same files rotates the certificate: running brokers,
agents and Kubernetes components use the new one from their next connection.`,
		Example: `  gpupool operator tls issue --ca-dir ca --name broker-1 --role broker --host 10.0.0.1,broker-1.example
  gpupool operator tls issue --ca-dir ca --name gpu-7 --role agent --host-id gpu-7
  gpupool operator tls issue --ca-dir ca --name alice --role client --days 30 --out ~/.gpupool`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if caDir == "" {
				return usagef("--ca-dir is required: the directory 'gpupool operator tls init' created")
			}
			if name == "" {
				return usagef("--name is required: it names the certificate and its files, e.g. broker-1")
			}
			if err := pki.CheckName(name); err != nil {
				return usagef("--name %v", err)
			}
			r, err := pki.ParseRole(role)
			if err != nil {
				return usagef("--role %v", err)
			}
			if days < 1 {
				return usagef("--days %d: must be 1 or more", days)
			}
			ca, err := pki.LoadCA(caDir)
			if errors.Is(err, pki.ErrNoCA) {
				return usagef("--ca-dir %v", err)
			}
			if err != nil {
				return err
			}
			now := time.Now()
			req := pki.Request{Name: name, Role: r, Hosts: hosts, HostID: hostID,
				NotBefore: now.Add(-5 * time.Minute), NotAfter: now.Add(time.Duration(days) * 24 * time.Hour)}
			if req.NotAfter.After(ca.Cert.NotAfter) {
				return usagef("--days %d: the certificate would outlive the CA, which expires %s (%d days from now)",
					days, ca.Cert.NotAfter.Format(time.RFC3339), int(time.Until(ca.Cert.NotAfter)/(24*time.Hour)))
			}
			if err := ca.Validate(req); err != nil {
				return usagef("--%v", err)
			}
			certPEM, keyPEM, err := ca.Issue(req)
			if err != nil {
				return err
			}
			if outDir == "" {
				outDir = caDir
			}
			certPath, keyPath, err := pki.WriteKeyPair(outDir, name, certPEM, keyPEM)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			what := string(r)
			if len(hosts) > 0 {
				what += " at " + strings.Join(hosts, ", ")
			}
			if hostID != "" {
				what += " bound to host " + hostID
			}
			fmt.Fprintf(out, "issued %q (%s), valid until %s\n", name, what, req.NotAfter.Format(time.RFC3339))
			fmt.Fprintf(out, "  --tls-ca %s --tls-cert %s --tls-key %s\n", filepath.Join(caDir, pki.CACertFile), certPath, keyPath)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&caDir, "ca-dir", "", "directory of the CA ('gpupool operator tls init --dir')")
	f.StringVar(&outDir, "out", "", "directory for NAME.pem and NAME-key.pem (default: --ca-dir)")
	f.StringVar(&name, "name", "", "the certificate's common name and file name, e.g. broker-1")
	f.StringVar(&role, "role", "", "what the holder is: broker, agent or client")
	f.StringSliceVar(&hosts, "host", nil, "brokers only: IP addresses and DNS names clients dial, comma-separated or repeated")
	f.StringVar(&hostID, "host-id", "", "agents only: bind the certificate to this host id")
	f.IntVar(&days, "days", int(pki.DefaultCertValidity/(24*time.Hour)), "how many days the certificate is valid")
	return cmd
}
