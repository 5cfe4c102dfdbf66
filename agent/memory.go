package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/gpupool/gpupool/internal/atomicfile"
	gpupoolv1 "github.com/gpupool/gpupool/proto/gpupool/v1"
)

// What the agent remembers across restarts, besides its leases (one file
// each, leasefile.go): the GPUs it found unhealthy, and the watchdog
// events the brokers have not acknowledged. Both live in one file of the
// data dir, memoryFile, rewritten atomically whenever they change, and
// read back before the agent registers.
//
// A GPU marked unhealthy stays unhealthy across restarts until
// Config.HealthyAfter has passed since its last critical event, or an
// operator clears it ('gpupool host gpu-health HOST GPU --clear', which
// reaches the agent in a heartbeat response: clearHealth).

// memoryFile is the file, in the data dir, that holds the agent's memory.
const memoryFile = "memory.json"

// DefaultHealthyAfter is how long after its last critical event an
// unhealthy GPU counts as healthy again.
const DefaultHealthyAfter = 24 * time.Hour

// memory is memoryFile's content. Its JSON names are part of the data
// dir's format: add fields, never rename them.
type memory struct {
	// Unhealthy is uuid → why and when; the uuid "" stands for every GPU
	// (all lost).
	Unhealthy map[string]sickness `json:"unhealthy,omitempty"`
	Events    []memoryEvent       `json:"events,omitempty"`
	LastSeq   uint64              `json:"last_seq,omitempty"`
}

type sickness struct {
	Reason string `json:"reason"`
	AtMs   int64  `json:"at_ms"`
}

type memoryEvent struct {
	Seq     uint64 `json:"seq"`
	Type    int32  `json:"type"`
	LeaseID string `json:"lease_id,omitempty"`
	Device  string `json:"device,omitempty"`
	Message string `json:"message,omitempty"`
	AtMs    int64  `json:"at_ms"`
}

func (a *Agent) memoryPath() string { return filepath.Join(a.cfg.DataDir, memoryFile) }

// loadMemory reads memoryFile into the agent's health and lease table. A
// missing file is an empty memory; a file that does not decode is moved
// aside (and logged) so the agent starts, forgetting it.
func (a *Agent) loadMemory() error {
	b, err := os.ReadFile(a.memoryPath())
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("agent: data dir: read %s: %w", a.memoryPath(), err)
	}
	var m memory
	if err := json.Unmarshal(b, &m); err != nil {
		bad := a.memoryPath() + ".corrupt"
		os.Rename(a.memoryPath(), bad)
		a.log.Error("the agent's memory file does not decode; moved aside, GPU health and unacknowledged events are forgotten", "file", bad, "err", err)
		return nil
	}
	a.health.mu.Lock()
	for uuid, s := range m.Unhealthy {
		at := time.UnixMilli(s.AtMs)
		if uuid == "" {
			a.health.allLost, a.health.allLostAt = s.Reason, at
			continue
		}
		a.health.sick[uuid] = s.Reason
		a.health.sickAt[uuid] = at
	}
	a.health.mu.Unlock()
	t := a.leases
	t.mu.Lock()
	for _, e := range m.Events {
		t.events = append(t.events, &gpupoolv1.AgentEvent{Seq: e.Seq, Type: gpupoolv1.AgentEventType(e.Type), LeaseId: e.LeaseID, Device: e.Device, Message: e.Message, AtMs: e.AtMs})
	}
	t.lastSeq = max(t.lastSeq, m.LastSeq)
	t.mu.Unlock()
	if len(m.Unhealthy) > 0 || len(m.Events) > 0 {
		a.log.Info("remembered from the data dir", "unhealthy_gpus", len(m.Unhealthy), "unacknowledged_events", len(m.Events))
	}
	return nil
}

// saveMemory writes the agent's health and unacknowledged events to
// memoryFile. Writes are serialised so that the newest one lands last.
func (a *Agent) saveMemory() {
	a.memoryMu.Lock()
	defer a.memoryMu.Unlock()
	m := memory{Unhealthy: map[string]sickness{}}
	a.health.mu.Lock()
	for uuid, why := range a.health.sick {
		m.Unhealthy[uuid] = sickness{Reason: why, AtMs: a.health.sickAt[uuid].UnixMilli()}
	}
	if a.health.allLost != "" {
		m.Unhealthy[""] = sickness{Reason: a.health.allLost, AtMs: a.health.allLostAt.UnixMilli()}
	}
	a.health.mu.Unlock()
	t := a.leases
	t.mu.Lock()
	for _, e := range t.events {
		m.Events = append(m.Events, memoryEvent{Seq: e.Seq, Type: int32(e.Type), LeaseID: e.LeaseId, Device: e.Device, Message: e.Message, AtMs: e.AtMs})
	}
	m.LastSeq = t.lastSeq
	t.mu.Unlock()
	b, err := json.MarshalIndent(m, "", "  ")
	if err == nil {
		err = atomicfile.Write(a.memoryPath(), b)
	}
	if err != nil {
		a.log.Error("could not write the agent's memory to the data dir: GPU health and unacknowledged events would not survive a restart", "file", a.memoryPath(), "err", err)
	}
}

// healAfterLocked forgets unhealthy marks whose last critical event is
// more than HealthyAfter before now; it reports whether any was
// forgotten. The caller holds a.health.mu.
func (a *Agent) healAfterLocked(now time.Time) bool {
	after := a.cfg.HealthyAfter
	if after <= 0 {
		after = DefaultHealthyAfter
	}
	healed := false
	for _, uuid := range slices.Collect(maps.Keys(a.health.sick)) {
		if now.Sub(a.health.sickAt[uuid]) > after {
			a.log.Info("GPU healthy again: no critical event since", "device", uuid, "for", after, "was", a.health.sick[uuid])
			delete(a.health.sick, uuid)
			delete(a.health.sickAt, uuid)
			healed = true
		}
	}
	if a.health.allLost != "" && now.Sub(a.health.allLostAt) > after {
		a.health.allLost = ""
		healed = true
	}
	return healed
}

// clearHealth forgets the unhealthy marks of the devices an operator
// cleared (uuids; unknown ones are ignored). A GPU-lost mark covers every
// device, so clearing any device clears it too. The next heartbeat, sent
// at once, reports them healthy.
func (a *Agent) clearHealth(uuids []string) {
	a.health.mu.Lock()
	changed := false
	for _, uuid := range uuids {
		if why, ok := a.health.sick[uuid]; ok {
			a.log.Warn("GPU unhealthy mark cleared by an operator", "device", uuid, "was", why)
			delete(a.health.sick, uuid)
			delete(a.health.sickAt, uuid)
			changed = true
		}
		if a.health.allLost != "" {
			a.log.Warn("GPU-lost mark cleared by an operator", "device", uuid, "was", a.health.allLost)
			a.health.allLost = ""
			changed = true
		}
	}
	a.health.mu.Unlock()
	if changed {
		a.saveMemory()
		a.kick()
	}
}
