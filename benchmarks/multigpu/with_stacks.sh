# Usage: bash benchmarks/multigpu/with_stacks.sh SECONDS LOG COMMAND...
# Runs COMMAND with its output in LOG. Past SECONDS, every process of its tree (torchrun workers run in
# sessions of their own) gets SIGABRT, so that faulthandler writes its Python stacks into LOG, then SIGKILL.
secs=$1 log=$2
shift 2
: > "$log"
PYTHONFAULTHANDLER=1 "$@" >> "$log" 2>&1 &
pid=$!
alive() { [ -n "$(ps -p "$1" -o stat= | grep -v Z)" ]; }
tree() { local c; for c in $(ps -o pid= --ppid "$1"); do echo "$c"; tree "$c"; done; }
for _ in $(seq "$secs"); do
  alive $pid || { wait $pid; exit $?; }
  sleep 1
done
echo "=== TIMEOUT after ${secs}s: stacks of every process follow ===" >> "$log"
all="$pid $(tree $pid)"
kill -ABRT $all 2>/dev/null; sleep 5; kill -KILL $all 2>/dev/null
wait $pid
exit 124
