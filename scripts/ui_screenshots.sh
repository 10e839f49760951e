#!/usr/bin/env bash
# Screenshots of what a user sees after `dvc repro`: the MLflow runs page, one run page, and the
# Prefect flow-runs page, taken by headless Chromium (Debian's `chromium`; `apt-get install chromium`).
#
#   bash scripts/ui_screenshots.sh [OUT_DIR]      (default reports/ui; run from the project root)
#
# Starts `mlflow ui` on a free port against the project's mlflow.db and stops it afterwards; the
# Prefect server is the project's own (`lensemble server url`), started if none is running.
set -euo pipefail
out=${1:-reports/ui}
mkdir -p "$out"
export MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "ui_screenshots: no chromium on PATH (apt-get install chromium)" >&2; exit 2; }
[ -f mlflow.db ] || { echo "ui_screenshots: no mlflow.db here: run dvc repro first" >&2; exit 2; }

port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mlflow ui --backend-store-uri "sqlite:///$PWD/mlflow.db" --host 127.0.0.1 --port "$port" >"$out/mlflow-ui.log" 2>&1 &
ui_pid=$!
trap 'kill $ui_pid 2>/dev/null || true' EXIT
for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done

read -r exp_id run_id flow_run_id < <(python - "$PWD/mlflow.db" <<'EOF'
import sys
from mlflow.tracking import MlflowClient
c = MlflowClient(f"sqlite:///{sys.argv[1]}")
e = c.get_experiment_by_name("lensemble")
latest = lambda stage: c.search_runs([e.experiment_id], f"tags.`lensemble.stage` = '{stage}'", order_by=["attributes.start_time DESC"], max_results=1)[0]
print(e.experiment_id, latest("evaluate").info.run_id, latest("federate").data.tags.get("prefect.flow_run_id", "none"))
EOF
)

shot() {  # URL FILE [WIDTH,HEIGHT]
  "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking \
    --disable-component-update --disable-sync --user-data-dir="$(mktemp -d)" --window-size="${3:-1600,1000}" \
    --virtual-time-budget=20000 --screenshot="$2" "$1" >/dev/null 2>&1
  echo "$2 <- $1"
}
shot "http://127.0.0.1:$port/#/experiments/$exp_id" "$out/mlflow-experiment.png"
shot "http://127.0.0.1:$port/#/experiments/$exp_id/runs?workflowType=machine_learning" "$out/mlflow-runs.png"
shot "http://127.0.0.1:$port/#/experiments/$exp_id/runs/$run_id?workflowType=machine_learning" "$out/mlflow-run.png" 1600,3200
prefect_ui=$(lensemble server url)
shot "$prefect_ui/runs" "$out/prefect-runs.png"
shot "$prefect_ui/runs/flow-run/$flow_run_id" "$out/prefect-federate-logs.png" 1600,1400
