#!/usr/bin/env bash
# Summarize SpecBench's 80 summarization prompts map-reduce on the embedded setup, within a deadline.
#
#   ops/demo_summarize.sh                 # starts `coserve up` in data/demo, runs, stops it
#   DEADLINE=30m LIMIT=10 ops/demo_summarize.sh
#   COSERVE_URL=... COSERVE_API_KEY=... ops/demo_summarize.sh   # use a coserve that is already up
#
# Output: summaries.jsonl (one {"id","summary","chunks","levels","jobs","error"} per document).
set -euo pipefail
cd "$(dirname "$0")/.."
DEADLINE=${DEADLINE:-2h}
LIMIT=${LIMIT:-}
OUT=${OUT:-summaries.jsonl}
DATA=${DATA:-data/demo}
started=""
if [[ -z "${COSERVE_URL:-}" ]]; then
  mkdir -p "$DATA"
  export COSERVE_DATA_DIR="$DATA"
  coserve up --data-dir "$DATA" --port "${PORT:-8000}" > "$DATA/up.log" 2>&1 &
  started=$!
  trap 'kill -INT "$started" 2>/dev/null; wait "$started" 2>/dev/null || true' EXIT
  echo "waiting for coserve up (log: $DATA/up.log) ..."
  for _ in $(seq 1 600); do
    if grep -q "ready" "$DATA/up.log" 2>/dev/null && [[ -f "$DATA/credentials.json" ]]; then break; fi
    sleep 1
  done
fi
# chunks of 512 tokens so SpecBench's longer articles (up to ~1,600 tokens) go through map and reduce
coserve summarize --specbench ${LIMIT:+--limit "$LIMIT"} --deadline "$DEADLINE" --chunk-tokens 512 \
  --overlap-tokens 32 --max-summary-tokens "${MAX_SUMMARY_TOKENS:-96}" -o "$OUT"
python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
ok = [r for r in rows if r["summary"] is not None]
print(f"{len(ok)}/{len(rows)} documents; {sum(r['chunks'] > 1 for r in rows)} split into chunks; "
      f"{sum(r['jobs'] for r in rows)} jobs")
print("example:", ok[0]["id"], "->", ok[0]["summary"][:300].replace("\n", " "))
PY
