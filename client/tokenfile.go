package client

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"

	"github.com/gpupool/gpupool/internal/atomicfile"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// TokenFileEnv is the environment variable FromEnv reads: the path of a
// token file. Containers with a gpupool ResourceClaim have it set to
// /var/run/gpupool/token.json.
const TokenFileEnv = "GPUPOOL_TOKEN_FILE"

// TokenFileVersion is the format WriteTokenFile writes, and the only one
// ReadTokenFile reads.
const TokenFileVersion = 1

// maxTokenFileSize bounds what ReadTokenFile reads; a claim's file is a
// few KiB.
const maxTokenFileSize = 1 << 20

var (
	// ErrNoTokenFile is what FromEnv returns when TokenFileEnv is unset.
	ErrNoTokenFile = errors.New(TokenFileEnv + " is not set: it names the token file of a gpupool ResourceClaim inside a pod that has one")
	// ErrBadTokenFile is wrapped by the errors of token files that exist
	// but cannot be used: not JSON, another version, missing leases or
	// tokens.
	ErrBadTokenFile = errors.New("bad token file")
)

// TokenFile lets a process use leases that another process holds and
// renews: it has the lease ids and the current token of each of their
// hosts. The Kubernetes node plugin writes one per ResourceClaim and
// rewrites it after every renewal; FileLease reads it. On disk it is JSON
// with the .proto field names of HostToken:
//
//	{"version": 1, "leases": [{"lease_id": "l-5f0c2a9e1b7d3c48", "memory_mib": 8192, "compute_percent": 25,
//	  "tokens": [{"host": "h1", "token": "gpt1.…", "address": "10.0.0.7:7650", "cert_sha256": "9f86…"}]}]}
type TokenFile struct {
	// Version is TokenFileVersion.
	Version int `json:"version"`
	// Leases holds at least one lease, each id once; a claim's are in the
	// order of its allocated devices.
	Leases []TokenFileLease `json:"leases"`
}

// TokenFileLease is one lease of a TokenFile.
type TokenFileLease struct {
	LeaseID string `json:"lease_id"`
	// MemoryMiB and ComputePercent are the lease's slice of each of its
	// GPUs; 0 when the writer did not say.
	MemoryMiB      int64 `json:"memory_mib,omitempty"`
	ComputePercent int32 `json:"compute_percent,omitempty"`
	// Tokens holds the current token of each host of the lease, at least
	// one and each host once, the host of its first slice first.
	Tokens []*gpupoolv1.HostToken `json:"tokens"`
}

// badTokenFile is an ErrBadTokenFile that says which file and why.
type badTokenFile struct{ path, why string }

func (e *badTokenFile) Error() string        { return fmt.Sprintf("token file %s: %s", e.path, e.why) }
func (e *badTokenFile) Is(target error) bool { return target == ErrBadTokenFile }

// ReadTokenFile reads and checks the token file at path. Its errors name
// the file; those of a file that exists but cannot be used wrap
// ErrBadTokenFile and say what is wrong.
func ReadTokenFile(path string) (*TokenFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("token file %s: %w", path, pathErrorReason(err))
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxTokenFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("token file %s: %w", path, pathErrorReason(err))
	}
	tf, why := parseTokenFile(data)
	if why != "" {
		return nil, &badTokenFile{path: path, why: why}
	}
	return tf, nil
}

// pathErrorReason drops the operation and path from an *fs.PathError,
// which the caller names itself; errors.Is still sees the cause.
func pathErrorReason(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	return err
}

// parseTokenFile decodes and checks a token file; why says what is wrong.
func parseTokenFile(data []byte) (tf *TokenFile, why string) {
	switch {
	case len(data) > maxTokenFileSize:
		return nil, fmt.Sprintf("larger than %d bytes: not a token file", maxTokenFileSize)
	case len(bytes.TrimSpace(data)) == 0:
		return nil, "empty"
	}
	tf = &TokenFile{}
	if err := json.Unmarshal(data, tf); err != nil {
		var syntax *json.SyntaxError
		if errors.As(err, &syntax) || errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, fmt.Sprintf("not valid JSON (truncated?): %v", err)
		}
		return nil, fmt.Sprintf("not a token file: %v", err)
	}
	if why := tf.check(); why != "" {
		return nil, why
	}
	return tf, ""
}

