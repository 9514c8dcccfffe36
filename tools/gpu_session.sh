#!/usr/bin/env bash
# One lent GPU session's measurements (issue 30), in one command of at most ~10 minutes:
#
#   OUT=/some/folder bash tools/gpu_session.sh
#
# Parts run one after another (never two on the GPU at once), in the order of what they decide:
# the routed model and block bars (T = 2048, C = 0.125), the decode bar, dense MFU, a profile of
# the decode step (tools/profile_decode.py), a CUDA smoke of `modbench train`, a torch.profiler
# table of the routed block, then the CUDA-only
# correctness tests of tests/bench. Each part has its own time cap (SIGINT, so pytest still
# writes its JSON) and a part starts only while the session's deadline allows. The device tool
# brings back at most a handful of files, and a later command's copy of the working tree removes
# the untracked results of an earlier one, so everything (logs, this session's JSONs and tables)
# goes into ONE archive, $OUT/gpu-session.tar.gz, rewritten as soon as each part ends: a
# cut-short session keeps what finished. Unpack it in the repository root.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the folder results go to}
DEADLINE_S=${DEADLINE_S:-570}  # the command's own limit is 600 s
start=$(date +%s)
LOGS=build/gpu-session  # ignored (build/), bundled into the archive
rm -rf "$LOGS" && mkdir -p "$LOGS" reports/bench
touch "$LOGS/.start"
log() { echo "[$(( $(date +%s) - start ))s] $*" | tee -a "$LOGS/session.log"; }
# The archive: the logs and every reports/bench file this session wrote (not the committed ones).
bundle() {
  { echo "$LOGS"; find reports/bench -type f -newer "$LOGS/.start"; } | tar czf "$OUT/gpu-session.tar.gz" -T -
}
left() { echo $(( DEADLINE_S - ($(date +%s) - start) )); }

# part NAME CAP COMMAND...: run COMMAND capped at min(CAP, time left), log its exit and time.
part() {
  local name=$1 cap=$2; shift 2
  local budget; budget=$(left)
  (( budget < 20 )) && { log "$name: skipped, ${budget}s left"; return; }
  (( cap > budget )) && cap=$budget
  log "$name: start (cap ${cap}s)"
  local t0; t0=$(date +%s)
  timeout -s INT -k 15 "$cap" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  log "$name: rc=$rc in $(( $(date +%s) - t0 ))s; $(tail -n 1 "$LOGS/$name.log")"
  bundle
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  python3 -m pip list 2>/dev/null | grep -iE "^(torch|triton|pytest|pytest-benchmark|pandas|scipy|numpy|tabulate|rich|matplotlib|mlflow|optuna|tqdm) "
  nproc; free -g | head -2
} > "$LOGS/environment.txt" 2>&1
log "environment: $(head -n 2 "$LOGS/environment.txt" | tail -n 1)"

part setup     60 make --no-print-directory gpu-bench-setup
part model    120 make --no-print-directory gpu-bench-model GPU_K_model="cuda and T2048 and (dense or sigmoid-C0.125)"
part block     80 make --no-print-directory gpu-bench-block GPU_K_block="cuda and T2048 and (dense or sigmoid-C0.125)"
# (each decode entry is ~17 s on an H100: three whole generations and their dense references)
part decode   100 make --no-print-directory gpu-bench-decode GPU_K_decode="cuda and (B1- or B64-) and (dense or sigmoid-C0.125-fixed)"
part mfu      110 make --no-print-directory gpu-bench-mfu GPU_K_mfu="cuda and T2048"
part report    20 make --no-print-directory gpu-bench-report
part decprof   60 env PYTHONPATH="$PWD/build/gpu-pkg" python3 tools/profile_decode.py --device cuda --batch 64 \
                    --new 24 --rounds 3 --top 25
part smoke     40 make --no-print-directory gpu-smoke GPU_SMOKE_STEPS=20
part profile   40 env PYTHONPATH="$PWD/build/gpu-pkg" python3 -m modbench.bench.profile_block --device cuda \
                    --variant sigmoid --capacity 0.125 --seq-len 2048 --batch 32 --rounds 10 --steps 3 --top 30
part tests    600 env PYTHONPATH="$PWD/build/gpu-pkg" python3 -m pytest -p no:cacheprovider -q tests/bench \
                    -k "sync_on_cuda or sync_once or (decode_tokens and cuda and B8-)"
log "done"
bundle
