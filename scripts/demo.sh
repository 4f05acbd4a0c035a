#!/usr/bin/env bash
# The main job on the bundled sample corpus, end to end (what `make demo` runs):
# classifiers trained on the spot -> topic domains fitted on the sample -> curate -> tokenizer -> tokenize ->
# mixture plan -> a tiny MoE through pretraining then midtraining -> a miniature scaling ladder (three
# smaller rungs of the same family) forecasting that run's loss -> the data-overview page with the run page
# and the forecast.
# Every stage is an ordinary tokenmill command; README's tour runs them one by one.
set -euo pipefail
cd "$(dirname "$0")/.."

TOKENMILL=${TOKENMILL:-.venv/bin/tokenmill}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-out/demo}
RUN=${RUN:-runs/demo}
LADDER=${LADDER:-runs/demo-ladder}
MIXTURE=mixtures/demo.yaml
RUN_CONFIG=configs/runs/demo.yaml
LADDER_SPEC=configs/ladders/demo.yaml
STEPS_TOTAL=14
started=$(date +%s)
stage=0

banner() {
  stage=$((stage + 1))
  printf '\n==> [%d/%d] %s  (%ds elapsed)\n' "$stage" "$STEPS_TOTAL" "$1" "$(($(date +%s) - started))"
}

banner "labelled data for the classifiers (from text every Python install carries)"
"$PYTHON" scripts/make_classifier_data.py --output "$OUT/classifier-data"

banner "train the fastText domain and quality classifiers"
"$TOKENMILL" classifier train --kind domain --input "$OUT/classifier-data/domain.jsonl" --output "$OUT/models/domain"
"$TOKENMILL" classifier train --kind quality --input "$OUT/classifier-data/quality.jsonl" \
  --output "$OUT/models/quality" --calibration "$OUT/classifier-data/calibration.jsonl"

banner "fit topic domains on the sample: K=32 fine clusters (spherical k-means) -> 8 domains c00..c07"
# fastText vectors trained on the sample itself; domains under 2% of the documents join their nearest.
"$TOKENMILL" domains train --input data/sample --k 32 --domains 8 --min-share 0.02 --output "$OUT/models/domains"

banner "index the demo's evaluation set for decontamination (data/evals/docs-qa.jsonl)"
"$TOKENMILL" decontam index --evals data/evals/docs-qa.jsonl --output "$OUT/decontam.index"

banner "curate data/sample/* into topic domain x quality cells (Beam, local runner)"
# configs/curate/demo.yaml is mixed.yaml plus decontam (flag) and domain_clusters: cells are cNN x quality.
# --overwrite: a second demo run replaces the first one's output (an earlier run is refused without it).
"$TOKENMILL" curate --recipe configs/curate/demo.yaml --input 'data/sample/*' --output "$OUT/curate" --overwrite

banner "train a byte-level BPE tokenizer on the curated text"
"$TOKENMILL" tokenizer train --input "$OUT/curate/curated" --vocab-size 4096 --name tokenmill-bpe-4k \
  --output "$OUT/tokenizer.json"

banner "tokenize the cells into token shards, held-out slices and counts.json"
# Held-out slices: 5% of each cell's documents by id hash (the default, 0.5%, suits a web corpus; the sample
# is a few hundred thousand tokens), at least 2 per cell, so every domain has some held-out text to evaluate on.
"$TOKENMILL" tokenize --input "$OUT/curate/curated" --output "$OUT/tokens" --tokenizer "$OUT/tokenizer.json" \
  --heldout-fraction 0.05 --heldout-min-documents 2 --overwrite

# DEMO_UNTIL=tokens stops here: what scripts/swarm.sh (make swarm) needs from the demo.
if [ "${DEMO_UNTIL:-}" = tokens ]; then
  printf '\ndemo data ready in %ds: %s/tokens\n' "$(($(date +%s) - started))" "$OUT"
  exit 0
fi

banner "plan the demo mixture against the token catalog"
"$TOKENMILL" mixture plan "$MIXTURE" --counts "$OUT/tokens/counts.json"

banner "train the tiny MoE: pretraining"
# configs/runs/demo.yaml holds the run (model, mixture, optimizer, ...); flags override its fields.
# --logging.publish: the run page is republished while training, every 20 steps and at each checkpoint, to where the
# final report puts it ($OUT/site/run.html), so a follower's link stays the same (docs/reports.md).
rm -rf "$RUN"
"$TOKENMILL" train --config "$RUN_CONFIG" --data.tokens "$OUT/tokens" --data.phase pretraining --output "$RUN" \
  --logging.publish "$OUT/site" --logging.publish_every 20

banner "train the tiny MoE: midtraining, from the last pretraining checkpoint"
"$TOKENMILL" train --config "$RUN_CONFIG" --data.tokens "$OUT/tokens" --data.phase midtraining --output "$RUN" \
  --logging.publish "$OUT/site" --logging.publish_every 20

banner "plan the miniature scaling ladder: rungs, tokens per active parameter, mixture slices"
rm -rf "$LADDER"
"$TOKENMILL" ladder plan "$LADDER_SPEC" --counts "$OUT/tokens/counts.json" --output "$LADDER/plan"

banner "train the three rungs (each: pretraining, then midtraining)"
# One line per rung from the plan: name, model file, slice spec.
"$PYTHON" -c 'import json, sys
for rung in json.load(open(sys.argv[1]))["rungs"]:
    print(rung["name"], rung["model"], rung["mixture_spec"])' "$LADDER/plan/ladder-plan.json" |
  while read -r name model spec; do
    for phase in pretraining midtraining; do
      "$TOKENMILL" train --data.mixture "$spec" --data.tokens "$OUT/tokens" --data.phase "$phase" --model "$model" \
        --output "$LADDER/$name"
    done
  done

banner "fit loss against compute over the rungs and forecast the tiny MoE's loss"
"$TOKENMILL" ladder fit "$LADDER"/rung-*/ --ladder "$LADDER_SPEC" --target-run "$RUN" \
  --output "$LADDER/ladder.json"

banner "build the data-overview page and the run page (with the forecast)"
"$TOKENMILL" report --curated "$OUT/curate/curated" --tokens "$OUT/tokens" --mixture "$MIXTURE" \
  --domains-model "$OUT/models/domains" --quality-model "$OUT/models/quality" \
  --run "$RUN" --ladder "$LADDER/ladder.json" --output "$OUT/site"

printf '\ndemo done in %ds: open %s/site/index.html (and run.html)\n' "$(($(date +%s) - started))" "$OUT"
