// Package protocol is the one owner of the lease protocol's rules: what a
// request may ask (Validate and friends, returning a *FieldError that names
// the field), every limit and default (TTL, wait, counts, holder and
// request-id length, drain deadline, default tenant), and the constants
// both ends of the wire agree on (the leader header, reconnect timings).
//
// The broker, the Go SDK (client), the Kubernetes driver (k8s) and the CLI
// import it; it imports only the generated protobuf types, so it sits
// below all of them. A rule changes here once: the broker enforces it, and
// the CLI reports each *FieldError under the flag that sets the field
// (FieldError.Field is the request field's name, as in the .proto).
package protocol
