"""Does a watched run exit cleanly? N consecutive short runs per case, every exit code counted.

    python benchmarks/clean_exit.py --runs 300
    python benchmarks/clean_exit.py --runs 50 --cases trainer,example-sidecar-killed

Cases: the reference trainer (`python -m parwatch.trainer --nproc 2`, PP2 1F1B, synthetic 40/80 ms, 6 steps)
and examples/torch_pipelining.py under torchrun (the integration attached), each
- plain: the collector writes its JSONL files (shipper thread, send lanes, boundary all-reduce);
- unreachable: also pointed at a sidecar port nobody listens on (shipper and activity back off);
- sidecar-killed: a real sidecar, SIGKILLed ~1 s into the run;
- off: the same run unwatched (the baseline).
Before issue 26's fix, 4 of 28 plain trainer runs ended in SIGABRT after training completed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, print_table, write_json  # noqa: E402

TRAINER = [
    "-m",
    "parwatch",
    "train",
    "--nproc",
    "2",
    "--tp",
    "1",
    "--pp",
    "2",
    "--schedule",
    "1f1b",
    "--microbatches",
    "2",
    "--steps",
    "6",
    "--layers",
    "2",
    "--hidden",
    "32",
    "--heads",
    "2",
    "--vocab",
    "64",
    "--seq-len",
    "8",
    "--synthetic-compute",
    "fwd_ms=40,bwd_ms=80",
]
EXAMPLE = [
    "-m",
    "torch.distributed.run",
    "--nproc-per-node",
    "2",
    "--master-port",
    "{port}",
    str(ROOT / "examples" / "torch_pipelining.py"),
    "--schedule",
    "1f1b",
    "--microbatches",
    "2",
    "--synthetic-ms",
    "40,80",
    "--steps",
    "6",
]
CASES = (
    "trainer",
    "trainer-unreachable",
    "trainer-sidecar-killed",
    "trainer-off",
    "example",
    "example-unreachable",
    "example-sidecar-killed",
    "example-off",
)
RUN_TIMEOUT_S = 120.0
KILL_AFTER_S = 1.0


def command(case: str, log_dir: str, endpoint: str | None, token_file: str | None, port: int) -> list[str]:
    trainer = case.startswith("trainer")
    base = TRAINER if trainer else [a.replace("{port}", str(port)) for a in EXAMPLE]
    cmd = [sys.executable, *base]
    if case.endswith("-off"):
        return cmd + (["--parwatch", "off"] if trainer else ["--no-parwatch"])
    cmd += (["--parwatch", "on"] if trainer else []) + ["--parwatch-log", log_dir]
    if endpoint:
        cmd += ["--parwatch-endpoint", endpoint]
    if token_file:
        cmd += ["--parwatch-token-file", token_file]
    return cmd


def one_run(case: str, tmp: Path, index: int) -> tuple[int, str]:
    """(exit code, the output's last lines) of one run."""
    from tests.sidecar_process import free_port, running_sidecar

    run_dir = tmp / f"{case}-{index}"
    run_dir.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PARWATCH_TOKEN", None)

    def launch(endpoint=None, token_file=None) -> tuple[int, str]:
        cmd = command(case, str(run_dir / "log"), endpoint, token_file, free_port())
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return 124, out.decode(errors="replace")[-1500:]
        return proc.returncode, out.decode(errors="replace")[-1500:]

    if case.endswith("-unreachable"):
        return launch(f"http://127.0.0.1:{free_port()}")
    if case.endswith("-sidecar-killed"):
        with running_sidecar(run_dir / "state") as sidecar:
            killer = threading.Timer(KILL_AFTER_S, sidecar.proc.kill)
            killer.start()
            try:
                return launch(sidecar.control_url, str(sidecar.token_file))
            finally:
                killer.cancel()
    return launch()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=300, help="runs per case (default 300)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "clean_exit.json"))
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    results, rows = {}, []
    with tempfile.TemporaryDirectory(prefix="parwatch-clean-exit-") as tmp:
        for case in cases:
            codes: Counter = Counter()
            failures = []
            t0 = time.monotonic()
            for i in range(args.runs):
                code, tail = one_run(case, Path(tmp), i)
                codes[code] += 1
                if code != 0 and len(failures) < 5:
                    failures.append({"run": i, "code": code, "output": tail})
            seconds = time.monotonic() - t0
            aborts = sum(n for c, n in codes.items() if c in (-6, 134, 250))
            results[case] = {
                "runs": args.runs,
                "exit_codes": {str(c): n for c, n in sorted(codes.items())},
                "clean": codes[0],
                "aborts": aborts,
                "seconds_per_run": seconds / args.runs,
                "failures": failures,
            }
            rows.append(
                [
                    case,
                    args.runs,
                    codes[0],
                    args.runs - codes[0],
                    aborts,
                    " ".join(f"{c}:{n}" for c, n in sorted(codes.items())),
                    seconds / args.runs,
                ]
            )
            print(f"{case}: {codes[0]}/{args.runs} exited 0 ({dict(codes)})", flush=True)
    print()
    print_table(["case", "runs", "exit 0", "non-zero", "SIGABRT", "exit codes", "s/run"], rows)
    write_json(args.json, {"runs": args.runs, "cases": results})
    return 0 if all(r["clean"] == r["runs"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
