#!/usr/bin/env bash
# demo.sh runs elastic-sim against a local 'gpupool dev' pool while
# guaranteed work comes and goes, and leaves a chart of the slices it held
# and of that guaranteed work (elastic-sim's --show-pool, on by default).
#
# Usage: examples/elastic-sim/demo.sh [OUT.png]
#
# OUT.png defaults to bench/results/elastic-sim.png; the per-tick CSV is
# written next to it (OUT.csv). The pool is 2 simulated hosts of 4
# A100-80GB each (8 GPUs, no real GPU needed) on ports 7641-7861, which
# must be free. The run takes about two minutes with a 10s preemption
# grace (three with the brokers' default 30s, when 'gpupool dev' has no
# --preempt-grace):
#
#   1. elastic-sim asks for 2 guaranteed slices of 40 GiB / 50% and grows
#      to 8 (half a GPU each);
#   2. wave 1: a guaranteed job waits for 6 whole GPUs; the brokers give
#      extras notice, take them back after the grace and grant the job,
#      which holds them 20s and releases; elastic-sim grows back;
#   3. wave 2: a guaranteed job of 5 whole GPUs, then, once it runs, one
#      of 1 GPU: the lease shrinks in two steps and grows back in two as
#      they release;
#   4. elastic-sim is stopped: it releases its lease and writes the chart.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
out="$repo/bench/results/elastic-sim.png"
if [[ ${1:-} ]]; then
	out=$1
	[[ $out == /* ]] || out="$PWD/$out"
fi
case $out in
*.png | *.PNG) ;;
*)
	echo "demo.sh: $out: the chart is a PNG: name the file *.png" >&2
	exit 2
	;;
esac
csv="${out%.*}.csv"
mkdir -p "$(dirname "$out")"

# Timing, in seconds.
grace=10   # preemption grace asked of 'gpupool dev' (when it has the flag)
hold=20    # how long each wave holds its GPUs
settle=15  # time to grow back between waves, and before the end
solo=10    # elastic-sim runs alone this long before wave 1

base_port=7641
export GPUPOOL_ADDR="127.0.0.1:$base_port,127.0.0.1:$((base_port + 2)),127.0.0.1:$((base_port + 4))"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/elastic-demo.XXXXXX")
gp="$tmp/gpupool"
dev_pid=
sim_pid=
pause_pid=
wave_pids=()

say() { echo "demo: $*"; }

# pause sleeps n seconds in a way a signal to the script interrupts.
pause() {
	sleep "$1" &
	pause_pid=$!
	wait "$pause_pid"
	pause_pid=
}

# stop sends SIGTERM to the process pid and waits up to 10s for it to go,
# then kills it.
stop() {
	local pid=$1
	[[ $pid ]] && kill -0 "$pid" 2>/dev/null || return 0
	kill -TERM "$pid" 2>/dev/null || true
	for _ in $(seq 100); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	kill -KILL "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
}

cleanup() {
	local status=$?
	trap - EXIT
	set +e
	for pid in "${wave_pids[@]}"; do
		# Each wave runs in its own process group (set -m): end its
		# 'gpupool lease acquire' too, without a job notice.
		disown "$pid" 2>/dev/null
		kill -TERM -- "-$pid" 2>/dev/null
	done
	[[ -z $pause_pid ]] || kill "$pause_pid" 2>/dev/null
	stop "$sim_pid"
	stop "$dev_pid"
	if ((status != 0 && status != 130 && status != 143)) && [[ -s $tmp/dev.log ]]; then
		echo "demo: failed; the last lines of 'gpupool dev':" >&2
		tail -n 20 "$tmp/dev.log" >&2
	fi
	rm -rf "$tmp"
	exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# Background jobs get process groups of their own, so that cleanup can end
# a wave with the command it is running.
set -m

cd "$repo"
say "building gpupool and elastic-sim"
go build -o "$gp" ./cmd/gpupool
go build -o "$tmp/elastic-sim" ./examples/elastic-sim

if ! "$gp" lease acquire --help | grep -q -- '--wait'; then
	echo "demo.sh: this gpupool's 'lease acquire' has no --wait flag, which the guaranteed waves need" >&2
	exit 1
fi
dev_flags=(--hosts 2 --simulate 4xA100-80GB --base-port "$base_port")
if "$gp" dev --help | grep -q -- '--preempt-grace'; then
	dev_flags+=(--preempt-grace "${grace}s")
else
	grace=30 # the brokers' default
fi

say "starting gpupool dev ${dev_flags[*]} (log: $tmp/dev.log)"
"$gp" dev "${dev_flags[@]}" >"$tmp/dev.log" 2>&1 &
dev_pid=$!

# Wait until the brokers answer and both hosts are ready.
deadline=$((SECONDS + 60))
until [[ $("$gp" status -o json --timeout 2s 2>/dev/null || true) == *'"hosts_ready": 2'* ]]; do
	if ! kill -0 "$dev_pid" 2>/dev/null; then
		echo "demo.sh: gpupool dev exited" >&2
		exit 1
	fi
	if ((SECONDS > deadline)); then
		echo "demo.sh: the pool was not up after 60s" >&2
		exit 1
	fi
	pause 0.5
done
say "the pool is up: 2 hosts, 8 GPUs; preemption grace ${grace}s"

"$tmp/elastic-sim" --min 2 --max 8 --memory 40GiB --compute 50 --tenant sim \
	--csv "$csv" --plot "$out" &
sim_pid=$!

# wave NAME GPUS: a guaranteed job that waits for GPUS whole GPUs, holds
# them $hold seconds and releases them.
wave() {
	local name=$1 gpus=$2 started=$SECONDS id what="$2 whole GPUs"
	((gpus > 1)) || what="1 whole GPU"
	say "$name: asking for $what, waiting up to 3m"
	"$gp" lease acquire --exclusive --gpus "$gpus" --wait 3m --timeout 4m --ttl 2m \
		--tenant batch --holder "demo-$name" -o json >"$tmp/$name.json"
	id=$(sed -n 's/^  "id": "\([^"]*\)".*/\1/p' "$tmp/$name.json")
	if [[ -z $id ]]; then
		echo "demo.sh: $name: no lease id in the answer:" >&2
		cat "$tmp/$name.json" >&2
		return 1
	fi
	say "$name: granted $id after $((SECONDS - started))s; holding it ${hold}s"
	sleep "$hold"
	"$gp" lease release "$id" --reason "demo $name done" >/dev/null
	say "$name: released $id"
}

# run_waves starts the waves named by its arguments (NAME:GPUS), each
# delay seconds after the one before, and waits for them all.
run_waves() {
	local delay=$1 spec first=1
	shift
	wave_pids=()
	for spec in "$@"; do
		((first)) || pause "$delay"
		first=0
		wave "${spec%:*}" "${spec#*:}" &
		wave_pids+=($!)
	done
	for pid in "${wave_pids[@]}"; do
		wait "$pid"
	done
	wave_pids=()
}

pause "$solo"
run_waves 0 wave-1:6
pause "$settle"
run_waves "$((grace + 5))" wave-2a:5 wave-2b:1
pause "$settle"

say "stopping elastic-sim"
kill -TERM "$sim_pid"
wait "$sim_pid"
sim_pid=
say "chart: $out"
say "CSV:   $csv"
