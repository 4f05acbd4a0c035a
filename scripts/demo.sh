#!/usr/bin/env bash
# The main job on the bundled sample corpus, end to end (what `make demo` runs):
# classifiers trained on the spot -> curate -> tokenizer -> tokenize -> mixture plan ->
# a tiny MoE through pretraining then midtraining -> the data-overview page with the run page.
# Every stage is an ordinary tokenmill command; README's tour runs them one by one.
set -euo pipefail
cd "$(dirname "$0")/.."

TOKENMILL=${TOKENMILL:-.venv/bin/tokenmill}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-out/demo}
RUN=${RUN:-runs/demo}
MIXTURE=mixtures/demo.yaml
MODEL=configs/models/tiny.yaml
STEPS_TOTAL=9
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

banner "curate data/sample/* into domain x quality cells (Beam, local runner)"
"$TOKENMILL" curate --recipe configs/curate/mixed.yaml --input 'data/sample/*' --output "$OUT/curate"

banner "train a byte-level BPE tokenizer on the curated text"
"$TOKENMILL" tokenizer train --input "$OUT/curate/curated" --vocab-size 4096 --name tokenmill-bpe-4k \
  --output "$OUT/tokenizer.json"

banner "tokenize the cells into token shards and counts.json"
"$TOKENMILL" tokenize --input "$OUT/curate/curated" --output "$OUT/tokens" --tokenizer "$OUT/tokenizer.json"

banner "plan the demo mixture against the token catalog"
"$TOKENMILL" mixture plan "$MIXTURE" --counts "$OUT/tokens/counts.json"

banner "train the tiny MoE: pretraining"
rm -rf "$RUN"
"$TOKENMILL" train --mixture "$MIXTURE" --tokens "$OUT/tokens" \
  --phase pretraining --model "$MODEL" --output "$RUN"

banner "train the tiny MoE: midtraining, from the last pretraining checkpoint"
"$TOKENMILL" train --mixture "$MIXTURE" --tokens "$OUT/tokens" \
  --phase midtraining --model "$MODEL" --output "$RUN"

banner "build the data-overview page and the run page"
"$TOKENMILL" report --curated "$OUT/curate/curated" --tokens "$OUT/tokens" --mixture "$MIXTURE" \
  --run "$RUN" --output "$OUT/site"

printf '\ndemo done in %ds: open %s/site/index.html (and run.html)\n' "$(($(date +%s) - started))" "$OUT"
