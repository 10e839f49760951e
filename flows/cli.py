"""`lensemble`: the command that fronts every stage.

    lensemble run STAGE        run one stage's Prefect flow (what `dvc repro` calls)
    lensemble pipeline         run every stage in order as subflows of one Prefect flow
    lensemble check-params     validate params.yaml: `params.yaml is valid (params hash <sha256>)`
    lensemble server url|stop  the project's Prefect server: its UI address (`--api`: the API's), or stop it
    lensemble serve            the pipeline and scheduled federation rounds as deployments on that server
    lensemble site keygen SITE create the site's signing key at the site; print the fingerprint params pin
    lensemble site deploy SITE enrol a sovereign site and register its round deployment on its work pool
    lensemble budgets compare  measured budget values by hardware class and stage, from MLflow
    lensemble ablate           the (H, anchor weight) grid as a Prefect map: drift, success vs bytes
    lensemble join SITE        a robot not in the federation joins it: new local head vs a model from scratch
    lensemble export SITE OUT  the site's episode store as a LeRobot dataset (v3.0: parquet, one MP4 per episode)
    lensemble ui               the MLflow UI on the project's store, opened on the runs table (and the Prefect UI's address)
    lensemble bench [NAME ...] the benchmark suite, each figure beside its physical limit
    lensemble profile [CONFIG] torch profiler trace and span table of a training step

Errors print one line, `lensemble: error: ...`, and exit with the error's code; a stage's missing inputs
are such an error before any Prefect server starts. Progress and stage lines go to stderr (logger
`lensemble`) and, inside a run, to its Logs tab. The CLI is the top layer: it wires flows/ and
benchmarks/ (`bench`, `profile`); `python -m flows.cli` is the same command.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from pathlib import Path

from flows.server import ServerRecord, ensure_server, stop_server, ui_url
from lensemble.errors import ConfigError, LensembleError
from orchestration.heap import freeze_long_lived, skip_final_collection

STAGES = ("prepare", "residency", "centralized", "federate", "gauge", "evaluate", "report")


def offline_environment(root: Path) -> None:
    """Telemetry off, a project-local Prefect home, a generous ephemeral-server start-up, and run logs at INFO.

    Prefect's run loggers (`prefect.flow_runs`, `prefect.task_runs`) inherit PREFECT_LOGGING_LEVEL and
    send to the API, so INFO fills each run's Logs tab; its console handler stays at WARNING, so a
    terminal is not flooded with a "Finished in state Completed()" per task run. Lensemble's own lines
    (logger `lensemble`: stage start and end, rounds, progress) reach the Logs tab as an extra logger
    and the terminal through `console_logging`. Must run before Prefect is imported.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("DVC_NO_ANALYTICS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")  # Prefect's client telemetry and its notice
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    os.environ.setdefault("PREFECT_HOME", str(root.resolve() / ".prefect"))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "lensemble")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")  # a line outside a run: terminal only
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


