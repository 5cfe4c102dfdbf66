package main

import (
	"encoding/json"
	"fmt"

	"github.com/spf13/cobra"

	"github.com/gpupool/gpupool/internal/version"
)

func newVersionCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version, commit and Go version this binary was built from",
		Long: `Version prints this binary's build: the version and commit 'make build'
stamped from git, and the Go release that compiled it. 'gpupool --version'
prints the same on one line. 'gpupool operator members' and 'gpupool host ls'
show the versions of the brokers and agents.`,
		Example: `  gpupool version
  gpupool version -o json
  gpupool --version`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(); err != nil {
				return err
			}
			in := version.Get()
			if global.output == "json" {
				b, _ := json.MarshalIndent(in, "", "  ")
				_, err := fmt.Fprintln(cmd.OutOrStdout(), string(b))
				return err
			}
			t := newTable(cmd.OutOrStdout(), "VERSION", in.Version)
			t.row("COMMIT", orDash(in.Commit))
			t.row("GO", in.GoVersion)
			return t.flush()
		},
	}
}
