"""Runs the GPU kit's steps in order, each in its own process, into one JSON and one log.

    python bench/gpu/driver.py [--tier 1|2|all] [--rehearse] [--out DIR] [--budget-s S] [--only a,b]
                               [--build-here] [--use-env]

(bash bench/gpu/run.sh is the way in; docs/gpu.md says what each step measures.)

* Setup steps run first in every call (a second call may land on a fresh machine): machine,
  install-kit, extension, and te-extension for tier 2. Later steps that need a setup step
  that failed are skipped, with that reason; independent steps still run.
* Each step gets its own timeout, cut to what is left of ``--budget-s`` (the call's limit);
  a step that cannot start with enough time left is recorded as skipped.
* After every step OUT/gpu-results.json is rewritten (a call killed at its limit still leaves
  what was measured), and OUT/gpu-run.log gets every step's output as it is printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MIN_STEP_S = 20  # a step started with less time than this left could not finish anything


@dataclass(frozen=True)
class Step:
    name: str
    script: str  # under bench/gpu
    tier: int  # 0: setup, run in every call
    timeout_s: int  # on the lent H200; docs/gpu.md has the expected times
    needs: Tuple[str, ...] = ()  # setup steps it cannot run without
    te: bool = False  # sees Transformer Engine's target on its path


STEPS = (
    Step("machine", "setup_steps.py", 0, 60),
    Step("install-kit", "setup_steps.py", 0, 120),
    Step("extension", "setup_steps.py", 0, 420, needs=("install-kit",)),
    Step("kernel-tests", "kernels.py", 1, 240, needs=("install-kit", "extension")),
    Step("kernel-bench", "kernels.py", 1, 240, needs=("install-kit", "extension")),
    Step("layer-bench", "layers.py", 1, 180, needs=("install-kit", "extension")),
    Step("train-bf16", "training.py", 1, 240, needs=("install-kit", "extension")),
    Step("te-extension", "setup_steps.py", 2, 420, needs=("install-kit",)),
    Step("te-vs-local", "te_parity.py", 2, 180, needs=("install-kit", "extension", "te-extension"), te=True),
    Step("te-layer-bench", "layers.py", 2, 180, needs=("install-kit", "extension", "te-extension"), te=True),
    Step("fp8-training", "training.py", 2, 360, needs=("install-kit", "extension", "te-extension"), te=True),
)


def selected(tiers: List[int], only: Optional[List[str]]) -> List[Step]:
    """The steps of ``tiers`` (setup steps always), in order; ``only`` narrows them to the named
    steps, the setup steps those need, and "machine"."""
    steps = [s for s in STEPS if s.tier == 0 or s.tier in tiers]
    if only:
        unknown = set(only) - {s.name for s in STEPS}
        if unknown:
            raise SystemExit(f"unknown steps {sorted(unknown)}; steps: {', '.join(s.name for s in STEPS)}")
        # and always "machine": the record's device, driver and versions
        wanted = set(only) | {"machine"} | {need for s in STEPS if s.name in only for need in s.needs}
        steps = [s for s in steps if s.name in wanted]
    return steps


class Run:
    """The call's record: OUT/gpu-results.json, OUT/gpu-run.log, and progress on stdout."""

    def __init__(self, out: Path, budget_s: float, rehearse: bool, tiers: List[int], work: Path):
        self.out, self.budget_s, self.rehearse, self.work = out, budget_s, rehearse, work
        self.start = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out / "gpu-results.json", out / "gpu-run.log"
        self.log = open(self.log_path, "a", buffering=1)
        self.record = {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rehearsal": rehearse, "tiers": tiers, "budget_s": budget_s, "steps": {},
        }
        self.save()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, text: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")

    def save(self) -> None:
        self.record["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=1, default=str))
        os.replace(tmp, self.json_path)

    def environment(self, step: Step) -> dict:
        sites = [str(ROOT), str(self.work / "site")] + ([str(self.work / "site-te")] if step.te else [])
        return dict(os.environ, PYTHONPATH=os.pathsep.join(sites), PYTHONUNBUFFERED="1",
                    GPU_KIT_WORK=str(self.work))

    def run_step(self, step: Step) -> None:
        record = {"tier": step.tier}
        self.record["steps"][step.name] = record
        failed = [n for n in step.needs if self.record["steps"].get(n, {}).get("status") not in ("ok", "rehearsed")]
        remaining = self.budget_s - self.elapsed()
        if failed:
            record.update(status="skipped", reason=f"needs {', '.join(failed)}")
        elif remaining < MIN_STEP_S:
            record.update(status="skipped", reason=f"no time left ({remaining:.0f}s of the budget)")
        else:
            self._execute(step, record, timeout=min(step.timeout_s, remaining - 5))
        self.say(f"{step.name}: {record['status']}" + (f" ({record['seconds']}s)" if "seconds" in record else "")
                 + (f" -- {record['reason']}" if "reason" in record else ""))
        self.save()

    def _execute(self, step: Step, record: dict, timeout: float) -> None:
        self.say(f"{step.name}: start (timeout {timeout:.0f}s)")
        record["status"] = "running"  # what a call killed at its limit leaves in the JSON
        self.save()
        result = Path(tempfile.mkstemp(prefix=f"{step.name}-", suffix=".json", dir=self.work)[1])
        command = [sys.executable, str(HERE / step.script), step.name, "--result", str(result)]
        command += ["--rehearse"] if self.rehearse else []
        log_offset = self.log.tell()
        self.log.write(f"----- {step.name}: {' '.join(command)}\n")
        begin = time.monotonic()
        process = subprocess.Popen(command, cwd=ROOT, env=self.environment(step), stdout=self.log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the step and the ranks it launched
            process.wait()
            code = None
        record["seconds"] = round(time.monotonic() - begin, 1)
        text = result.read_text() if result.exists() else ""
        result.unlink(missing_ok=True)
        if code == 0 and text:
            record["result"] = json.loads(text)
            stopped = record["result"].get("stopped_at_gpu")
            record["status"] = "rehearsed" if self.rehearse else "ok"
            if stopped:
                record["reason"] = f"stopped where a GPU is needed: {stopped}"
        else:
            record["status"] = "timeout" if code is None else "failed"
            record["reason"] = f"killed after {timeout:.0f}s" if code is None else f"exit code {code}"
            self.log.flush()
            with open(self.log_path) as log:
                log.seek(log_offset)
                record["error_tail"] = log.read()[-4000:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", default="all", choices=["1", "2", "all"])
    parser.add_argument("--rehearse", action="store_true", help="CPU rehearsal: no GPU needed, numbers are not measurements")
    parser.add_argument("--out", type=Path, help="where the JSON and the log go (default: $OUT, else WORK/out)")
    parser.add_argument("--budget-s", type=float, default=570.0, help="seconds this call may take (the tool allows 600)")
    parser.add_argument("--only", help="comma-separated step names (the setup steps they need run too)")
    parser.add_argument("--build-here", action="store_true",
                        help="build both extensions on this machine even where the kit's prebuilt ones match")
    parser.add_argument("--use-env", action="store_true",
                        help="this Python already has megatron-core, the built extension (and TE for tier 2), "
                             "e.g. an NGC container: the setup steps check them instead of installing the kit")
    args = parser.parse_args(argv)
    tiers = [1, 2] if args.tier == "all" else [int(args.tier)]
    work = Path(os.environ.get("GPU_KIT_WORK", "/tmp/megatron-siamese-gpu"))
    work.mkdir(parents=True, exist_ok=True)
    if args.use_env:
        os.environ["GPU_KIT_USE_ENV"] = "1"  # read by setup_steps.py
    if args.build_here:
        os.environ["GPU_KIT_BUILD_HERE"] = "1"
    out = args.out or Path(os.environ.get("OUT") or work / "out")
    run = Run(out, args.budget_s, args.rehearse, tiers, work)
    run.record.update(use_env=args.use_env, build_here=args.build_here)
    steps = selected(tiers, args.only.split(",") if args.only else None)
    run.say(f"{'rehearsal' if args.rehearse else 'GPU run'}: tiers {tiers}, steps {', '.join(s.name for s in steps)}; "
            f"results in {run.json_path}")
    for step in steps:
        run.run_step(step)
    sys.path.insert(0, str(HERE))
    import report

    run.say("summary\n" + report.render([run.record]))
    statuses = [s["status"] for s in run.record["steps"].values()]
    return 0 if all(s in ("ok", "rehearsed") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
