"""The scalable metrics path, real: sidecar -> Prometheus (agent mode) -> VictoriaMetrics <- vmalert.

A real `parwatch sidecar` takes synthetic steps of a tp=2, pp=2 run (four ranks, two stages) twice
a second. Prometheus 2.42 in agent mode (`--enable-feature=agent`: scrape and remote write, no
queries, no rules) scrapes it every second and remote-writes into VictoriaMetrics
(`victoria-metrics`, Debian package). vmalert (same package) evaluates
dashboards/recording_rules.yaml against VictoriaMetrics and remote-writes the recorded series back.
Then every dashboard query and every alert expression must be answered by VictoriaMetrics'
/api/v1/query without error, and with data wherever the run produces the metrics behind it.

Binaries are found on PATH (scripts/setup.sh test installs them); the test skips without them.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import yaml

from parwatch import bubble, catalog
from parwatch import dashboards as dash
from parwatch import recording as rec
from parwatch.rank_layout import RankLayout
from parwatch.vocabulary import SelfPart
from tests import one_client
from tests.deadline import wait_until
from tests.fixtures import synthetic as syn
from tests.sidecar_process import free_port, running_sidecar, stop

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
RECORDING_RULES = ROOT / "dashboards" / "recording_rules.yaml"
ALERTS = ROOT / "dashboards" / "alerts.yaml"
BINARIES = {name: shutil.which(name) for name in ("prometheus", "victoria-metrics", "vmalert")}
SUBSTITUTIONS = {"$__range_s": "300", "$__range": "5m", "$price_per_gpu_hour": "2.5", "$job": "parwatch"}
START_TIMEOUT_S = 60
RECORDED_LAG_S = 20
"""How long a recorded series may lag its exported sources (vmalert evaluates every 1 s, flushes every 0.5 s)."""
TP, PP = 2, 2
# Rank 0's view of each stage, with the split of its bubble by cause a real run's view carries.
STAGES = [
    {
        **syn.stage_view(0, 0.5, 0.38),
        "bubble_schedule_ratio": 0.2,
        "bubble_imbalance_ratio": 0.0,
        "bubble_wait_ratio": 0.02,
    },
    {
        **syn.stage_view(1, 0.5, 0.3),
        "bubble_schedule_ratio": 0.2,
        "bubble_imbalance_ratio": 0.1,
        "bubble_wait_ratio": 0.03,
    },
]
RECORDED = re.compile(r"\b[a-z_]+:parwatch_[a-z0-9_]+:[a-z0-9_]+")

missing = [name for name, path in BINARIES.items() if path is None]
if missing:
    pytest.skip(
        f"{', '.join(missing)} not installed (scripts/setup.sh test: Debian packages prometheus, victoria-metrics)",
        allow_module_level=True,
    )


FEED = {"loss": 2.0}
"""The loss the feeding thread posts (the last test turns it to NaN)."""


def post_step(control_url: str, step: int, headers: dict) -> None:
    summaries = [
        syn.summary(
            r,
            step,
            tp=TP,
            pp=PP,
            time=time.time(),
            checkpoints=[1] if step > 1 else [],
            loss=FEED["loss"],
            compute_scale=0.5 if r == 3 else 1.0,
            global_stages=STAGES if r == 0 else None,
        )
        for r in range(TP * PP)
    ]
    summaries[0]["model_flops_utilization_ratio"] = 0.41
    for summary in summaries:  # parwatch's own time on the rank, by part, as its collector counts it
        summary["self_seconds"] = {part.value: 0.001 * step for part in SelfPart}
    r = one_client.post(
        f"{control_url}/v1/ingest", json={"version": 1, "summaries": summaries}, headers=headers, timeout=10
    )
    r.raise_for_status()
    for rank in range(TP * PP):  # and each rank's live activity, as its collector's thread posts it
        r = one_client.post(f"{control_url}/v1/activity", json=activity(rank, step), headers=headers, timeout=10)
        r.raise_for_status()


def activity(rank: int, step: int) -> dict:
    tp_rank, stage, dp_rank = RankLayout(TP, PP, 1).coords(rank)
    now = time.time()
    a = {
        "run_id": "synthetic",
        "rank": rank,
        "pid": 10_000 + rank,
        "host": "synthetic",
        "stage": stage,
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "tp": TP,
        "pp": PP,
        "dp": 1,
        "state": "running",
        "step": step,
        "step_seconds": 0.5,
        "kind": "forward",
        "op": None,
        "group": None,
        "peer": None,
        "seq": None,
        "since": now - 0.1,
        "time": now,
    }
    return {"version": 1, "activity": a}


@contextlib.contextmanager
def feeding(control_url: str, headers: dict):
    """A thread that posts one step every 0.5 s until the block ends."""
    done = threading.Event()
    errors: list[BaseException] = []

    def run():
        step = 1
        while not done.is_set():
            try:
                post_step(control_url, step, headers)
            except Exception as err:  # noqa: BLE001  (reported by the fixture, not lost in a thread)
                errors.append(err)
                return
            step += 1
            done.wait(0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield errors
    finally:
        done.set()
        thread.join(timeout=10)


@contextlib.contextmanager
def process(args: list[str], log_path: Path):
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        stop(proc, timeout=10)


def wait_ready(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args[0]} exited early:\n{log_path.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if one_client.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"{url} did not answer within {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")


@contextlib.contextmanager
def serving(argv: Callable[[int], list[str]], log_path: Path, ready_path: str, tries: int = 3):
    """A server `argv(port)` on a port the kernel just reported free, answering `ready_path`: its port. Started
    again on another when that port was taken before it bound it (CI on adaffc1: vmalert's, picked when the
    fixture began, was another process's by the time vmalert started)."""
    for attempt in range(tries):
        port = free_port()
        with process(argv(port), log_path) as proc:
            try:
                wait_ready(f"http://127.0.0.1:{port}{ready_path}", proc, log_path)
            except AssertionError:
                if attempt + 1 < tries and "address already in use" in log_path.read_text().lower():
                    continue
                raise
            yield port
            return


def test_a_server_whose_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    import socket
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picked: list[int] = []  # the taken port first, then a free one
        real = free_port

        def pick() -> int:
            picked.append(real() if picked else taken.getsockname()[1])
            return picked[-1]

        monkeypatch.setitem(globals(), "free_port", pick)  # what serving() calls
        argv = lambda port: [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]  # noqa: E731
        with serving(argv, tmp_path / "server.log", "/") as port:
            assert picked == [taken.getsockname()[1], port], picked
            assert one_client.get(f"http://127.0.0.1:{port}/", timeout=10).status_code == 200


def query(vm: str, promql: str) -> dict:
    return query_at(vm, promql, None)


def query_at(vm: str, promql: str, at: float | None) -> dict:
    """An instant query, now or at `at` (Unix seconds)."""
    params = {"query": promql} if at is None else {"query": promql, "time": str(at)}
    r = one_client.get(f"{vm}/api/v1/query", params=params, timeout=30)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{promql}: {body.get('error', r.text)}"
    return body


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """(VictoriaMetrics URL, the sidecar's metrics URL) once recorded series are in VictoriaMetrics."""
    tmp = tmp_path_factory.mktemp("vm")
    with contextlib.ExitStack() as stack:
        sidecar = stack.enter_context(running_sidecar(tmp / "state"))
        errors = stack.enter_context(feeding(sidecar.control_url, sidecar.headers))
        one_client.post(
            f"{sidecar.control_url}/v1/control", json={"action": "pause"}, headers=sidecar.headers, timeout=10
        )  # an action counter
        # -search.latencyOffset=0s: answer with samples up to now (default: hide the newest 30 s).
        vm_port = stack.enter_context(
            serving(
                lambda port: [
                    BINARIES["victoria-metrics"],
                    f"-storageDataPath={tmp / 'vm-data'}",
                    f"-httpListenAddr=127.0.0.1:{port}",
                    "-search.latencyOffset=0s",
                    "-search.disableCache",
                    "-loggerLevel=WARN",
                ],
                tmp / "victoria-metrics.log",
                "/health",
            )
        )
        vm_url = f"http://127.0.0.1:{vm_port}"
        agent_config = {
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [
                {"job_name": "parwatch", "static_configs": [{"targets": [sidecar.metrics_url.removeprefix("http://")]}]}
            ],
            "remote_write": [
                {"url": f"{vm_url}/api/v1/write", "queue_config": {"batch_send_deadline": "1s", "min_backoff": "100ms"}}
            ],
        }
        (tmp / "agent.yml").write_text(yaml.safe_dump(agent_config))
        stack.enter_context(
            serving(
                lambda port: [
                    BINARIES["prometheus"],
                    "--enable-feature=agent",
                    f"--config.file={tmp / 'agent.yml'}",
                    f"--storage.agent.path={tmp / 'agent-wal'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                tmp / "prometheus-agent.log",
                "/-/ready",
            )
        )
        stack.enter_context(
            serving(
                lambda port: [
                    BINARIES["vmalert"],
                    f"-rule={RECORDING_RULES}",
                    f"-datasource.url={vm_url}",
                    f"-remoteWrite.url={vm_url}",
                    "-evaluationInterval=1s",
                    "-remoteWrite.flushInterval=500ms",
                    f"-httpListenAddr=127.0.0.1:{port}",
                    "-loggerLevel=WARN",
                ],
                tmp / "vmalert.log",
                "/health",
            )
        )
        # Recorded rates need two scrapes in VictoriaMetrics, then a few evaluations written back; the feed's
        # first guardrail actions (its straggler and bubble-excess alerts, ~10 s in) two recorded points.
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert not errors, f"feeding the sidecar failed: {errors[0]!r}"
            result = query(vm_url, "count_over_time(job:parwatch_tokens:rate1m[1m])")["data"]["result"]
            acted = query(vm_url, "count_over_time(rule_action:parwatch_guardrail_actions:max[1m])")["data"]["result"]
            recorded = (
                result and float(result[0]["value"][1]) >= 3 and query(vm_url, rec.stage_bubble())["data"]["result"]
            )
            if recorded and acted and min(float(r["value"][1]) for r in acted) >= 2:
                break
            assert time.monotonic() < deadline, (
                f"no recorded series in VictoriaMetrics after {START_TIMEOUT_S} s\n--- vmalert ---\n"
                f"{(tmp / 'vmalert.log').read_text()[-2000:]}\n--- agent ---\n"
                f"{(tmp / 'prometheus-agent.log').read_text()[-2000:]}"
            )
            time.sleep(0.5)
        yield vm_url, sidecar.metrics_url


def concrete(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


RECORDINGS = {r.record: r.expr for r in rec.recordings()}


def sources(expr: str) -> set[str]:
    """Catalogue metrics behind an expression over recorded series."""
    return {
        catalog.metric(n).name
        for name in RECORDED.findall(expr)
        for n in re.findall(r"\bparwatch_[a-z0-9_]+", RECORDINGS[name])
    }


@pytest.fixture(scope="module")
def vm(path) -> str:
    return path[0]


@pytest.fixture(scope="module")
def exported(vm) -> set[str]:
    """Catalogue metrics the run put into VictoriaMetrics (the collector's newer ones join at merge)."""
    names = one_client.get(f"{vm}/api/v1/label/__name__/values", timeout=30).json()["data"]
    return {catalog.SERIES[n].name for n in names if n in catalog.SERIES}


PANEL_QUERIES = [(p["title"], t["refId"], t["expr"]) for p in dash.build_dashboard()["panels"] for t in p["targets"]]
ALERT_RULES = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
# Series that exist only while something is wrong: no data is the right answer for a healthy run.
ONLY_WHEN_WRONG = {rec.RANKS_NOT_RUNNING, rec.RANKS_DOWN}


def test_the_sidecars_metrics_reached_victoriametrics_through_the_agent(exported):
    assert {
        "parwatch_stage_bubble_ratio",
        "parwatch_step_duration_seconds",
        "parwatch_rank_up",
        "parwatch_collective_duration_seconds",
        "parwatch_guardrail_actions_total",
    } <= exported


@pytest.mark.parametrize("title,ref,expr", PANEL_QUERIES, ids=[f"{t}:{r}" for t, r, _ in PANEL_QUERIES])
def test_panel_query_is_answered_by_victoriametrics(vm, exported, title, ref, expr):
    produced = sources(expr) <= exported and not set(RECORDED.findall(expr)) & ONLY_WHEN_WRONG
    if produced:
        # A recorded series lags its sources by an evaluation and a write back (1.5 s here; more under
        # load: CI on 7d17fbd queried the straggler ratio's before vmalert had written it).
        wait_until(
            lambda: query(vm, concrete(expr))["data"]["result"],
            f"{title} ({ref}) to return data from VictoriaMetrics: {concrete(expr)}",
            timeout=RECORDED_LAG_S,
            interval=0.5,
        )
    else:
        query(vm, concrete(expr))


@pytest.mark.parametrize("alert", ALERT_RULES, ids=[a["alert"] for a in ALERT_RULES])
def test_alert_expression_is_answered_by_victoriametrics(vm, exported, alert):
    """The condition itself is empty in a healthy run; the recorded series it judges are not."""
    query(vm, alert["expr"])
    for name in RECORDED.findall(alert["expr"]):
        if sources(name) <= exported:
            assert query(vm, name)["data"]["result"], f"{alert['alert']} reads {name}, which has no data"


def test_run_variable_lists_the_scrape_job(vm):
    """The dashboard's job variable (label_values of a recorded series) finds the run."""
    r = one_client.get(f"{vm}/api/v1/label/job/values", params={"match[]": "job:parwatch_train_step:max"}, timeout=30)
    assert r.json()["data"] == [SUBSTITUTIONS["$job"]]


def test_the_recorded_stage_bubble_is_the_bubble_modules(vm):
    """One bubble per stage, end to end: what vmalert recorded is parwatch.bubble's PromQL, evaluated by
    VictoriaMetrics at the instant vmalert evaluated it. Not exactly: vmalert may evaluate before the agent's
    last batch (1 s) lands, so its window can lack the newest scrape, which VictoriaMetrics then has (stage 1:
    0.4 recorded against 0.396 at the same instant, CI on 9b3ba50); a different expression is caught where it
    moves a stage's ratio by more than 0.01."""
    result = query(vm, rec.stage_bubble())["data"]["result"]
    recorded = {r["metric"]["stage"]: float(r["value"][1]) for r in result}
    at = min(float(r["value"][0]) for r in result)
    raw = {
        r["metric"]["stage"]: float(r["value"][1])
        for r in query_at(vm, bubble.promql(rec.RATE_WINDOW, ("stage",)), at)["data"]["result"]
    }
    assert set(recorded) == {"0", "1"} and recorded == pytest.approx(raw, abs=0.01)
    assert recorded["1"] > recorded["0"]  # rank 3 computes half as long: stage 1 idles more


ABSENT_FROM_THIS_RUN = {
    "parwatch_posts_refused_total": "a healthy run refuses nothing",
    # ml-goodput-measurement's step figures need steps of 1 s or more; this feed's are 0.5 s.
    "parwatch_ideal_step_seconds": "steps of 1 s or more",
    "parwatch_step_time_deviation_seconds": "steps of 1 s or more",
    "parwatch_collective_unmatched_total": "every member's instance record arrives",
    "parwatch_tracker_points_written_total": "the sidecar exports to no tracker (--export)",
    "parwatch_tracker_points_dropped_total": "the sidecar exports to no tracker (--export)",
    "parwatch_rank_transient_faults_total": "a healthy rank records no transient fault",
}
"""Catalogue metrics this healthy feed must not produce, and why; every other one reaches VictoriaMetrics."""


def test_every_metric_but_those_of_a_fault_reaches_victoriametrics(exported):
    assert {m.name for m in catalog.METRICS} - exported == set(ABSENT_FROM_THIS_RUN)


def test_a_panel_is_let_off_only_for_a_series_of_a_fault(exported):
    """The panel queries above may come back empty only when they read what this run does not produce, each
    for a named reason (9 of the dashboard's 79 queries today; the old bar let a quarter off)."""
    let_off, unexplained = {}, []
    for title, ref, expr in PANEL_QUERIES:
        missing = sources(expr) - exported
        why = [ABSENT_FROM_THIS_RUN[m] for m in missing if m in ABSENT_FROM_THIS_RUN]
        why += [f"{name}: only while something is wrong" for name in set(RECORDED.findall(expr)) & ONLY_WHEN_WRONG]
        unexplained += [(title, ref, m) for m in missing if m not in ABSENT_FROM_THIS_RUN]
        if why:
            let_off[f"{title} ({ref})"] = why
    print(f"{len(let_off)} of {len(PANEL_QUERIES)} panel queries let off: {let_off}")
    assert unexplained == [] and len(let_off) < len(PANEL_QUERIES) / 8, (unexplained, let_off)


def test_the_real_sidecar_stays_within_the_series_budget_per_rank(path):
    from prometheus_client.parser import text_string_to_metric_families

    per_rank: dict[str, int] = {}
    for fam in text_string_to_metric_families(one_client.get(f"{path[1]}/metrics", timeout=10).text):
        for s in fam.samples:
            if "rank" in s.labels:
                per_rank[s.labels["rank"]] = per_rank.get(s.labels["rank"], 0) + 1
    assert sorted(per_rank) == [str(r) for r in range(TP * PP)]
    assert max(per_rank.values()) <= catalog.SERIES_BUDGET_PER_RANK, per_rank


def test_a_nan_loss_pages_through_victoriametrics(vm):
    """VictoriaMetrics drops NaN samples at ingestion, so the nonfinite-loss alert reads the sidecar's
    0/1 flag: a NaN loss must make its expression fire on this path. Last in the module: it turns the
    run's loss to NaN for good."""
    nan_alert = next(a for a in ALERT_RULES if a["alert"] == "ParwatchNonfiniteLoss")
    assert not query(vm, nan_alert["expr"])["data"]["result"]  # finite so far
    FEED["loss"] = float("nan")
    deadline = time.monotonic() + 30
    while not query(vm, nan_alert["expr"])["data"]["result"]:
        assert time.monotonic() < deadline, "a NaN loss did not reach the nonfinite-loss alert within 30 s"
        time.sleep(0.5)
    flag = query(vm, "job:parwatch_loss_nonfinite:max")["data"]["result"]
    assert [float(r["value"][1]) for r in flag] == [1.0]