def console_logging() -> None:
    """Lensemble's INFO lines on stderr as plain `HH:MM:SS | text` lines (readable in a non-TTY log)."""
    logger = logging.getLogger("lensemble")
    if any(getattr(h, "lensemble_console", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(message)s", datefmt="%H:%M:%S"))
    handler.lensemble_console = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # Prefect's console handler would print it a second time


def stage_flow(stage: str, root: Path | str = "."):
    """The flow function of a stage, named and told (federate: with the task runner its params ask for)."""
    from flows.runs import told

    module = importlib.import_module(f"flows.{stage}")
    if stage == "federate":
        return told(module.configured_flow(root))
    return told(getattr(module, f"{stage}_flow"))


def _plot_worker(conn, path: str) -> None:
    """The plotting half of `budgets compare`, in a forked process: import matplotlib, wait for the rows, plot."""
    code = 1
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401  (the import is the slow part, done while the parent queries MLflow)

        from orchestration.compare import plot

        rows = conn.recv()
        plot(rows, Path(path))
        code = 0
    finally:
        os._exit(code)  # no teardown of state inherited from the parent


def budgets_compare(root: Path, plot_path: Path) -> None:
    """Query MLflow, print the table, write the plot; exits the process when done.

    Two processes: a forked child imports matplotlib while this one imports MLflow and queries it,
    then plots the rows it is sent while this one prints them. Both end with `os._exit`: the command
    only read the store, and finalizing MLflow's ~2,300 modules would add about 1 s.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_plot_worker, args=(receiver, str(plot_path)))
    child.start()
    try:
        from orchestration.compare import collect, format_table

        rows = collect(root)
    except BaseException:
        child.kill()
        raise
    sender.send(rows)
    print(format_table(rows), flush=True)
    child.join()
    if child.exitcode != 0:
        raise LensembleError(f"budgets compare: the plot {plot_path} could not be written (plot process exit {child.exitcode})")
    print(f"plot: {plot_path.relative_to(root) if plot_path.is_relative_to(root) else plot_path}", flush=True)
    sys.stderr.flush()
    os._exit(0)


def bench_command(args: list[str]) -> int:
    """`lensemble bench`: the benchmark suite (its own argparse; no Prefect or MLflow involved)."""
    from benchmarks.suite import bench_main

    return bench_main(args)


def profile_command(args: list[str]) -> int:
    """`lensemble profile`: the training-step profiler (its own argparse; no Prefect or MLflow involved)."""
    from benchmarks.profiler import profile_main

    return profile_main(args)


SUITE_HELP = {"bench": "the benchmark suite, each figure beside its physical limit (lensemble bench --help)",
              "profile": "torch profiler trace and span table of a training step (lensemble profile --help)"}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; `bench` and `profile` are listed here but parse their own arguments."""
    parser = argparse.ArgumentParser(prog="lensemble", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="project root (params.yaml, data/, reports/)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run one stage")
    run.add_argument("stage", choices=STAGES)
    sub.add_parser("pipeline", help="run all stages as one Prefect flow")
    sub.add_parser("check-params", help="validate params.yaml and print its hash")
    budgets = sub.add_parser("budgets", help="budget reports across runs")
    budgets.add_argument("action", choices=("compare",))
    budgets.add_argument("--plot", default="reports/plots/budgets_compare.png", help="where to write the plot")
    ablate = sub.add_parser("ablate", help="the (H, anchor weight) ablation grid as a Prefect map")
    ablate.add_argument("--inner-steps", default="25,150", help="comma-separated H values, each dividing rounds x H of params.yaml")
    ablate.add_argument("--anchor-weight", default="0,0.1", help="comma-separated anchor weights")
    ablate.add_argument("--parallel", type=int, default=1, help="grid points run at once")
    join = sub.add_parser("join", help="a robot that took no part in the federation joins it (join.sites in params)")
    join.add_argument("site", help="the joining site, declared in params.yaml under join.sites")
    export = sub.add_parser("export", help="write a site's episodes (data/sites/SITE) as a LeRobot v3.0 dataset, at the site")
    export.add_argument("site", help="the site's name in params.yaml (data.sites)")
    export.add_argument("out", help="the dataset's folder (absent or empty)")
    export.add_argument("--fps", type=int, default=None, help="frames per second recorded (default: the fps of the site's "
                                                              "LeRobot source, else 10)")
    export.add_argument("--camera", default="observation.images.top", help="the video feature the frames go to")
    export.add_argument("--video", choices=("lossless", "playable"), default="lossless",
                        help="lossless: H.264 yuv444p qp 0; playable: H.264 yuv420p crf 18, which browsers play")
    server = sub.add_parser("server", help="the project-local Prefect server")
    server.add_argument("action", choices=("url", "stop"),
                        help="url: the Prefect UI's address (starting the server if none runs); stop: end it")
    server.add_argument("--api", action="store_true",
                        help="url: print the API address (for PREFECT_API_URL) instead of the UI's")
    sub.add_parser("serve", help="serve the pipeline and the scheduled federation-rounds deployments (until Ctrl-C)")
    site = sub.add_parser("site", help="sovereign sites")
    site.add_argument("action", choices=("keygen", "deploy"))
    site.add_argument("name", help="the site's name in params.yaml")
    site.add_argument("--force", action="store_true", help="keygen: replace an existing key (its old pin stops matching)")
    ui = sub.add_parser("ui", help="serve the MLflow UI on the project's store; print its runs-table address and the Prefect UI's")
    ui.add_argument("--port", type=int, default=5000, help="the MLflow UI's port on 127.0.0.1")
    ui.add_argument("--no-serve", action="store_true", help="print the addresses only (a UI already runs on --port)")
    for name, help_text in SUITE_HELP.items():  # dispatched before parsing (main): listed here so --help shows them
        sub.add_parser(name, help=help_text, add_help=False).add_argument("args", nargs=argparse.REMAINDER)
    return parser


def prefect_home() -> Path:
    """The Prefect home `offline_environment` set (or the caller exported)."""
    return Path(os.environ["PREFECT_HOME"])


def check_params_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble check-params`: validate params.yaml (and that its run.device is here) and print its hash."""
    from lensemble.config import load_params

    path = root / "params.yaml"
    params = load_params(path)  # imports no torch: a bad file is a one-line error in well under a second
    from lensemble.device import resolve_device

    resolve_device(params.run.device)
    print(f"{path} is valid (params hash {params.hash()})")


def run_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble run STAGE`: one stage's flow, after its inputs and the warm start are checked."""
    from lensemble.config import load_params

    # fail fast, before any server or run starts: a bad params file or a missing input before torch is imported
    params = load_params(root / "params.yaml")
    from flows.inputs import check_inputs

    check_inputs(args.stage, params, root)
    from lensemble.device import resolve_device

    resolve_device(params.run.device)  # run.device: cuda on a machine without one is a one-line error here
    from lensemble.model.warm_start import validate_warm_start

    validate_warm_start(params, root)
    ensure_server(prefect_home())
    run = stage_flow(args.stage, root)
    freeze_long_lived()  # the imports are done: no collection walks them again (orchestration.heap)
    run(root=str(root))


def budgets_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble budgets compare`."""
    budgets_compare(root, root / args.plot)


def join_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble join SITE`: the site and the federated model checked, then the join flow."""
    from lensemble.config import load_params
    from lensemble.errors import DataError
    from orchestration.join_sites import join_site

    # a bad file, an unknown site or no federated model before torch, Prefect and MLflow are imported
    params = load_params(root / "params.yaml")
    join_site(params, args.site)
    if not (root / "models" / "federated.pt").is_file():
        raise DataError(f"{root / 'models' / 'federated.pt'} does not exist: run the federation first (dvc repro)")
    from flows.join import join_flow
    from lensemble.device import resolve_device

    resolve_device(params.run.device)
    ensure_server(prefect_home())
    join_flow(root=str(root), site=args.site)


def export_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble export SITE OUT`: the site's store, read and checked, written as a LeRobot dataset."""
    import json

    from lensemble.config import load_params
    from lensemble.data.lerobot import write_lerobot
    from lensemble.paths import Layout
    from lensemble.workflow import load_site

    params = load_params(root / "params.yaml")
    if args.site not in {s.name for s in params.data.sites}:
        raise ConfigError(f"site {args.site!r} is not in data.sites; known: {sorted(s.name for s in params.data.sites)}")
    layout = Layout(root)
    source = layout.site_dir(args.site) / "source.json"
    fps = args.fps if args.fps is not None else json.loads(source.read_text())["fps"] if source.is_file() else 10
    if fps < 1:
        raise ConfigError(f"--fps must be >= 1, got {fps}")
    eps = load_site(layout, params, args.site)
    info = write_lerobot(eps, Path(args.out), fps, camera=args.camera, video=args.video)
    print(f"{args.out}: LeRobot {info['codebase_version']} dataset, {info['total_episodes']} episodes, "
          f"{info['total_frames']} frames at {fps} fps")


def ablate_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble ablate`: every grid point's params checked, then the grid as a Prefect map."""
    try:
        inner = tuple(int(v) for v in args.inner_steps.split(","))
        anchors = tuple(float(v) for v in args.anchor_weight.split(","))
    except ValueError:
        raise ConfigError(f"--inner-steps takes integers and --anchor-weight numbers, comma-separated; "
                          f"got {args.inner_steps!r}, {args.anchor_weight!r}") from None
    if args.parallel < 1:
        raise ConfigError(f"--parallel must be >= 1, got {args.parallel}")
    from lensemble.config import load_params, load_yaml
    from orchestration.ablation import grid, point_params, require_inputs

    raw = load_yaml(root / "params.yaml") if (root / "params.yaml").is_file() else None
    for point in grid(load_params(root / "params.yaml"), list(inner), list(anchors)):
        point_params(raw, point)
    require_inputs(root)  # all before any server, run or folder is started, and before Prefect and torch are imported
    from prefect.task_runners import ThreadPoolTaskRunner

    from flows.ablation import ablation_flow

    ensure_server(prefect_home())
    ablation_flow.with_options(task_runner=ThreadPoolTaskRunner(max_workers=args.parallel))(
        root=str(root), inner_steps=inner, anchor_weights=anchors)


def serve_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble serve`: the deployments, after the schedule (and a sovereign run's sites) are checked."""
    from lensemble.config import load_params

    p = load_params(root / "params.yaml")  # a schedule that does not parse fails here, before anything starts
    ensure_server(prefect_home())
    if p.federate.execution == "sovereign":
        from lensemble.paths import Layout
        from orchestration.sites import check_sovereign

        check_sovereign(p, Layout(root))  # pools, deployments, exchange: before any round
    from flows.serve import serve_forever

    serve_forever(root, p)


def keygen_command(root: Path, site: str, force: bool) -> None:
    """`lensemble site keygen SITE`: the site's Ed25519 key (kept if it exists), its fingerprint and the params line."""
    from lensemble.paths import Layout
    from orchestration.site_agent import key_path, keygen

    layout = Layout(root)
    fingerprint, created = keygen(layout, site, force)
    state = "created" if created else "kept the existing"
    print(f"site {site}: {state} Ed25519 signing key {key_path(layout, site)} (mode 0600; it never leaves the site)")
    print(f"fingerprint: {fingerprint}")
    print(f"pin it in the federation's params.yaml, data.sites entry `name: {site}`:")
    print(f"    key_fingerprint: {fingerprint}")


def site_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble site keygen|deploy SITE`."""
    from lensemble.config import load_params

    if args.action == "keygen":  # no params needed: the key exists before its pin does
        keygen_command(root, args.name, args.force)
        return

    load_params(root / "params.yaml")
    ensure_server(prefect_home())
    from flows.site import deploy_site

    print(f"deployment {deploy_site(root, args.name)} registered for site {args.name}")


def server_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble server url|stop`: the UI's address (`--api`: the API's), starting the server if needed; or stop it."""
    home = prefect_home()
    if args.action == "stop":
        record = ServerRecord.read(home)
        if stop_server(home):
            print(f"stopped the Prefect server at {record.ui_url}")
        elif record is not None and record.prefect_home is not None and not record.belongs_to(home):
            print(f"no server running for {home} "
                  f"(its server.json is another project's, {record.prefect_home}: left alone)")
        else:
            print("no server running")
        return
    api = ensure_server(home)
    print("ephemeral" if api is None else api if args.api else ui_url(api))


def mlflow_runs_url(root: Path, port: int) -> str:
    """The MLflow UI's runs table of the lensemble experiment (the UI opens in its GenAI mode without `workflowType`)."""
    from orchestration.tracking import Tracker

    return f"http://127.0.0.1:{port}/#/experiments/{Tracker(root).experiment_id}/runs?workflowType=machine_learning"


def ui_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble ui`: `mlflow ui` on the project's tracking store until Ctrl-C, after printing where to look."""
    import subprocess

    from orchestration.tracking import tracking_uri

    print(f"MLflow runs:  {mlflow_runs_url(root, args.port)}", flush=True)
    home = prefect_home()
    record = ServerRecord.read(home)
    if record is not None and record.belongs_to(home):
        print(f"Prefect runs: {record.ui_url}/runs", flush=True)
    else:
        print("Prefect runs: no server yet (the first stage starts it; then `lensemble server url`)", flush=True)
    if args.no_serve:
        return
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", tracking_uri(root), "--host", "127.0.0.1", "--port", str(args.port)]
    try:
        code = subprocess.call(cmd)
    except KeyboardInterrupt:
        return
    if code != 0:
        raise LensembleError(f"mlflow ui exited with code {code} (port {args.port} in use? try --port)")


def pipeline_command(root: Path, args: argparse.Namespace) -> None:
    """`lensemble pipeline`: every stage as subflows of one flow."""
    from lensemble.config import load_params

    load_params(root / "params.yaml")
    ensure_server(prefect_home())
    from flows.pipeline import pipeline_flow
    pipeline_flow(root=str(root))


SUITES = {"bench": bench_command, "profile": profile_command}
COMMANDS = {
    "check-params": check_params_command, "run": run_command, "budgets": budgets_command, "ablate": ablate_command,
    "join": join_command, "export": export_command,
    "serve": serve_command, "site": site_command, "server": server_command, "pipeline": pipeline_command, "ui": ui_command,
}


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit code (a LensembleError prints one line and gives its code)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    skip_final_collection()  # before any library registers its own exit handlers, so the freeze runs after them
    if argv and argv[0] in SUITES:
        return SUITES[argv[0]](argv[1:])
    args = build_parser().parse_args(argv)
    if args.cmd in SUITES:  # `lensemble --root R bench ...`: the suites take no root
        return SUITES[args.cmd](args.args)
    root = Path(args.root)
    offline_environment(root)
    console_logging()
    sys.path.insert(0, str(root.resolve()))
    try:
        COMMANDS[args.cmd](root, args)
    except LensembleError as exc:
        print(f"lensemble: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
