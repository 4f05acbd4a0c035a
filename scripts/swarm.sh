#!/usr/bin/env bash
# The mixture search on the demo corpus, end to end (what `make swarm` runs; docs/search.md):
# the demo's data (made first when missing) -> a swarm of 32 tiny proxies sampled around the
# token-proportional prior of mixtures/demo-search.yaml -> the proxies trained on a pool of pinned workers
# -> a fit of every source's held-out bits per byte -> a proposed mixture within every epoch cap -> the
# proposal against the prior and the uniform mixture at 4x a proxy's compute, 3 seeds each -> the swarm page.
# Rerunning resumes: finished proxies and validation runs are kept (SWARM_FRESH=1 samples a new swarm).
set -euo pipefail
cd "$(dirname "$0")/.."

TOKENMILL=${TOKENMILL:-.venv/bin/tokenmill}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-out/demo}
SWARM=${SWARM:-runs/swarm-demo}
PROXIES=${PROXIES:-32}
PROXY_TOKENS=${PROXY_TOKENS:-64K}
WORKERS=${WORKERS:-2}
SEEDS=${SEEDS:-3}
COMPUTE=${COMPUTE:-4}
STEPS_TOTAL=7
started=$(date +%s)
stage=0

banner() {
  stage=$((stage + 1))
  printf '\n==> [%d/%d] %s  (%ds elapsed)\n' "$stage" "$STEPS_TOTAL" "$1" "$(($(date +%s) - started))"
}

banner "the demo's token shards and held-out slices"
if [ -f "$OUT/tokens/counts.json" ]; then
  echo "kept: $OUT/tokens (remove it to make the demo's data again)"
else
  DEMO_UNTIL=tokens OUT="$OUT" TOKENMILL="$TOKENMILL" PYTHON="$PYTHON" bash scripts/demo.sh
fi

banner "sample $PROXIES proxy mixtures of pretraining around the prior (every epoch cap kept)"
if [ -f "$SWARM/swarm.json" ] && [ -z "${SWARM_FRESH:-}" ]; then
  echo "kept: $SWARM (its finished proxies are not run again; SWARM_FRESH=1 samples a new swarm)"
else
  "$TOKENMILL" mixture swarm mixtures/demo-search.yaml --run-config configs/runs/swarm-proxy.yaml \
    --tokens "$OUT/tokens" --proxies "$PROXIES" --proxy-tokens "$PROXY_TOKENS" --output "$SWARM" --overwrite
fi

banner "train the proxies: $WORKERS workers, each pinned to its share of the cores"
"$TOKENMILL" mixture run "$SWARM" --workers "$WORKERS"

banner "fit held-out bits per byte per source: log-linear and Gaussian process, out-of-fold quality"
"$TOKENMILL" mixture fit "$SWARM"

banner "propose the mixture that minimises held-out macro bits per byte within every epoch cap"
"$TOKENMILL" mixture propose "$SWARM" --output "$SWARM/proposed.yaml"   # prints the diff against the base

banner "validate: proposal, prior and uniform at ${COMPUTE}x a proxy's compute, $SEEDS seeds each"
"$TOKENMILL" mixture validate "$SWARM" --compute "$COMPUTE" --seeds "$SEEDS" --workers "$WORKERS"

banner "the swarm page"
"$TOKENMILL" report --swarm "$SWARM" --output "$SWARM/site"

printf '\nmixture search done in %ds: open %s/site/swarm.html\n' "$(($(date +%s) - started))" "$SWARM"
