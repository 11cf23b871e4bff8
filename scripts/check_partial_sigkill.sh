#!/usr/bin/env bash
# SIGKILL a partial-rollout async run (colocated vLLM engine) mid-step after a checkpoint, resume it, and check
# that every step and every prompt of each epoch is trained once and the interrupted responses were continued.
# Run by hand (two vLLM launches, ~2 min on 2 cores; not in the suite): bash scripts/check_partial_sigkill.sh [DIR]
# MULTI_TURN=1: the same with the gym scheduler (3 turns of guess-the-number per trajectory): interrupted
# trajectories are replayed turn by turn and continued (docs/engines.md); prompts are told apart by their id column.
# The in-suite tests of the same property: with the kill on a rollout server, tests/rollout/test_remote_engine.py::
# test_a_killed_partial_run_resumes_and_trains_each_prompt_once; without it, tests/rollout/test_vllm_engine.py::
# test_a_partial_run_resumed_mid_async_continues_what_it_had_in_flight.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-$(mktemp -d)}
mkdir -p "$DIR"
rm -rf "$DIR/out" "$DIR/ckpt" "$DIR/marker"
if [ "${MULTI_TURN:-0}" = 1 ]; then
  .venv/bin/python -c "import json,sys; [print(json.dumps({'prompt': 'Play the number guessing game.', 'id': k,
    'target': 1 + k % 20, 'env_config': {'name': 'guess_number'}})) for k in range(32)]" > "$DIR/guess.jsonl"
  TASK=(--config examples/tiny_cpu_gym.yaml --data.path "$DIR/guess.jsonl" --rollout.n 2 --rollout.max_tokens 128)
else
  TASK=(--config examples/tiny_cpu.yaml --rollout.max_tokens 96)
fi
# REMOTE_URL=http://127.0.0.1:PORT (a launch/rollout_server.py serving the same model; MGRPO_SERVER_TOKEN set):
# the engine is that server, which outlives the kill (only the trainer dies)
if [ -n "${REMOTE_URL:-}" ]; then
  ENGINE=(--rollout.engine remote --rollout.servers "$REMOTE_URL" --rollout.remote.take_over true)
else
  ENGINE=(--rollout.engine vllm --rollout.vllm.kv_cache_gb 1)
fi
ARGS=("${TASK[@]}" "${ENGINE[@]}" --rollout.mode async
  --rollout.max_staleness 1 --rollout.partial true --rollout.ignore_eos true --rollout.prompts_per_step 8
  --train.steps 8 --checkpoint.save_dir "$DIR/ckpt" --checkpoint.save_interval 4
  --logging.output_dir "$DIR/out" --logging.progress_bar false --logging.completions_interval 1)
# killed (the whole process group, engine included) while step 5 trains: steps 4 and 5 are lost
MGRPO_TEST_PAUSE=train:5 MGRPO_TEST_PAUSE_MARKER="$DIR/marker" setsid .venv/bin/python launch/train_grpo.py \
  "${ARGS[@]}" --logging.overwrite true > "$DIR/killed.log" 2>&1 &
PID=$!
for _ in $(seq 1 1200); do [ -f "$DIR/marker" ] && break; sleep 0.5; done
[ -f "$DIR/marker" ] || { echo "the run never reached train:5; see $DIR/killed.log" >&2; kill -9 -"$PID" 2>/dev/null; exit 1; }
kill -9 -"$PID"; wait "$PID" || true
cp "$DIR/out/completions.jsonl" "$DIR/completions_killed.jsonl"
.venv/bin/python launch/train_grpo.py "${ARGS[@]}" --resume "$DIR/ckpt/$(cat "$DIR/ckpt/latest")" > "$DIR/resumed.log" 2>&1
.venv/bin/python - "$DIR" <<'PY'
import collections, json, sys
d = sys.argv[1]
rows = [json.loads(line) for line in open(f"{d}/out/metrics.jsonl")]
steps = [r["step"] for r in rows]
by, killed = collections.defaultdict(set), collections.defaultdict(set)
for line in open(f"{d}/out/completions.jsonl"):
    r = json.loads(line)
    by[r["step"]].add(r.get("id", r["prompt"]))
for line in open(f"{d}/completions_killed.jsonl"):
    r = json.loads(line)
    killed[r["step"]].add(r.get("id", r["prompt"]))
epochs = [[p for s in range(e, e + 4) for p in by[s]] for e in (0, 4)]
continued = {r["step"]: r.get("async/continued_samples", 0) for r in rows if r.get("async/continued_samples")}
print(f"steps {steps}; continued samples by step {continued}; prompts per epoch (distinct/trained) "
      f"{[(len(set(e)), len(e)) for e in epochs]}; resumed step 4 = killed run's step 4: {by[4] == killed[4]}")
assert steps == list(range(8)), "every step once"
assert all(len(set(e)) == len(e) == 32 for e in epochs), "every prompt once per epoch"
assert continued and by[4] == killed[4], "the interrupted responses of the checkpoint were continued"
print("result: partial_sigkill=ok")
PY