// check says what is wrong with tf, or "".
func (tf *TokenFile) check() string {
	switch {
	case tf.Version == 0:
		return "no version: not a gpupool token file"
	case tf.Version != TokenFileVersion:
		return fmt.Sprintf("version %d: this gpupool reads version %d only", tf.Version, TokenFileVersion)
	case len(tf.Leases) == 0:
		return "holds no lease"
	}
	ids := map[string]bool{}
	for i, l := range tf.Leases {
		switch {
		case l.LeaseID == "":
			return fmt.Sprintf("lease %d of %d has no lease_id", i+1, len(tf.Leases))
		case ids[l.LeaseID]:
			return fmt.Sprintf("lease %s is listed twice", l.LeaseID)
		case len(l.Tokens) == 0:
			return fmt.Sprintf("lease %s has no tokens", l.LeaseID)
		}
		ids[l.LeaseID] = true
		hosts := map[string]bool{}
		for j, t := range l.Tokens {
			switch {
			case t == nil || t.Host == "":
				return fmt.Sprintf("lease %s: token %d of %d has no host", l.LeaseID, j+1, len(l.Tokens))
			case hosts[t.Host]:
				return fmt.Sprintf("lease %s: host %s is listed twice", l.LeaseID, t.Host)
			case t.Token == "":
				return fmt.Sprintf("lease %s: host %s has no token", l.LeaseID, t.Host)
			}
			hosts[t.Host] = true
		}
	}
	return ""
}

// lease returns the lease id of tf, or its first lease for "".
func (tf *TokenFile) lease(id string) (*TokenFileLease, bool) {
	for i := range tf.Leases {
		if id == "" || tf.Leases[i].LeaseID == id {
			return &tf.Leases[i], true
		}
	}
	return nil, false
}

// WriteTokenFile replaces the token file at path with tf, atomically:
// a reader sees the old file or the new one, never a mix. The file gets
// version TokenFileVersion whatever tf.Version says, and mode 0644, so
// that a container's non-root user can read it: keep it in a directory
// only its reader can reach. A tf that ReadTokenFile would refuse is not
// written.
func WriteTokenFile(path string, tf *TokenFile) error {
	out := *tf
	out.Version = TokenFileVersion
	if why := out.check(); why != "" {
		return &badTokenFile{path: path, why: why}
	}
	data, err := json.MarshalIndent(&out, "", "  ")
	if err != nil {
		return fmt.Errorf("token file %s: %w", path, err)
	}
	if err := atomicfile.WriteMode(path, append(data, '\n'), 0o644); err != nil {
		return fmt.Errorf("token file %s: %w", path, pathErrorReason(err))
	}
	return nil
}

// FileLease is a lease used through a token file that another process
// holds and renews, such as the node plugin for a container with a
// gpupool ResourceClaim. It talks to the lease's agents only, never to
// the brokers: it cannot renew, release or describe the lease. Its
// data-plane calls (Dial, Exec, Put, Get, Forward, Usage) read the file
// again for the current token, so they keep working as the file is
// rewritten. It is safe for concurrent use.
type FileLease struct {
	sessions
	path string
	id   string
}

// FromEnv returns the first lease of the token file TokenFileEnv names:
// inside a pod, the first device of its gpupool ResourceClaim. Without the
// variable it returns ErrNoTokenFile.
func FromEnv() (*FileLease, error) {
	path := os.Getenv(TokenFileEnv)
	if path == "" {
		return nil, ErrNoTokenFile
	}
	return OpenTokenFile(path, "")
}

// OpenTokenFile returns the lease leaseID of the token file at path, or
// its first lease for "". It reads the file once to check it.
func OpenTokenFile(path, leaseID string) (*FileLease, error) {
	tf, err := ReadTokenFile(path)
	if err != nil {
		return nil, err
	}
	l, ok := tf.lease(leaseID)
	if !ok {
		return nil, fmt.Errorf("token file %s has no lease %s", path, leaseID)
	}
	fl := &FileLease{path: path, id: l.LeaseID}
	fl.sessions.src = fl
	return fl, nil
}

// ID is the lease's id.
func (f *FileLease) ID() string { return f.id }

// Path is the token file's path.
func (f *FileLease) Path() string { return f.path }

// Close closes the session of the lease's own calls (Exec, Put, ...);
// sessions returned by Dial stay open.
func (f *FileLease) Close() { f.closeSessions() }

func (f *FileLease) leaseID() string { return f.id }

func (f *FileLease) hostToken(host string) (*gpupoolv1.HostToken, error) {
	tf, err := ReadTokenFile(f.path)
	if err != nil {
		return nil, err
	}
	l, ok := tf.lease(f.id)
	if !ok {
		return nil, fmt.Errorf("token file %s no longer holds lease %s", f.path, f.id)
	}
	if host == "" {
		return l.Tokens[0], nil
	}
	for _, t := range l.Tokens {
		if t.Host == host {
			return t, nil
		}
	}
	return nil, fmt.Errorf("token file %s has no token of lease %s for host %s", f.path, f.id, host)
}
