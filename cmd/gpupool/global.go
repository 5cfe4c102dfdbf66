package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/gpupool/gpupool/client"
)

// globalOpts are the flags every client command shares.
type globalOpts struct {
	addr    string
	output  string
	timeout time.Duration
	connect time.Duration
	quiet   bool
	token   string
	// tokenFile holds the ACL token secret (--token-file, else
	// $GPUPOOL_ACL_TOKEN_FILE): unlike --token, it stays out of ps.
	tokenFile string
	tls       tlsOpts
}

var global globalOpts

func addGlobalFlags(root *cobra.Command) {
	def := os.Getenv("GPUPOOL_ADDR")
	if def == "" {
		def = strings.Join(client.DefaultAddrs, ",")
	}
	pf := root.PersistentFlags()
	pf.StringVar(&global.addr, "addr", def, "broker addresses, comma-separated (env GPUPOOL_ADDR)")
	pf.StringVarP(&global.output, "output", "o", "table", "output format: table, wide (lists: every slice instead of a count), json, or name (ids only, one a line)")
	pf.BoolVarP(&global.quiet, "quiet", "q", false, "print only ids, one a line (the same as -o name)")
	pf.DurationVar(&global.timeout, "timeout", 30*time.Second, "how long a whole call may take")
	pf.DurationVar(&global.connect, "connect-timeout", 5*time.Second, "how long to wait for a broker to answer and a leader to be known before failing with what happened to each broker (0: up to --timeout)")
	// The default is not the environment's: --help would print the secret.
	pf.StringVar(&global.token, "token", "", "ACL token secret sent to the brokers (default $GPUPOOL_TOKEN); prefer --token-file, which keeps it out of ps; see 'gpupool operator acl'")
	pf.StringVar(&global.tokenFile, "token-file", "", "read the ACL token secret from this file (default $GPUPOOL_ACL_TOKEN_FILE)")
	addTLSFlags(pf, &global.tls)
}

// globalToken is --token, else $GPUPOOL_TOKEN.
func globalToken() string {
	if global.token != "" {
		return global.token
	}
	return os.Getenv("GPUPOOL_TOKEN")
}

// checkOutput validates -o; commands call it before doing anything.
func checkOutput() error {
	if global.connect < 0 {
		return usagef("--connect-timeout %s: must be 0 or positive, e.g. 5s", global.connect)
	}
	switch global.output {
	case "table", "wide", "json", "name":
	default:
		return usagef("--output %q: must be table, wide, json or name", global.output)
	}
	if global.quiet {
		if global.output != "table" && global.output != "name" {
			return usagef("-q prints ids only: it cannot be combined with -o %s", global.output)
		}
		global.output = "name"
	}
	return nil
}

// dial connects to the brokers named by --addr, over mutual TLS when the
// --tls-* flags are given.
func dial() (*client.Client, error) {
	if err := checkOutput(); err != nil {
		return nil, err
	}
	addrs := client.ParseAddrs(global.addr)
	if len(addrs) == 0 {
		return nil, usagef("--addr is empty: give one or more broker addresses, e.g. 127.0.0.1:7641")
	}
	tc, err := global.tls.clientTLS(nil)
	if err != nil {
		return nil, err
	}
	token, err := clientToken()
	if err != nil {
		return nil, err
	}
	return client.DialWith(addrs, client.Options{TLS: tc, Token: token, ConnectTimeout: global.connect})
}

// clientToken is the ACL token a client command sends: read from
// --token-file (else $GPUPOOL_ACL_TOKEN_FILE), else --token (else
// $GPUPOOL_TOKEN). A file and a token together are a usage error.
func clientToken() (string, error) {
	file, flag := global.tokenFile, "--token-file"
	if file == "" {
		file, flag = os.Getenv("GPUPOOL_ACL_TOKEN_FILE"), "GPUPOOL_ACL_TOKEN_FILE"
	}
	if file == "" {
		return globalToken(), nil
	}
	if globalToken() != "" {
		return "", usagef("%s with --token (or GPUPOOL_TOKEN): give one or the other", flag)
	}
	b, err := os.ReadFile(file)
	if err != nil {
		return "", usagef("%s %v", flag, err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return "", usagef("%s %s: the file is empty; it must hold an ACL token secret", flag, file)
	}
	return tok, nil
}

// callCtx bounds one call by --timeout.
func callCtx(cmd *cobra.Command) (context.Context, context.CancelFunc) {
	return context.WithTimeout(cmd.Context(), global.timeout)
}

var jsonOpts = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true, Multiline: true, Indent: "  "}

// printJSON prints a protobuf message as protojson with the .proto field
// names (fencing_token, memory_mib), the names other tools rely on.
func printJSON(w io.Writer, m proto.Message) error {
	b, err := jsonOpts.Marshal(m)
	if err != nil {
		return err
	}
	// Re-indent through encoding/json so the output is stable: protojson
	// randomises whitespace on purpose.
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		return err
	}
	out, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	_, err = fmt.Fprintln(w, string(out))
	return err
}

// table writes aligned columns; call flush when done.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)}
	t.row(toAny(header)...)
	return t
}

func toAny(s []string) []any {
	out := make([]any, len(s))
	for i, v := range s {
		out[i] = v
	}
	return out
}

func (t *table) row(cols ...any) {
	for i, c := range cols {
		if i > 0 {
			fmt.Fprint(t.tw, "\t")
		}
		fmt.Fprint(t.tw, c)
	}
	fmt.Fprintln(t.tw)
}

func (t *table) flush() error { return t.tw.Flush() }
