// Package broker is the gpupool server. It owns the wiring of one broker:
// Raft (log and stable store in bbolt, snapshots, transport), the
// leader's memory (lease TTLs, host heartbeats, drain and preemption
// deadlines, who waits on a pending lease), the gRPC services and their
// forwarding to the leader, ACL tokens and TLS roles, and the signing of
// the tokens agents check. What it decides is delegated to packages with
// no Raft in them:
//
//   - broker/fsm applies commands to the state, deterministically, and
//     re-checks every grant and preemption;
//   - broker/state is the state store (go-memdb), whose objects are never
//     modified in place;
//   - broker/placement places one request on a view of free capacity;
//   - broker/planner plans a pass of the queue (order, backfill, victims,
//     reservations, elastic growth) as a pure function of a state
//     snapshot and that view, and explains why a pending lease waits;
//   - broker/lease holds the rules of a lease that do not depend on the
//     pool, builds every lease (lease.New), and the leader's timers.
//
// # Seams
//
// Every change of the state goes through a Proposer (propose.go): Propose
// sends a command to the log without waiting, and the Proposal's Wait
// returns its result once applied here. The server's Proposer is Raft;
// the package's tests wrap it in a double (faultyProposer) that fails
// chosen commands or holds them back, which is how faults are injected:
// the server has no field for them. The queue writes through a
// queueWriter over the same Proposer (proposePlan, landPlan), which its
// tests drive without Raft.
//
// Placement and the queue see free capacity through planner.Placer and
// planner.Pool, a copy-on-write view over the state's hosts: a decision
// copies only the hosts it changes.
//
// Errors meet gRPC codes in one place, errors.go: the domain code returns
// the kinds declared there (through refuse and refusef) or the typed
// errors of fsm, placement and lease, and the outermost interceptors map
// every error a call returns with toStatus. No other file builds a gRPC
// status (errors_boundary_test.go enforces it).
//
// # Components
//
// Server wires five components, each holding the others only through a
// small interface whose methods state their contracts:
//
//   - capacity (capacity.go, acquire.go, queue.go) decides what is placed
//     and granted: it owns placeMu, the placer, the grants in flight, the
//     overlay and the queue's writer; it reads the leader's memory
//     through leaderMemory and signs through tokenSigner;
//   - leadership (leader.go) keeps the leader's memory and runs its
//     duties (timers, reactions, collection, versions); it implements
//     leaderMemory and drives capacity through queueRunner, membership
//     through peerAddresses, signing through tokenSigner;
//   - membership (membership.go) knows the other servers: forming and
//     joining the cluster, re-addressing, the connections to the others;
//     it implements forwarder (every endpoint's way to the leader),
//     peerAddresses, leaderDialer and raftRole;
//   - signing (signing.go) holds the token signing keys and implements
//     tokenSigner;
//   - gatekeeper (gatekeeper.go) checks every call's ACL token, and
//     implements rechecker for the watch streams.
//
// All of them share one node (node.go): the config, the logger, the
// FSM, the Proposer and the server's lifetime. Every background
// goroutine starts through node.goFunc and ends once the lifetime's
// context is done; Shutdown cancels it and waits for them. The
// endpoints and the metrics collectors hold the components they use,
// never the Server.
//
// # The lock rule
//
// placeMu serialises every decision about capacity on the leader:
// Acquire's placement and the queue's passes. Both follow one rule:
//
//  1. Under placeMu, and only inside a decide function that takes and
//     releases it (decideAcquire, proposePass; deferred unlock, never an
//     unlock by hand), read a snapshot (the state, plus the grants in
//     flight), decide on it without side effects (placer.Place,
//     planner.Make), and record what the decision takes as in flight
//     (inflight: grants, extras, pending leases, room reserved by a
//     preemption), so the next decision places around it. The decision
//     is returned as a value (acquirePlan, sentPlan). The queue also
//     proposes its plan there (Proposer.Propose does not wait).
//  2. Without placeMu, act on the decision: propose what it took
//     (Acquire) and wait for the commits (Proposal.Wait), mark them done
//     in flight, arm the TTLs of what was granted and answer.
//  3. FSM Apply re-checks every grant (each slice still fits, the tenant's
//     quota) and every preemption: a decision made on a snapshot that has
//     changed since is refused, never applied twice.
//
// Nothing waits for a commit under placeMu, with one exception:
// inflight.drain waits for commands decided earlier (which land without
// placeMu) when a decision must read the state alone, such as a quota
// check or a pass of the queue. A grant stays in flight from its
// decision until its commit is known, so a decision sees each earlier
// one either in the state or in flight, whatever order they commit in.
// Lock order: placeMu before inflight's and the leader state's own
// mutexes; keysMu is never taken under placeMu.
package broker
