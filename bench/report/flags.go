package report

import (
	"errors"
	"flag"
	"fmt"
	"io"
)

// NewFlags returns the flag set of benchmark name. It prints nothing:
// ParseFlags returns its errors and prints the usage on --help.
func NewFlags(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("bench/"+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	return fs
}

// ParseFlags parses args, which must all be flags, into fs. On --help it
// writes the usage (head, then PrintFlags) to help and returns
// flag.ErrHelp.
func ParseFlags(fs *flag.FlagSet, args []string, head string, help io.Writer) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(help, head)
			PrintFlags(help, fs)
		}
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected argument %q: this command takes only flags", fs.Arg(0))
	}
	return nil
}

// PrintFlags writes each flag of fs as the usage shows it:
// "  --NAME ARG", then its description and default on the next line.
func PrintFlags(w io.Writer, fs *flag.FlagSet) {
	fs.VisitAll(func(f *flag.Flag) {
		arg, usage := flag.UnquoteUsage(f)
		def := ""
		if f.DefValue != "" {
			def = fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(w, "  --%s %s\n    \t%s%s\n", f.Name, arg, usage, def)
	})
}

// UsageExit is the exit code of a benchmark whose command line failed
// ParseFlags or its own checks with err: 0 after --help (the usage is
// printed), else 2, with "bench/NAME: err" and a pointer to --help on
// stderr.
func UsageExit(stderr io.Writer, name string, err error) int {
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	fmt.Fprintf(stderr, "bench/%s: %v\nRun with --help for the usage.\n", name, err)
	return 2
}

// Fail is the exit code of a benchmark that failed with err: 1, with
// "bench/NAME: err" on stderr.
func Fail(stderr io.Writer, name string, err error) int {
	fmt.Fprintf(stderr, "bench/%s: %v\n", name, err)
	return 1
}
