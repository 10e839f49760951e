#!/usr/bin/env bash
# Manual check of sovereign mode with real Prefect workers (README "Sovereign sites"): a micro project
# whose two sites each get a process work pool, a worker and a `site-round` deployment; the coordinator
# federates through the exchange folder, then the same federation runs in local mode, and the two
# final global parameters must be bitwise identical.   Usage: bash scripts/sovereign_check.sh [DIR]
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
P=${1:-/tmp/lensemble-sovereign}
rm -rf "$P" && mkdir -p "$P"
cd "$REPO"
python - "$P" <<'PY'
import sys, yaml
from pathlib import Path
sys.path.insert(0, ".")
from lensemble.paths import Layout
from orchestration.site_agent import keygen
from tests.conftest import make_project, micro_params
raw = micro_params()
raw["federate"].update(execution="sovereign", site_launch="deployment", head_adapt_steps=0, local_only=False)
root = Path(sys.argv[1])
for s in raw["data"]["sites"]:  # what each site does first (`lensemble site keygen SITE`); the coordinator pins the fingerprint
    s["key_fingerprint"] = keygen(Layout(root), s["name"])[0]
make_project(root, raw)
PY
export PREFECT_HOME="$P/.prefect" MLFLOW_TRACKING_URI="sqlite:///$P/mlflow.db"
export PREFECT_API_URL=$(lensemble --root "$P" server url --api)
echo "server: $PREFECT_API_URL"
lensemble --root "$P" run prepare
for s in site_a site_b; do
  pool="lensemble-${s/_/-}"
  prefect work-pool create "$pool" --type process >/dev/null
  lensemble --root "$P" site deploy "$s"
  (cd "$P" && exec prefect worker start --pool "$pool" > "$P/worker-$s.log" 2>&1) &
done
sleep 5
start=$(date +%s.%N)
lensemble --root "$P" run federate
end=$(date +%s.%N)
python -c "import json;f=json.load(open('$P/reports/federate.json'));print('federate wall', round($end-$start,1),'s; rounds', [sorted(r['sites']) for r in f['per_round']], 'sha', f['global_params_sha256'][:16], 'orchestration', [round(r['orchestration_seconds'],2) for r in f['per_round']], 'round s', [round(r['seconds'],2) for r in f['per_round']])"
prefect flow-run ls --limit 8 2>/dev/null | head -20 || true
pkill -f "prefect worker start --pool lensemble-site" || true
sovereign=$(python -c "import json;print(json.load(open('$P/reports/federate.json'))['global_params_sha256'])")
python - "$P" <<'PY'
import sys, yaml
path = f"{sys.argv[1]}/params.yaml"
raw = yaml.safe_load(open(path))
raw["federate"]["execution"] = "local"
open(path, "w").write(yaml.safe_dump(raw, sort_keys=False))
PY
lensemble --root "$P" run federate
local=$(python -c "import json;print(json.load(open('$P/reports/federate.json'))['global_params_sha256'])")
echo "sovereign $sovereign"; echo "local     $local"
[ "$sovereign" = "$local" ] && echo "bitwise identical" || { echo "MISMATCH"; exit 1; }
lensemble --root "$P" server stop
