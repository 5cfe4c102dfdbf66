package main

import (
	"crypto/tls"
	"fmt"
	"io"
	"log/slog"
	"os"

	"github.com/spf13/pflag"

	"github.com/gpupool/gpupool/internal/pki"
)

// tlsOpts are the certificate files every component that talks to the
// brokers takes, as global flags.
type tlsOpts struct {
	ca, cert, key string
}

// Environment variables that default the TLS flags.
const (
	envTLSCA   = "GPUPOOL_TLS_CA"
	envTLSCert = "GPUPOOL_TLS_CERT"
	envTLSKey  = "GPUPOOL_TLS_KEY"
)

func addTLSFlags(pf *pflag.FlagSet, o *tlsOpts) {
	pf.StringVar(&o.ca, "tls-ca", os.Getenv(envTLSCA), "PEM file of the cluster CA to trust (env "+envTLSCA+"); with --tls-cert and --tls-key, talk to the brokers over mutual TLS")
	pf.StringVar(&o.cert, "tls-cert", os.Getenv(envTLSCert), "PEM certificate issued by 'gpupool operator tls issue' (env "+envTLSCert+"); reloaded when the file changes")
	pf.StringVar(&o.key, "tls-key", os.Getenv(envTLSKey), "PEM private key of --tls-cert (env "+envTLSKey+")")
}

func (o tlsOpts) set() bool { return o.ca != "" || o.cert != "" || o.key != "" }

// source loads the files, or returns nil when no TLS flag is set. Half a
// set, or files that cannot be used, are usage errors naming the flag.
func (o tlsOpts) source(logger *slog.Logger) (*pki.Source, error) {
	if !o.set() {
		return nil, nil
	}
	for _, f := range []struct{ flag, env, v string }{
		{"tls-ca", envTLSCA, o.ca}, {"tls-cert", envTLSCert, o.cert}, {"tls-key", envTLSKey, o.key},
	} {
		if f.v == "" {
			return nil, usagef("--%s is missing: TLS needs all of --tls-ca, --tls-cert and --tls-key (or %s, %s, %s)", f.flag, envTLSCA, envTLSCert, envTLSKey)
		}
	}
	src, err := pki.NewSource(pki.Files{CA: o.ca, Cert: o.cert, Key: o.key}, logger)
	if err != nil {
		return nil, usagef("--%v", err)
	}
	return src, nil
}

// clientTLS is the TLS configuration of a client command, or nil for
// plaintext when no TLS flag is given.
func (o tlsOpts) clientTLS(logger *slog.Logger) (*tls.Config, error) {
	src, err := o.source(logger)
	if err != nil {
		return nil, err
	}
	return tlsConfigOf(src), nil
}

// serverTLS is the certificate source of a broker or agent: what serves
// it must hold role. Without TLS files it needs --insecure, and then says
// loudly, once, what that means.
func (o tlsOpts) serverTLS(what string, role pki.Role, insecure bool, logger *slog.Logger, stderr io.Writer) (*pki.Source, error) {
	if insecure && o.set() {
		return nil, usagef("--insecure and --tls-ca/--tls-cert/--tls-key (or %s, %s, %s) contradict each other: drop one", envTLSCA, envTLSCert, envTLSKey)
	}
	src, err := o.source(logger)
	if err != nil {
		return nil, err
	}
	switch {
	case insecure && os.Getenv(devChildEnv) != "":
		return nil, nil // gpupool dev's banner has said it for all its children
	case insecure:
		fmt.Fprintf(stderr, "WARNING: %s runs with --insecure: no TLS and no authentication; anyone who can reach its ports is trusted. Only for tests and local experiments.\n", what)
		return nil, nil
	case src == nil:
		return nil, usagef("%s needs TLS: pass --tls-ca, --tls-cert and --tls-key (or %s, %s, %s) with files made by 'gpupool operator tls init' and 'gpupool operator tls issue --role %s'; or --insecure to run without TLS and authentication (tests and local experiments only)",
			what, envTLSCA, envTLSCert, envTLSKey, role)
	}
	if id := src.Identity(); id.Role != role {
		return nil, usagef("--tls-cert %s is a %s certificate (%q); %s needs one issued with 'gpupool operator tls issue --role %s'", o.cert, id.Role, id.Name, what, role)
	}
	return src, nil
}

// devChildEnv marks the brokers and agents that 'gpupool dev' starts.
const devChildEnv = "GPUPOOL_DEV"

// insecureUsage is the help of --insecure on the broker and the agent.
const insecureUsage = "run without TLS and without authentication: every caller is trusted. Only for tests and local experiments; prints a warning"

// tlsConfigOf is src's client configuration, or nil (plaintext) for none.
func tlsConfigOf(src *pki.Source) *tls.Config {
	if src == nil {
		return nil
	}
	return src.ClientConfig()
}
